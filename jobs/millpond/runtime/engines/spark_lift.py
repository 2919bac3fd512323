"""Combiner lifting on Spark: a batch's on-time elements of one window combined into one element before the
per-key step (Beam's combiner lifting, Spark's partial aggregation), which then moves one row per window into
Python instead of one per element.

It applies where the tables cannot tell (``model.step.lifts``: fixed windows, an integer sum, min or max), where
no running sum can leave the 64-bit range (the batch's largest magnitude times its elements below ``SAFE_SUM``,
and a stored accumulator below it too), and where it always pays: a stage that puts every upstream pane under
one key (``key: all``), whose per-key step is one task holding every element (measured: 780k pane rows, 1.2 s of
that task). Elements pass one by one where their window takes them one by one: late ones (each has its own
``late`` row), and those of a stored window that is closed (each a "window closed" row) or whose accumulator is
too large to bound. A lifted element carries its window's id (``lifted_id``), its elements' smallest event time
and arrival (the first arrival is what the triggers see) and its ``weight``, the events it stands for
(``Element.weight``: the triggers count them). No table shows a lifted element's id: it is alone in its window
and on time, so it is never a ``late`` row, and the step orders a window's elements by it only among
themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from millpond.model.step import Strategy, lifts
from millpond.model.timeutil import MAX_TS
from millpond.runtime.layout import WEIGHT

#: a batch's sum is lifted only while its largest magnitude times its elements stays below this (a margin under
#: 2**63 for the float arithmetic of the bound), so that no running sum of a window's elements can overflow
SAFE_SUM = 2.0**61
_INT64_MIN = -(2**63)
#: a lifted element's id is this and its window's start (us)
LIFTED_ID = "lifted|"
#: a lifted element's elements' greatest event time (``lifted``, where asked for in ``columns``): a batch whose
#: elements were counted without their times takes its own from the per-key step's tasks (``spark_keys``)
LAST_EVENT = "_last_event_time"


def lifted_id(start: int) -> str:
    """The id of the element a window's on-time elements are lifted into (``lifted``)."""
    return f"{LIFTED_ID}{start}"


class Lift(NamedTuple):
    """How a batch's elements are lifted: the aggregate, the fixed windows' size and offset (us), and the input
    watermark less the allowed lateness (a window ending at or before it takes its elements one by one: late)."""

    how: str
    size: int
    offset: int
    late_end: int
    lateness: int


def lift_for(strategy: Strategy, value_type: str, input_watermark: int, one_key: bool, biggest: float | None,
             rows: int) -> Lift | None:
    """The batch's lifting, or None (see the module's docstring for when). ``biggest``: the largest magnitude
    of the batch's element values (None: not known); ``rows``: its elements."""
    how = lifts(strategy.window_fn, strategy.combiner, value_type)
    if how is None or not one_key:
        return None
    if how == "sum" and (biggest is None or biggest * max(rows, 1) >= SAFE_SUM):
        return None
    wfn = strategy.window_fn
    return Lift(how, wfn.size, wfn.offset, input_watermark - strategy.allowed_lateness, strategy.allowed_lateness)


def lifted(events, lift: Lift, state=None, columns: Sequence[str] | None = None):
    """``events`` (``id, key, value, event_time, arrival_time``) with every on-time window's elements combined
    into one element, and a ``weight`` column (1 for those that pass as they are). Late as the per-key step
    judges it (``runtime.layout.form_windows``): a window's end at or behind ``late_end``, or, for a window
    reaching the end of time, the input watermark there too. ``state``: the stored windows the batch read
    (``key``, ``window_start`` in us, ``state`` JSON; a few under ``key: all``), or None: one that is closed, or
    whose sum is too large to bound, takes its elements one by one. ``columns``: ``events``' (else asked of the
    server), and ``LAST_EVENT`` if asked for."""
    from pyspark.sql import functions as F

    et = F.col("event_time")
    start = et - F.pmod(et - F.lit(lift.offset), F.lit(lift.size))
    end = start + F.lit(lift.size)
    forever = MAX_TS - lift.lateness
    late_at_end = F.lit(lift.late_end + lift.lateness >= MAX_TS)
    by_end = F.lit(False) if lift.late_end < _INT64_MIN else end <= F.lit(lift.late_end)
    late = F.when(end < F.lit(forever), by_end).otherwise(late_at_end)
    agg = {"sum": F.sum, "min": F.min, "max": F.max}[lift.how]
    marked = events.withColumn("_apart", late)  # passes one by one: late, or (below) its stored window holds it
    if state is not None:
        closed = F.coalesce(F.get_json_object("state", "$.closed") == F.lit("true"), F.lit(False))
        big = F.coalesce(F.abs(F.get_json_object("state", "$.acc").cast("double")) >= F.lit(SAFE_SUM), F.lit(False))
        held = (state.where(closed | big if lift.how == "sum" else closed)
                .select("key", F.col("window_start").alias("_held")).withColumn("_one", F.lit(True)))
        marked = (marked.withColumn("_held", start).join(F.broadcast(held), ["key", "_held"], "left")
                  .withColumn("_apart", F.col("_apart") | F.coalesce(F.col("_one"), F.lit(False)))
                  .drop("_held", "_one"))
    # one aggregate for both kinds, by hash: an element passing on its own is a group of its own (its id, unique
    # among a batch's accepted elements, is in the grouping), so the rows are read once; and no aggregate buffer is
    # a string (a ``min`` of the ids made Spark sort every element by window first: 2.2 of a 1M-row stage batch's
    # task seconds), so a lifted element's id is its window's (``lifted_id``)
    alone = F.when(F.col("_apart"), F.col("id"))
    combined = marked.groupBy("key", start.alias("_w"), alone.alias("_id")).agg(
        agg("value").alias("value"), F.min("event_time").alias("event_time"),
        F.min("arrival_time").alias("arrival_time"), F.count(F.lit(1)).alias(WEIGHT),
        F.max("event_time").alias(LAST_EVENT))
    ident = F.when(F.col("_id").isNull(), F.concat(F.lit(LIFTED_ID), F.col("_w").cast("string"))).otherwise(
        F.col("_id"))
    columns = list(columns or events.columns)
    return combined.withColumn("id", ident).select(*columns, WEIGHT)
