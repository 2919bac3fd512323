"""Airflow DAGs: one per ``conf/pipelines/*.yaml`` (ids ``millpond_<name>``); the shape lives in millpond.dagfactory."""

from millpond.dagfactory import build_dags

globals().update(build_dags())
