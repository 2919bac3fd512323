"""The ``chk_*`` helper columns of :mod:`millpond.quality.suites`, computed by Spark on executors.

The same checks as the pandas functions there, written with Spark's own functions so a Spark batch's
frames are validated where they live: a retraction is judged against the previous value-or-retraction
of its (key, window) in emission order (prior panes first, then this batch's, each by batch and seq), a
live window against the furthest end among its key's earlier-starting windows. Each function returns
the frame with its column added (no rows leave Spark); ``tests/test_quality_spark.py`` compares every
column with the pandas version on the same data.
"""

from __future__ import annotations

from typing import Any

from millpond.quality import suites as qs

_POS = "_chk_pos"
#: pandas keeps times as datetime64[ns]: epoch seconds beyond this are unparseable there, and here too
_NS_RANGE_S = 9_223_372_036.854775


def _col_names(df: Any) -> set[str]:
    return set(df.columns)


def prepare_raw(df: Any) -> Any:
    """Add ``chk_event_time_unparseable`` and ``event_time_epoch_s`` (null when not parseable), and
    ``chk_id_copies`` where the frame does not bring it (as pandas: the rows of its own id).

    Timestamps and dates are taken as they are, numbers as epoch seconds, strings as ISO-8601 in its
    extended form (Spark's timestamp cast: a string without a zone is in the session time zone, UTC
    here; pandas also reads the basic form ``20260101``, Spark does not)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if qs.COPIES not in _col_names(df) and "id" in _col_names(df):  # a batch's frame brings them (its dedup's)
        df = df.withColumn(qs.COPIES, F.when(F.col("id").isNotNull(), F.count(F.lit(1)).over(
            Window.partitionBy("id"))))
    if "event_time" not in _col_names(df):
        return df
    col = F.col("event_time")
    kind = df.schema["event_time"].dataType
    if isinstance(kind, (T.TimestampType, T.TimestampNTZType, T.DateType)):
        epoch = F.unix_micros(col.cast("timestamp")) / F.lit(1e6)
    elif isinstance(kind, T.NumericType):
        number = col.cast("double")
        col = F.when(~F.isnan(number), number)  # NaN is missing (as in pandas), not unparseable
        epoch = F.when(F.abs(col) <= F.lit(_NS_RANGE_S), col)
    elif isinstance(kind, T.StringType):
        epoch = F.unix_micros(F.expr("try_cast(event_time AS TIMESTAMP)")) / F.lit(1e6)
    else:  # booleans, structs, ...: never a time
        epoch = F.lit(None).cast("double")
    return df.select("*", (col.isNotNull() & epoch.isNull()).alias("chk_event_time_unparseable"),
                     epoch.cast("double").alias("event_time_epoch_s"))


def _close(a: Any, b: Any) -> Any:
    """numpy's ``isclose(a, b, rtol=1e-9, atol=1e-12)``; false (not null) when either side is null."""
    from pyspark.sql import functions as F

    return F.coalesce(F.abs(a - b) <= F.lit(1e-12) + F.lit(1e-9) * F.abs(b), F.lit(False))


def prepare_panes(panes: Any, prior: Any | None, retractions: bool = True) -> Any:
    """Add ``chk_retraction``: MATCHED/UNMATCHED/MISMATCH for retractions, null for other panes.

    ``retractions=False`` says the caller knows the panes hold none: the column is then null throughout,
    without the window function (a sort of every pane) that judges them.

    In emission order per (key, window), the state a retraction meets is the last value or retraction
    before it: a value is outstanding (either sign of it matches), a retraction or nothing is not (then
    UNMATCHED, or null without ``prior``: an earlier batch's window cannot be judged without its log).
    Only the windows this batch retracts are read from ``prior``.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    needed = {"key", "window_start", "window_end", "kind", "value"}
    if not retractions or not needed <= _col_names(panes):
        return panes.withColumn("chk_retraction", F.lit(None).cast("string"))
    wins = ["key", "window_start", "window_end"]
    order = [c for c in ("batch", "seq") if c in _col_names(panes)]
    current = panes.withColumn(_POS, F.monotonically_increasing_id()).withColumn("_chk_src", F.lit(1)).withColumn(
        "_chk_v", F.col("value").cast("double"))
    events = current
    if prior is not None:
        retracted = panes.where(F.col("kind") == "retraction").select(*wins).distinct()
        earlier = prior.join(retracted, wins, "left_semi").select(
            *wins, "kind", *[F.col(c) for c in order if c in _col_names(prior)],
            F.col("value").cast("double").alias("_chk_v"), F.monotonically_increasing_id().alias(_POS),
            F.lit(0).alias("_chk_src"))
        events = current.unionByName(earlier, allowMissingColumns=True)
    w = Window.partitionBy(*wins).orderBy("_chk_src", *order, _POS).rowsBetween(Window.unboundedPreceding, -1)
    kind = F.col("kind")
    events = events.withColumn("_chk_b", F.last(F.when(kind.isin("value", "retraction"), F.struct(
        kind.alias("k"), F.col("_chk_v").alias("v"))), ignorenulls=True).over(w))
    before, value = F.col("_chk_b"), F.col("_chk_v")
    unmatched = F.lit(qs.UNMATCHED if prior is not None else None).cast("string")
    judged = F.when(before.isNull() | (before["k"] != "value"), unmatched).when(
        _close(value, before["v"]) | _close(value, -before["v"]), F.lit(qs.MATCHED)).otherwise(F.lit(qs.MISMATCH))
    return (events.withColumn("chk_retraction", F.when(kind == "retraction", judged).cast("string"))
            .where(F.col("_chk_src") == 1).drop(_POS, "_chk_src", "_chk_v", "_chk_b"))


def prepare_state(state: Any, window_type: str | None) -> Any:
    """Add ``chk_overlaps_earlier``: a live window starting before an earlier-starting window of its key
    ends (all false for sliding and custom windows, which overlap by design)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if window_type in ("sliding", "custom") or not {"key", "window_start", "window_end"} <= _col_names(state):
        return state.withColumn("chk_overlaps_earlier", F.lit(False))
    ordered = Window.partitionBy("key").orderBy(F.col("window_start").asc_nulls_last(),
                                                F.col("window_end").asc_nulls_last(), _POS)
    # pandas' cummax().shift(1): the previous row's running maximum, missing right after a missing end
    reach = F.when(F.lag("window_end").over(ordered).isNotNull(),
                   F.max("window_end").over(ordered.rowsBetween(Window.unboundedPreceding, -1)))
    overlap = F.coalesce(F.col("key").isNotNull() & (F.col("window_start") < reach), F.lit(False))
    return (state.withColumn(_POS, F.monotonically_increasing_id())
            .withColumn("chk_overlaps_earlier", overlap).drop(_POS))
