"""The Spark engine: a batch as Spark work on the deployment's Spark (a Connect server, or a classic session),
rows read, computed and written on executors; this process plans and commits. Two strategies of one engine:

- ``plan``: the multi-stage plan (``spark_batch``): reads, dedup, the per-key step and every table's writes as
  a handful of Spark jobs whose stages spread over the cluster;
- ``one-task``: a small batch as one Spark task (``spark_task``) running the local engine's steps on one
  executor, below ``engine.one_task_below`` rows, where per-job round trips would dominate.

Which one runs is decided here (``strategy``), from the planned bytes and the stored windows, never by the
strategies themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from millpond.lake import spark_io
from millpond.runtime.engines.base import BatchWork, Engine, Outputs

if TYPE_CHECKING:
    from millpond.runtime.commits import PhaseTimer
    from millpond.runtime.context import BatchContext

#: a landing file's bytes per element, to size a batch before its files are read (JSON lines)
LANDING_BYTES_PER_ROW = 100

PLAN, ONE_TASK = "plan", "one-task"


def batch_rows(job: BatchContext, work: BatchWork, inputs: int | None = None) -> int:
    """About how many rows the batch handles: its input (``inputs`` when known, else ``input_rows``) plus its
    stored windows."""
    return (input_rows(job, work) if inputs is None else inputs) + spark_io.table_rows(
        job.tables, job.name, "windows", work.plan["versions"].get("windows"))


def input_rows(job: BatchContext, work: BatchWork) -> int:
    """About how many input rows the batch reads, before any is read."""
    if job.spec.upstream is None:
        return work.planned_bytes // LANDING_BYTES_PER_ROW
    from millpond.runtime.engines.spark_upstream import planned_rows

    return planned_rows(job, work.plan)


class SparkEngine(Engine):
    """The batch on Spark, as the multi-stage plan or as one task."""

    name = "spark"

    def __init__(self, input_rows: int | None = None) -> None:
        #: the batch's input rows when the factory already counted them (a stage's upstream range)
        self.input_rows = input_rows

    def strategy(self, job: BatchContext, work: BatchWork, rows: int | None = None) -> str:
        """One task below ``engine.one_task_below`` rows (``rows``, else ``batch_rows``), validated or not (a
        validated one task hands its rows to the client, where the local engine's suites validate them: rows
        bounded by that threshold); else the plan. A MillWheel computation's batch is always a plan of its own
        (``spark_computation``)."""
        if job.kind == "computation":
            return PLAN
        small = (batch_rows(job, work, self.input_rows) if rows is None else rows) < job.settings.engine_one_task_below
        return ONE_TASK if small else PLAN

    def run(self, job: BatchContext, work: BatchWork, timer: PhaseTimer) -> Outputs:
        from millpond.runtime.engines import spark_batch, spark_task  # pyspark is imported by Spark batches only

        # once: a stage's reads its upstream range's log entries
        inputs = input_rows(job, work) if self.input_rows is None else self.input_rows
        rows = batch_rows(job, work, inputs)
        strategy = self.strategy(job, work, rows)
        timer.begin("ingest", files=len(work.plan["files"]), engine=f"{self.name}/{strategy}")
        if job.kind == "computation":
            from millpond.runtime.engines.spark_computation import run_computation

            counts, clock, max_et = run_computation(job, work, rows, timer)
        elif strategy == ONE_TASK:
            counts, clock, max_et = spark_task.run_one_task(job, work, timer)
        else:
            counts, clock, max_et = spark_batch.run_on_spark(job, work, inputs, timer)
        return Outputs(counts, clock, max_et, self.name, strategy)
