"""Engines: who runs a batch.

``local`` (``engines.local``): the batch's rows in this process, its per-key step over every core.
``spark`` (``engines.spark_batch``): the whole batch as a PySpark job on the warm Spark, rows read, computed
and written on executors; this process plans and commits. ``select`` picks one for a batch; both give
identical tables (``tests/test_spark_engine.py``)."""

from __future__ import annotations

from millpond.config import Settings


def runs_on_spark(settings: Settings, spark, planned_bytes: int, windowed: bool) -> bool:
    """Spark when the deployment says so and a session is at hand, for windowed pipelines whose planned
    landing files hold at least ``engine.local_below`` bytes (0: every batch)."""
    wanted = spark is not None and settings.engine == "spark" and windowed
    return wanted and planned_bytes >= settings.engine_local_below
