"""Airflow DAGs: one per ``conf/pipelines/*.yaml`` (ids ``millpond_<name>``); their shape: millpond.orchestration."""

from millpond.orchestration.dagfactory import build_dags

globals().update(build_dags())
