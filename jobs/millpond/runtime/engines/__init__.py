"""Engines: who runs a batch.

``local`` (``engines.local``): the batch's rows in this process, its per-key step over every core.
``spark`` (``engines.spark_batch``): the whole batch as a PySpark job on the warm Spark, rows read, computed
and written on executors; this process plans and commits. ``select`` picks one for a batch; both give
identical tables (``tests/test_spark_engine.py``).

Which engine an entry point uses is chosen here, once: every entry point (the DAG task, and through it
backfills and reprocesses; ``millpond batch``, ``run``, ``replay``) calls ``choose``: the deployment's
``engine.name``, or the command's ``--engine`` (a backfill's runs get it in their conf). With spark, the
batches are clients of the deployment's Connect endpoint (``spark_client.connect``); nothing answering there
is an error in one line, never a silent in-process run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.runtime.engines.base import BatchWork, Engine

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: the engines a deployment or a command can name
ENGINES = ("local", "spark")


def engine_for(settings: Settings, forced: str | None = None) -> str:
    """The engine an entry point's batches run on: ``forced`` (a command's ``--engine``) when given, else the
    deployment's ``engine.name``."""
    engine = forced or settings.engine
    if engine not in ENGINES:
        raise MillpondError(f"engine {engine!r}: use local or spark")
    return engine


def spark_for(settings: Settings, forced: str | None = None, *, hint: str = "") -> Any:
    """The session the batches run on: with engine spark, a client of the deployment's Connect endpoint (the
    one the DAG task uses, ``spark_client.connect``); with local, None (in-process). Nothing answering there
    is one line naming `make up`, followed by ``hint`` (a command's way out: ``--engine local``)."""
    if engine_for(settings, forced) != "spark":
        return None
    from millpond.runtime.engines.spark_client import connect

    try:
        return connect(settings)
    except MillpondError as exc:
        if not hint:
            raise
        raise MillpondError(f"{exc}; {hint}") from exc


def choose(settings: Settings, forced: str | None = None, *, hint: str = "") -> tuple[Settings, Any]:
    """What every entry point calls: its settings with the chosen engine (``engine_for``) and that engine's
    session (``spark_for``: a Connect session, or None for local)."""
    engine = engine_for(settings, forced)
    if engine != settings.engine:
        settings = settings.with_overrides(engine=engine)
    return settings, spark_for(settings, hint=hint)


def create_engine(job: BatchContext, work: BatchWork) -> Engine:
    """The engine that runs ``work``: Spark when the batch's settings say spark and a session is at hand (every
    kind of pipeline runs there: windows and MillWheel computations, over landing files or, a stage, over its
    upstreams' panes) and the batch's planned input holds at least ``engine.local_below`` bytes (0: every batch;
    a stage's upstream pane rows count a landing line's bytes each); else the local engine."""
    from millpond.runtime.engines.local import LocalEngine
    from millpond.runtime.engines.spark import LANDING_BYTES_PER_ROW, SparkEngine, input_rows

    if job.spark is None or job.settings.engine != "spark":
        return LocalEngine()
    if job.settings.engine_local_below <= 0:
        return SparkEngine()
    if job.spec.upstream is None:
        return SparkEngine() if work.planned_bytes >= job.settings.engine_local_below else LocalEngine()
    rows = input_rows(job, work)  # a stage: its upstream range's log entries, read once for both decisions
    return SparkEngine(rows) if rows * LANDING_BYTES_PER_ROW >= job.settings.engine_local_below else LocalEngine()
