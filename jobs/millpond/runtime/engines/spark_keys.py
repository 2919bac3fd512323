"""The per-key step on Spark's executors: the batch's elements and the stored windows they can change, spread
by key ranges into partitions, each partition laid out and run exactly as the local engine does (``KeyLayout``,
``key_rows``, ``Assembly``), its output tables returned as tagged rows that stay on the executors.

Ranges, not hashes: partition ``i``'s keys all sort before partition ``i + 1``'s, and each partition numbers its
panes by key then emission order (``Assembly``), so a pane's batch-wide ``seq`` (the local engine's) is its
partition's number plus the panes of the partitions before it, a small aggregate of one row per task
(``spark_batch.panes_frame``), never a window over the whole batch in one task."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.schemas import value_arrow_type
from millpond.model.clock import BatchClock
from millpond.runtime.assembly import Assembly, key_rows, strategy_of
from millpond.runtime.layout import EVENT_COLUMNS, KeyLayout


def key_output_schema(value_type: str, pane_type: str) -> pa.Schema:
    """One row of any output table, tagged by ``tbl`` (panes, state, late, current); times in microseconds."""
    return pa.schema([
        ("tbl", pa.string()), ("key", pa.string()), ("window_start", pa.int64()), ("window_end", pa.int64()),
        ("pane_value", value_arrow_type(pane_type)), ("pane_index", pa.int64()), ("timing", pa.string()),
        ("is_last", pa.bool_()), ("kind", pa.string()), ("seq", pa.int64()), ("state", pa.string()),
        ("event_timer", pa.int64()), ("ptime_timer", pa.int64()), ("deleted", pa.bool_()), ("id", pa.string()),
        ("late_value", value_arrow_type(value_type)), ("event_time", pa.int64()), ("arrival_time", pa.int64()),
        ("reason", pa.string()), ("part", pa.int32())])


KEY_OUTPUT = key_output_schema


def _tagged(tag: str, table: pa.Table, schema: pa.Schema, rename: dict[str, str], part: int) -> pa.Table:
    n = table.num_rows
    cols = []
    for f in schema:
        source = {v: k for k, v in rename.items()}.get(f.name, f.name)
        if f.name == "tbl":
            cols.append(pa.array([tag] * n, pa.string()))
        elif f.name == "part":
            cols.append(pa.array(np.full(n, part, np.int32)))
        elif source in table.column_names:
            col = table.column(source)
            cols.append(pc.cast(col, pa.int64()) if pa.types.is_timestamp(col.type) else col.cast(f.type))
        else:
            cols.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def run_partition(spec_json: str, clock: BatchClock, value_type: str, pane_type: str, discarding: bool,
                  columnar: bool, table: pa.Table, part: int = 0) -> pa.Table:
    """One partition's keys through the per-key step; every output row, tagged with ``part`` (the partition's
    number). Its ``read`` row holds the stored windows it read (``pane_index``) and the panes it emitted
    (``seq``), numbered 1.. by key then emission order."""
    is_state = table.column("state").is_valid()
    events = table.filter(pc.invert(is_state)).select(list(EVENT_COLUMNS))
    state = table.filter(is_state).select(["key", "window_start", "window_end", "state"])
    layout = KeyLayout.of(events, state)
    sink = Assembly(clock.batch, clock, value_type, pane_type, discarding)
    strategy = strategy_of(spec_json)
    for lo, hi in layout.chunks():
        rows: list[tuple] = []
        for key, els, groups, sts in layout.rows(lo, hi, strategy, clock, columnar):
            rows += key_rows(spec_json, clock, key, els, sts, groups)
        sink.add(rows)
    sink.finish()
    schema = key_output_schema(value_type, pane_type)
    read = pa.table({"tbl": ["read"], "pane_index": pa.array([state.num_rows], pa.int64()),
                     "seq": pa.array([sink.panes.num_rows], pa.int64())})
    return pa.concat_tables([
        _tagged("read", read, schema, {}, part),
        _tagged("panes", sink.panes, schema, {"value": "pane_value"}, part),
        _tagged("state", sink.state, schema, {}, part),
        _tagged("late", sink.late, schema, {"value": "late_value"}, part),
        _tagged("current", sink.current, schema, {"value": "pane_value"}, part)])


def per_key_step(spec_json: str, clock: BatchClock, accepted, state, value_type: str, pane_type: str,
                 discarding: bool, columnar: bool, partitions: int):
    """A DataFrame of the tagged output rows of every key of the batch, computed on executors in
    ``partitions`` tasks over ranges of keys (``part``: the task's range, in key order); a ``read`` row per
    task holds the number of stored windows it read (``pane_index``) and of panes it emitted (``seq``)."""
    from pyspark.sql import functions as F

    vtype = "bigint" if value_type == "int" else "double"
    events = accepted.select("key", "id", F.col("value").cast(vtype).alias("value"), "event_time", "arrival_time",
                             F.lit(None).cast("bigint").alias("window_start"),
                             F.lit(None).cast("bigint").alias("window_end"), F.lit(None).cast("string").alias("state"))
    combined = events
    if state is not None:
        combined = events.unionByName(state.select(
            "key", F.lit(None).cast("string").alias("id"), F.lit(None).cast(vtype).alias("value"),
            F.lit(None).cast("bigint").alias("event_time"), F.lit(None).cast("bigint").alias("arrival_time"),
            "window_start", "window_end", "state"))
    schema = key_output_schema(value_type, pane_type)

    def run(batches):
        batches = list(batches)
        if not batches:
            return
        from pyspark import TaskContext

        out = run_partition(spec_json, clock, value_type, pane_type, discarding, columnar,
                            pa.Table.from_batches(batches), TaskContext.get().partitionId())
        yield from out.to_batches()

    from pyspark.sql.pandas.types import from_arrow_schema

    # by ranges of keys (a sampling job sets their bounds): the panes' numbering needs no global sort
    return combined.repartitionByRange(partitions, "key").mapInArrow(run, from_arrow_schema(schema))
