"""``run_batch``: one micro-batch of a pipeline, the entry point of every caller (DAG task, CLI, replay, bench).

A windowed pipeline runs ``MicroBatch``; a MillWheel computation (``computation:`` in its file) runs
``ComputationBatch``, the same batch with the computation as its per-key step."""

from __future__ import annotations

from datetime import datetime

from millpond.config import Settings
from millpond.model.spec import PipelineSpec
from millpond.runtime.computation import ComputationBatch
from millpond.runtime.microbatch import BatchResult, MicroBatch


def run_batch(settings: Settings, spec: PipelineSpec, processing_time: datetime | int | str, *,
              watermark: datetime | int | str | None = None, spark=None, validate: bool = False,
              owner: str | None = None, render_docs: bool = True) -> BatchResult:
    """One micro-batch of ``spec`` at ``processing_time`` (idempotent: a committed batch is skipped).

    ``validate`` runs the Great Expectations suites before anything is committed (the DAGs and `millpond
    run` do; replays skip it unless asked). ``owner``: the lease owner (an Airflow run passes its identity,
    so its retries take the lease back at once). ``render_docs=False`` leaves the passing validation's Data Docs
    pages to the next Data Docs build (a DAG run builds and publishes them after the commit: rendering is not
    checking, and costs most of a small batch's validation)."""
    job_cls: type[MicroBatch] = ComputationBatch if spec.raw.get("computation") else MicroBatch
    job = job_cls(settings, spec, spark, validate=validate, owner=owner)
    job.render_docs = render_docs
    result = job.run(processing_time, watermark)
    result.quality = job.quality
    return result
