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
    """The engine that runs ``work``: Spark when the batch's settings say spark and a session is at hand, for
    pipelines the Spark engine runs, and for batches whose planned landing files hold at least
    ``engine.local_below`` bytes (0: every batch; a stage's upstream pane rows count a landing line's bytes each);
    else the local engine."""
    from millpond.runtime.engines.local import LocalEngine
    from millpond.runtime.engines.spark import SparkEngine

    wanted = job.spark is not None and job.settings.engine == "spark" and on_spark(job)
    if wanted and _input_bytes(job, work) >= job.settings.engine_local_below:
        return SparkEngine()
    return LocalEngine()


def _input_bytes(job: BatchContext, work: BatchWork) -> int:
    """The batch's input in landing bytes: a stage's upstream pane rows in range count as a landing line each."""
    if job.spec.upstream is None or job.settings.engine_local_below <= 0:
        return work.planned_bytes
    from millpond.runtime.engines.spark import LANDING_BYTES_PER_ROW, input_rows

    return input_rows(job, work) * LANDING_BYTES_PER_ROW


def on_spark(job: BatchContext) -> bool:
    """Whether the Spark engine runs this pipeline's batches: windowed pipelines and MillWheel computations
    (``spark_computation``), over landing files or (a stage) over their upstreams' panes (``spark_upstream``)."""
    return job.kind in ("windows", "computation")
