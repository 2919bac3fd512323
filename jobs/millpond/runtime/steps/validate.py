"""Validate: Great Expectations on what the batch read, will emit and will keep; a critical failure stops the
batch here, before anything is published."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.errors import MillpondError
from millpond.lake.sql import sql_in, sql_ts
from millpond.model.clock import BatchClock
from millpond.model.timeutil import to_datetime, to_us
from millpond.runtime.assembly import us_column

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext


def validate(job: BatchContext, batch: int, clock: BatchClock, delivered: pa.Table, panes: pa.Table,
             state: pa.Table) -> None:
    """Great Expectations on what this batch read, will emit and will keep; critical stops it here,
    before anything is published. ``delivered``: the batch's input one row per id with its ``chk_id_copies``
    (``steps.dedup.Deduped``; the accepted elements, where a batch's ids are unique by construction: a stage's)."""
    import pandas as pd

    from millpond.quality import suites as qs
    from millpond.quality.validation import validate_batch

    def col(table: pa.Table, name: str) -> list[Any]:
        return table.column(name).to_pylist()

    def times(table: pa.Table, name: str) -> pd.DatetimeIndex:
        return pd.to_datetime(us_column(table, name), unit="us", utc=True)

    raw = pd.DataFrame({"id": col(delivered, "id"), "key": col(delivered, "key"), "value": col(delivered, "value"),
                        "event_time": times(delivered, "event_time")})
    if qs.COPIES in delivered.column_names:
        raw[qs.COPIES] = delivered.column(qs.COPIES).to_numpy()
    pane_df = panes.to_pandas()
    live = state.filter(pc.invert(state.column("deleted")))
    state_df = pd.DataFrame({
        "key": col(live, "key"), "state": col(live, "state"),
        "window_start": times(live, "window_start"), "window_end": times(live, "window_end"),
        "event_timer": times(live, "event_timer"), "ptime_timer": times(live, "ptime_timer"),
        "batch": [batch] * live.num_rows})
    retractions = panes.filter(pc.equal(panes.column("kind"), "retraction"))
    prior = None
    if retractions.num_rows:
        # Only the retracted windows' earlier panes matter: bounding window_start lets file statistics
        # skip old pane files, so this read does not grow with the pane log.
        where = (f"window_start >= {sql_ts(min(us_column(retractions, 'window_start')))} AND "
                 + sql_in("key", sorted(set(col(retractions, "key")))))
        prior = job.tables.select(job.name, "panes", where, schema=pa.schema([("key", pa.string())])).to_pandas()
    report = validate_batch(job.settings, job.name, batch, raw=raw, panes=pane_df, state=state_df,
                            prior_panes=prior, processing_time=to_datetime(clock.processing_time),
                            window_type=job.spec.window.get("type"), render=job.render_docs,
                            freshness=freshness(job, clock))
    _judge(job, batch, report)


def freshness(job: BatchContext, clock: BatchClock):
    """The batch's freshness against its pipeline's ``freshness:`` thresholds (None when it declares none):
    its watermark lag, and the time since the previous committed batch's processing time (``job.previous``)."""
    from millpond.quality.freshness import BatchFreshness

    limits = job.spec.freshness
    if not limits:
        return None
    prev = getattr(job, "previous", None)
    return BatchFreshness(job.name, clock.batch, clock.processing_time, clock.watermark,
                          to_us(prev["processing_time"]) if prev else None, limits)


def first_retracted(panes) -> int | None:
    """The earliest ``window_start`` (us) among the batch's retractions (Spark panes), None without any: where
    :func:`validate_spark` starts reading earlier panes. One job, which also computes a lazily kept ``panes``."""
    from pyspark.sql import functions as F

    return panes.where(F.col("kind") == "retraction").agg(F.unix_micros(F.min("window_start"))).collect()[0][0]


def delivered(parsed, landing: bool):
    """The Spark engine's raw frame, as ``steps.dedup.Deduped.delivered`` is the local engine's: a landing batch's
    input one row per id, its first delivery (``spark_batch.read_and_dedup``'s kept rows without the quarantined:
    accepted, or accepted by an earlier batch, ``_seen``), with ``chk_id_copies``: the batch's rows of the id
    (``_c``), plus one where an earlier batch accepted it. A stage's elements (not ``landing``) are unique by
    construction (``steps.dedup.by_id``): one copy each."""
    from pyspark.sql import functions as F

    from millpond.quality import suites as qs

    time = F.timestamp_micros("event_time").alias("event_time")
    if not landing:
        return parsed.select("id", "key", "value", time, F.lit(1).cast("long").alias(qs.COPIES))
    copies = F.col("_c") + F.when(F.col("_seen"), F.lit(1)).otherwise(F.lit(0))
    return parsed.where(F.col("reason").isNull()).select("id", "key", "value", time,
                                                         copies.cast("long").alias(qs.COPIES))


def validate_spark(job: BatchContext, clock: BatchClock, raw, panes, state, lo: int | None) -> None:
    """The same suites on the Spark engine's DataFrames, validated on Spark (no rows come to this process).

    ``raw``, ``panes`` and ``state`` are shaped like :func:`validate`'s frames (times as timestamps, live
    windows only); ``panes`` is kept by the caller, which writes the same rows. Earlier panes are read on
    executors (``lake.spark_io``), as on the local engine only when the batch retracts (``lo``: its
    :func:`first_retracted`), from the earliest window it retracts on; the check keeps the retracted windows'
    rows of them."""
    from pyspark.sql import functions as F

    from millpond.lake import spark_io
    from millpond.quality.validation import validate_batch
    from millpond.runtime.engines.spark_values import batch_values, with_values

    prior = None
    if lo is not None:
        stored = spark_io.read_table(job.spark, job.tables, job.name, "panes")
        # the bound as a joined value, not a literal: the generated code stays the same from batch to batch
        prior = panes.limit(0) if stored is None else with_values(stored, batch_values(job.spark, lo=lo)).where(
            F.col("window_start") >= F.timestamp_micros("_lo")).drop("_lo")
    report = validate_batch(job.settings, job.name, clock.batch, raw=raw, panes=panes, state=state,
                            prior_panes=prior, processing_time=to_datetime(clock.processing_time),
                            window_type=job.spec.window.get("type"), render=job.render_docs,
                            retractions=lo is not None, freshness=freshness(job, clock))
    _judge(job, clock.batch, report)


def validate_streams(job: BatchContext, batch: int, produced: dict[str, Any],
                     clock: BatchClock | None = None, on_spark: bool = False) -> None:
    """A computation's productions (Arrow tables by stream; Spark DataFrames ``on_spark``), by the committed
    suites of their streams (and, given its ``clock``, its freshness); critical stops the batch here."""
    from millpond.quality.context import PANDAS, SPARK
    from millpond.quality.validation import validate_streams as check

    frames = produced if on_spark else {name: t.to_pandas() for name, t in produced.items()}
    report = check(job.settings, job.name, batch, frames, render=job.render_docs,
                   freshness=None if clock is None else freshness(job, clock), engine=SPARK if on_spark else PANDAS)
    _judge(job, batch, report)


def _judge(job: BatchContext, batch: int, report) -> None:
    """Keep the report on the job; a critical failure stops the batch before anything is published."""
    job.quality = report
    if not report.ok:
        where = f"; see {report.result_urls[0]}" if report.result_urls else ""
        raise MillpondError(
            f"{job.name} batch {batch} failed critical data-quality checks, nothing was published: "
            + "; ".join(report.critical_failures[:3]) + where
        )
