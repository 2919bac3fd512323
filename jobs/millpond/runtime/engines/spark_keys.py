"""The per-key step on Spark's executors: the batch's elements and the stored windows they can change, spread
by key ranges into partitions, each partition laid out and run exactly as the local engine does (``KeyLayout``,
``key_rows``, ``Assembly``), its output tables returned as tagged rows that stay on the executors.

Ranges, not hashes: partition ``i``'s keys all sort before partition ``i + 1``'s, and each partition numbers its
panes by key then emission order (``Assembly``), so a pane's batch-wide ``seq`` (the local engine's) is its
partition's number plus the panes of the partitions before it, a small aggregate of one row per task
(``spark_batch.panes_frame``), never a window over the whole batch in one task."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.schemas import value_arrow_type
from millpond.lake.spark_io import map_arrow
from millpond.model.clock import BatchClock
from millpond.runtime.assembly import Assembly, key_rows, strategy_of
from millpond.runtime.engines.spark_lift import LAST_EVENT, Lift, lifted
from millpond.runtime.layout import EVENT_COLUMNS, KEY_COST, NEW_KEY_COST, STATE_ROW_COST, WEIGHT, KeyLayout


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


class StepRun(NamedTuple):
    """One task's per-key step: its output tables (``Assembly``: panes numbered 1.. by key then emission order,
    state changes, late rows, current rows), the stored windows it read, and its elements' greatest event time
    (a lifted element's own, ``LAST_EVENT``; None without elements)."""

    sink: Assembly
    state_read: int
    max_event_time: int | None


def step_rows(spec_json: str, clock: BatchClock, value_type: str, pane_type: str, discarding: bool,
              columnar: bool, table: pa.Table) -> StepRun:
    """A task's elements and stored windows (the step's input columns, ``per_key_step``) through the per-key step,
    laid out and run exactly as the local engine does."""
    is_state = table.column("state").is_valid()
    times = table.column(LAST_EVENT if LAST_EVENT in table.column_names else "event_time").filter(
        pc.invert(is_state))
    events = table.filter(pc.invert(is_state)).select(
        list(EVENT_COLUMNS) + ([WEIGHT] if WEIGHT in table.column_names else []))
    state = table.filter(is_state).select(["key", "window_start", "window_end", "state"])
    layout = KeyLayout.of(events, state)
    sink = Assembly(clock.batch, clock, value_type, pane_type, discarding)
    strategy = strategy_of(spec_json)
    for lo, hi in layout.chunks():
        rows: list[tuple] = []
        inputs, fired = layout.split(lo, hi, strategy, clock, columnar)
        for key, els, groups, sts in inputs:
            rows += key_rows(spec_json, clock, key, els, sts, groups)
        sink.add(rows, fired)
    return StepRun(sink.finish(), state.num_rows, pc.max(times).as_py())


def run_partition(spec_json: str, clock: BatchClock, value_type: str, pane_type: str, discarding: bool,
                  columnar: bool, table: pa.Table, part: int = 0) -> pa.Table:
    """One partition's keys through the per-key step (``step_rows``); every output row, tagged with ``part`` (the
    partition's number). Its ``read`` row holds the stored windows it read (``pane_index``), the panes it emitted
    (``seq``), numbered 1.. by key then emission order, and its elements' greatest event time (``event_time``;
    a lifted element's own, ``LAST_EVENT``)."""
    sink, state_read, last = step_rows(spec_json, clock, value_type, pane_type, discarding, columnar, table)
    schema = key_output_schema(value_type, pane_type)
    read = pa.table({"tbl": ["read"], "pane_index": pa.array([state_read], pa.int64()),
                     "seq": pa.array([sink.panes.num_rows], pa.int64()),
                     "event_time": pa.array([last], pa.int64())})
    return pa.concat_tables([
        _tagged("read", read, schema, {}, part),
        _tagged("panes", sink.panes, schema, {"value": "pane_value"}, part),
        _tagged("state", sink.state, schema, {}, part),
        _tagged("late", sink.late, schema, {"value": "late_value"}, part),
        _tagged("current", sink.current, schema, {"value": "pane_value"}, part)])


def step_input(accepted, state, value_type: str, lift: Lift | None = None):
    """The per-key step's input, one frame: the batch's elements (``lift``: their windows combined first,
    ``spark_lift``; else None) and the stored windows it can change (``state``, or None), as rows of the same
    columns; and those columns, in order."""
    from pyspark.sql import functions as F

    vtype = "bigint" if value_type == "int" else "double"
    events = accepted.select("id", "key", F.col("value").cast(vtype).alias("value"), "event_time", "arrival_time")
    elements = [*EVENT_COLUMNS, *([WEIGHT, LAST_EVENT] if lift is not None else [])]
    if lift is not None:
        events = lifted(events, lift, state, [*EVENT_COLUMNS, LAST_EVENT])
    combined = events.select(*elements, F.lit(None).cast("bigint").alias("window_start"),
                             F.lit(None).cast("bigint").alias("window_end"),
                             F.lit(None).cast("string").alias("state"))
    if state is not None:
        combined = combined.unionByName(state.select(
            "key", F.lit(None).cast("string").alias("id"), F.lit(None).cast(vtype).alias("value"),
            F.lit(None).cast("bigint").alias("event_time"), F.lit(None).cast("bigint").alias("arrival_time"),
            "window_start", "window_end", "state"), allowMissingColumns=True)
    return combined, [*elements, "window_start", "window_end", "state"]


def per_key_step(spec_json: str, clock: BatchClock, accepted, state, value_type: str, pane_type: str,
                 discarding: bool, columnar: bool, partitions: int, rows: int, most: int | None = None,
                 lift: Lift | None = None):
    """A DataFrame of the tagged output rows of every key of the batch, computed on executors in ``partitions`` to
    ``most`` tasks over ranges of keys (``part``: the range, in key order; ``key_ranges``); a ``read`` row per range
    holds the number of stored windows it read (``pane_index``) and of panes it emitted (``seq``), and its elements'
    greatest event time (``event_time``). ``rows``: about how many elements the batch has (it sizes the sample that
    sets the ranges). ``lift``: the elements' windows combined first (``spark_lift``), or None."""
    combined, columns = step_input(accepted, state, value_type, lift)
    schema = key_output_schema(value_type, pane_type)

    def run(batches):
        batches = list(batches)
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        ranges = table.column(RANGE)
        for part in sorted(pc.unique(ranges).to_pylist()):  # one, unless two ranges' hashes met in one task
            own = table.filter(pc.equal(ranges, part)).drop_columns([RANGE])
            yield from run_partition(spec_json, clock, value_type, pane_type, discarding, columnar, own,
                                     part).to_batches()

    from pyspark.sql.pandas.types import from_arrow_schema

    return map_arrow(key_ranges(combined, partitions, rows, most), run, from_arrow_schema(schema), [*columns, RANGE])


#: the column that carries a row's key range into the per-key step's tasks
RANGE = "_range"
#: about how many of a batch's rows the sample for its key ranges reads
SAMPLE_ROWS = 20_000
SAMPLE_SEED = 42
#: the per-key step's cost one task takes, in elements (a key with stored windows costs ``layout.KEY_COST``, one
#: without ``NEW_KEY_COST``, a stored window ``STATE_ROW_COST``): about 0.75 s of its Python. A batch of many light
#: keys with stored windows costs about 20 times its rows, so its rows alone would leave a core idle while one task
#: runs the step
COST_PER_TASK = 500_000
#: a batch of fewer elements keeps the tasks its rows give (no sample job): its step is too short to split
SIZE_BY_COST_FROM = 20_000


def key_ranges(combined, partitions: int, rows: int, most: int | None = None):
    """``combined`` (elements and stored windows) spread into tasks by ranges of keys, each range about as
    costly: a key with stored windows costs ``layout.KEY_COST`` elements (its step is Python objects), one without
    ``NEW_KEY_COST`` (its new windows fire on columns, ``model.step_columns``), a stored window ``STATE_ROW_COST``
    (Spark's own range partitioning balances rows, and a batch's light keys, most of its cost, then sort into one
    range; measured: one task of two ran 4 s, the other 0.6 s). The bounds come from a sample, one small job: a
    hash of the key picks about ``SAMPLE_ROWS`` rows' keys for their own cost, a seeded draw about as many rows
    for theirs. It also estimates the step's cost: one task per ``COST_PER_TASK`` of it, at least ``partitions``
    (the rows') and at most ``most`` (the deployment's width; default ``partitions``). Each row carries its range
    (``RANGE``), and the ranges go to tasks by a hash of a number chosen to land range ``i`` in task ``i``. Too
    small a sample to cut (few keys) leaves it to Spark's ``repartitionByRange``, where a row's range is its
    task's."""
    from pyspark.sql import functions as F

    most = max(partitions, most or partitions)
    if most <= 1 or (partitions <= 1 and rows < SIZE_BY_COST_FROM):
        return _by_range(combined, partitions)
    every = max(1, rows // SAMPLE_ROWS)
    # two samples in one pass, each scaled by ``every``: a key's own cost from one key in ``every`` (with all of its
    # rows, to tell whether it has stored windows), its rows' from one row in ``every``, which finds the few hot
    # keys a sample of keys would miss (Zipf: the hottest holds 8% of the rows; measured 780k of 1M in one task)
    key_in = F.pmod(F.xxhash64("key"), F.lit(every)) == 0
    row_in = F.col("_row_in")  # seeded: the same rows of the same input, run after run
    stored = F.col("state").isNotNull()
    cost = F.coalesce(F.sum(F.when(row_in, F.when(stored, F.lit(STATE_ROW_COST)).otherwise(F.lit(1)))), F.lit(0)) + \
        F.when(~F.max(key_in), F.lit(0)).when(F.max(stored), F.lit(KEY_COST)).otherwise(F.lit(NEW_KEY_COST))
    sample = (combined.withColumn("_row_in", F.rand(SAMPLE_SEED) * every < 1).where(key_in | row_in)
              .groupBy("key").agg(cost.alias("w")).toArrow())
    keys, weights = sample.column("key").to_pylist(), sample.column("w").to_pylist()
    tasks = tasks_for(weights, every, partitions, most)
    bounds = weighted_bounds(keys, weights, tasks) if tasks > 1 else None
    if bounds is None:
        return _by_range(combined, partitions)
    slots = [slot_for(i, tasks) for i in range(len(bounds) + 1)]
    return (combined.withColumn(RANGE, _range_of(F.col("key"), bounds, 0, len(bounds)))
            .repartition(tasks, _slot_of(F.col(RANGE), slots)))


def _by_range(combined, partitions: int):
    """Spark's own range partitioning by key; a row's range is its task's."""
    from pyspark.sql import functions as F

    return combined.repartitionByRange(partitions, "key").withColumn(RANGE, F.spark_partition_id())


def tasks_for(weights: list[int], every: int, least: int, most: int) -> int:
    """The per-key step's tasks for a batch whose sample (one key in ``every``) has keys of these ``weights``
    (each key's cost, its rows' and its own): its estimated cost over ``COST_PER_TASK``, within [``least``,
    ``most``]."""
    cost = every * sum(weights)
    return max(least, min(most, -(-cost // COST_PER_TASK)))


def weighted_bounds(keys: list[str], weights: list[int], partitions: int) -> list[str] | None:
    """Upper bounds (inclusive, ascending, distinct) of ``partitions`` key ranges of about equal cost, each key
    costing its ``weights`` (its rows' and its own); None when the sample has too few keys to cut."""
    if len(keys) < 4 * partitions:
        return None
    order = sorted(range(len(keys)), key=keys.__getitem__)
    cost = np.cumsum([weights[i] for i in order])
    cuts = np.searchsorted(cost, cost[-1] * np.arange(1, partitions) / partitions)
    bounds: list[str] = []
    last = keys[order[-1]]
    for c in cuts.tolist():
        key = keys[order[min(c, len(order) - 1)]]
        if key < last and (not bounds or key > bounds[-1]):  # at the last key, the range after would be empty
            bounds.append(key)
    return bounds


def _range_of(key, bounds: list[str], lo: int, hi: int):
    """How many of ``bounds[lo:hi]`` lie below ``key``, plus ``lo``: a balanced tree of comparisons."""
    from pyspark.sql import functions as F

    if lo == hi:
        return F.lit(lo)
    mid = (lo + hi) // 2
    return F.when(key <= F.lit(bounds[mid]), _range_of(key, bounds, lo, mid)).otherwise(
        _range_of(key, bounds, mid + 1, hi))


def _slot_of(rng, slots: list[int]):
    from pyspark.sql import functions as F

    expr = F.lit(slots[-1])
    for i in range(len(slots) - 2, -1, -1):
        expr = F.when(rng == i, F.lit(slots[i])).otherwise(expr)
    return expr.cast("int")


def slot_for(task: int, tasks: int) -> int:
    """The smallest int Spark's hash partitioning of ``tasks`` (Murmur3, seed 42, ``pmod``) sends to ``task``."""
    value = 0
    while murmur3_int(value) % tasks != task:
        value += 1
    return value


def murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of an int (Murmur3 x86 32-bit, ``Murmur3_x86_32.hashInt``), signed."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    k1 = rotl((value & 0xFFFFFFFF) * 0xCC9E2D51 & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h1 = (rotl(seed ^ k1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 4
    h1 = (h1 ^ (h1 >> 16)) * 0x85EBCA6B & 0xFFFFFFFF
    h1 = (h1 ^ (h1 >> 13)) * 0xC2B2AE35 & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1
