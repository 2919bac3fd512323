"""A stage's input on the Spark engine: its upstreams' pane rows over the range its plan pins, read on executors
and turned into elements there, as ``runtime.steps.upstream`` does in one process (same ids, values, times).

Per upstream (``plan["versions"]["upstreams"]``: from, to, accumulation, epoch), the difference between the
content of version ``from`` (consumed) and ``to`` (``steps.upstream.changed_panes``):

- no rewind in between: the data files the commits in between added (``lake.delta_files.added_files``: what the
  change feed reads; a compaction adds none), read file by file on executors;
- nothing consumed yet: the whole table as of ``to``;
- across a rewind: both versions' rows above the last batch both still hold (files whose ``batch`` statistic is
  at most that batch are not read), compared on executors by a null-safe anti-join both ways.

A one-key stage's batch counts its elements first from the pane files' statistics, else the pane rows' own
columns (``stage_tally``), so that only the per-key step's read makes them; other batches make, keep and count
them first (``stage_elements``).

Why not collect and reuse the local code: a stage over a large upstream would hold every pane row in the batch's
process. Here the client reads only log entries and file statistics; rows stay on executors.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from millpond.lake import spark_io
from millpond.lake.delta_files import DataFile, added_files, column_max, magnitude, rows_of, snapshot_files
from millpond.lake.spark_frames import collected, local_frame
from millpond.model.panes import pane_schema
from millpond.model.stages import ALL_KEY
from millpond.runtime.engines.spark_keep import keep

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: the upstream pane columns compared across a rewind and turned into elements
PANE_KEY = ["key", "window_start", "window_end"]


def upstream_rows(job: BatchContext, plan: dict[str, Any], partitions: int):
    """The planned upstream panes as elements: ``id, key, value, event_time, arrival_time`` (times in us), plus
    ``file_rank`` and ``pos``, the order the local engine's dedup sees them in (per upstream, the panes taken back,
    then the panes added, each by (batch, seq)); read in at most ``partitions`` tasks per table version."""
    from pyspark.sql import functions as F

    parts = []
    for i, (name, rng) in enumerate((plan["versions"].get("upstreams") or {}).items()):
        removed, added, firsts = changed_panes(job, name, rng["from"], rng["to"], partitions)
        if removed is not None:
            parts.append(pane_elements(job, name, removed, {**rng, "to": rng["from"]}, 2 * i, partitions, undo=True,
                                       firsts=firsts))
        if added is not None:
            parts.append(pane_elements(job, name, added, rng, 2 * i + 1, partitions, firsts=firsts))
    if not parts:
        schema = spark_io.landing_schema(job.spec.value_type)
        return job.spark.createDataFrame([], spark_io.spark_schema(schema)).select(*ELEMENT_COLUMNS)
    return functools.reduce(lambda a, b: a.unionByName(b), parts).select(
        "id", "key", "value", "event_time", "arrival_time", F.col("file_rank").cast("int"), F.col("pos").cast("long"))


#: what ``upstream_rows`` returns: an element's columns, then its place in the local engine's order
ELEMENT_COLUMNS = ("id", "key", "value", "event_time", "arrival_time", "file_rank", "pos")


def stage_input(job: BatchContext, plan: dict[str, Any], partitions: int):
    """``upstream_rows`` in the landing read's columns (``spark_io.landing_schema``, no quarantined row), so the
    plan's dedup takes a stage's elements as it takes parsed landing lines."""
    from pyspark.sql import functions as F

    types = {f.name: f.dataType for f in spark_io.spark_schema(spark_io.landing_schema(job.spec.value_type)).fields}
    rows = upstream_rows(job, plan, partitions)
    return rows.select(*((F.col(c) if c in ELEMENT_COLUMNS else F.lit(None)).cast(t).alias(c)
                         for c, t in types.items()))


class Tally(NamedTuple):
    """What a batch knows of its elements before its per-key step: how many, their least and greatest event time
    (None: none, or not known: ``timed`` false), and a bound of their values' magnitude (``spark_lift``).
    ``timed``: the event times were counted; else the per-key step's tasks give the greatest (``spark_keys``'s
    ``read`` rows) and the stored windows' read finds the least itself."""

    rows: int
    lo: int | None
    hi: int | None
    big: float | None
    timed: bool = True

    def ranges(self, spark, key: str):
        """The elements' event-time range, as one key's (``spark_batch.stored_windows``): a frame of one row."""
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        schema = StructType([StructField("key", StringType()), StructField("lo", LongType()),
                             StructField("hi", LongType())])
        return local_frame(spark, [(key, self.lo, self.hi)] if self.rows else [], schema)


def plain_tally(job: BatchContext, plan: dict[str, Any], partitions: int) -> Tally | None:
    """The planned elements' ``Tally`` from the pane rows' files, without making an element: by their statistics
    where every file has a row count and its values' bounds (no job at all: an element is one pane row, and the
    event times come later, ``Tally.timed``), else in one job that reads only their window bounds and values.
    Either way the per-key step then reads them once, the only pass that makes elements. None where a range
    crosses a rewind (its elements are rows of an anti-join, which only making them counts). An element's event
    time is its row's window start or end less 1 us; its value a pane's value less its window's previous one, or
    either negated, so at most twice the largest pane value's magnitude."""
    from pyspark.sql import functions as F

    up = job.spec.upstream
    listed = []
    for name, rng in (plan["versions"].get("upstreams") or {}).items():
        if rng["from"] == rng["to"]:
            continue
        plain = plain_files(job, name, rng["from"], rng["to"])
        if plain is None:
            return None
        if plain[1]:
            listed.append((name, *plain))
    every = [f for _n, _v, files in listed for f in files]
    if not every:
        return Tally(0, None, None, None)
    big = magnitude(every, "value")
    if big is not None and all(f.rows is not None for f in every):
        return Tally(rows_of(every), None, None, 2 * big, timed=False)
    rows = functools.reduce(lambda a, b: a.unionByName(b), (
        spark_io.read_table(job.spark, job.tables, name, "panes", version, only=[f.location for f in files],
                            tasks=partitions, columns=["window_start", "window_end", "value"])
        for name, version, files in listed))
    start, end = F.unix_micros("window_start"), F.unix_micros("window_end")
    event_time = start if up.event_time == "window_start" else end - F.lit(1)
    big = F.max(F.abs(F.col("value").cast("double")))
    got = collected(rows.agg(F.count(F.lit(1)).alias("n"), F.min(event_time).alias("lo"),
                             F.max(event_time).alias("hi"), big.alias("big")))[0]
    return Tally(got["n"], got["lo"], got["hi"], None if got["big"] is None else 2 * got["big"])


#: each batch's plain listings (``plain_files``), dropped with the batch
_LISTED: weakref.WeakKeyDictionary[Any, dict[tuple[str, int | None, int | None], tuple[int, list[DataFile]] | None]] = (
    weakref.WeakKeyDictionary())


def plain_files(job: BatchContext, name: str, before: int | None, upto: int | None
                ) -> tuple[int, list[DataFile]] | None:
    """(version, files): the data files holding an upstream's pane rows added after ``before`` up to ``upto``, read
    as of ``version``: the whole table where nothing was consumed, else what the commits in between added; None
    where the range crosses a rewind (or runs backwards), whose rows only a comparison of two versions finds
    (``changed_panes``). Listed once per batch: sizing, the tally and the read all ask, and each listing reads
    the table's log."""
    memo = _LISTED.setdefault(job, {})
    if (name, before, upto) not in memo:
        if before is None:
            memo[name, before, upto] = (upto, snapshot_files(job.tables, name, "panes", upto))
        elif upto is not None and upto > before and not job.tables.rewinds(name, "panes", before, upto):
            memo[name, before, upto] = (upto, added_files(job.tables, name, "panes", before, upto))
        else:
            memo[name, before, upto] = None
    return memo[name, before, upto]


def changed_panes(job: BatchContext, name: str, before: int | None, upto: int | None, partitions: int):
    """(removed, added, firsts): DataFrames of pane rows (None: none), as ``steps.upstream.changed_panes``;
    ``firsts``: the files read say by their statistics that every row is its window's first pane (pane index 0),
    which has no previous pane (``pane_elements``)."""
    if before == upto:
        return None, None, True
    plain = plain_files(job, name, before, upto)
    if plain is not None:
        version, files = plain
        return None, _read(job, name, version, files, partitions, ELEMENT_SOURCE), _firsts(files)
    lo, hi = sorted(-1 if v is None else v for v in (before, upto))
    rewinds = job.tables.rewinds(name, "panes", lo, hi)
    listed = {v: snapshot_files(job.tables, name, "panes", v) for v in {before, upto, *rewinds}}
    shared = min(_last_batch(job, name, v, files, partitions) for v, files in listed.items())
    old, new = (_panes_after(job, name, v, listed[v], shared, partitions) for v in (before, upto))
    firsts = all(_firsts(files) for files in listed.values())
    if old is None or new is None:
        return old, new, firsts
    columns = pane_schema(job.spec.value_type).names
    return _anti(old, new, columns), _anti(new, old, columns), firsts


def _firsts(files: list[DataFile]) -> bool:
    """Every row of ``files`` is a first pane, by their statistics (a file without one may hold later panes)."""
    return column_max(files, "pane_index") == 0


def planned_rows(job: BatchContext, plan: dict[str, Any]) -> int:
    """About how many upstream pane rows the batch reads (file statistics, no row read): sizes the batch."""
    total = 0
    for name, rng in (plan["versions"].get("upstreams") or {}).items():
        before, upto = rng["from"], rng["to"]
        if before == upto:
            continue
        plain = plain_files(job, name, before, upto)
        if plain is not None:
            total += rows_of(plain[1])
        else:  # across a rewind: at most both versions' rows
            total += sum(rows_of(snapshot_files(job.tables, name, "panes", v)) for v in (before, upto))
    return total


#: the pane columns an element is made of (``pane_elements``, ``_with_previous``): a read that compares no rows
#: (no rewind between) leaves the others in the files
ELEMENT_SOURCE = ("key", "window_start", "window_end", "value", "pane_index", "kind", "batch", "processing_time",
                  "seq")


def _read(job: BatchContext, name: str, version: int, files: list[DataFile], partitions: int,
          columns: tuple[str, ...] | None = None):
    """The pane rows of ``files`` (of ``name``'s panes at ``version``), in the stage's pane columns (``columns``:
    only these); None if none."""
    from pyspark.sql import functions as F

    if not files:
        return None
    names = [c for c in pane_schema(job.spec.value_type).names if columns is None or c in columns]
    rows = spark_io.read_table(job.spark, job.tables, name, "panes", version, only=[f.location for f in files],
                               tasks=partitions, columns=None if columns is None else names)
    vtype = "bigint" if job.spec.value_type == "int" else "double"
    return rows.select(*(F.col(c).cast(vtype).alias(c) if c == "value" else F.col(c) for c in names))


def _last_batch(job: BatchContext, name: str, version: int | None, files: list[DataFile], partitions: int) -> int:
    """The upstream's last batch in its panes at ``version`` (0: none), from the files' statistics, else one
    aggregate over its rows."""
    from pyspark.sql import functions as F

    if version is None:
        return 0
    known = column_max(files, "batch")
    if known is not None:
        return known
    rows = spark_io.read_table(job.spark, job.tables, name, "panes", version, only=[f.location for f in files],
                               tasks=partitions)
    return int(rows.agg(F.max("batch")).collect()[0][0] or 0)


def _panes_after(job: BatchContext, name: str, version: int | None, files: list[DataFile], batch: int,
                 partitions: int):
    """The pane rows of ``version`` above ``batch`` (a file whose statistics say none are there is not read)."""
    from pyspark.sql import functions as F

    if version is None:
        return None
    wanted = [f for f in files if f.rows != 0 and (f.maxs.get("batch") is None or f.maxs["batch"] > batch)]
    rows = _read(job, name, version, wanted, partitions)
    if rows is None:
        return job.spark.createDataFrame([], spark_io.spark_schema(pane_schema(job.spec.value_type)))
    return rows.where(F.col("batch") > F.lit(batch))


def _anti(rows, other, cols: list[str]):
    """``rows`` not in ``other``, comparing every column (``cols``: both frames') with nulls equal (the local
    engine's row ids)."""
    from pyspark.sql import functions as F

    renamed = other.select(*(F.col(c).alias(f"_o{i}") for i, c in enumerate(cols)))
    same = functools.reduce(lambda a, b: a & b, (F.col(c).eqNullSafe(F.col(f"_o{i}")) for i, c in enumerate(cols)))
    return rows.join(renamed, same, "left_anti")


def pane_elements(job: BatchContext, name: str, rows, rng: dict[str, Any], rank: int, partitions: int,
                  undo: bool = False, firsts: bool = False):
    """One element per pane row, as ``steps.upstream.pane_elements``: what the pane changed in its window's value
    (negated for ``undo``), its id naming the upstream's epoch, key, window, pane index and kind. ``firsts``: every
    row is its window's first pane, whose change is its whole value: over an accumulating upstream, no previous
    pane is looked for (no shuffle of the rows by window, no second read of the table)."""
    from pyspark.sql import functions as F

    up = job.spec.upstream
    value, retraction = F.col("value"), F.col("kind") == F.lit("retraction")
    if rng["accumulation"] == "accumulating_and_retracting":
        value = F.when(retraction, -value).otherwise(value)
    elif rng["accumulation"] == "accumulating" and not firsts:
        rows = _with_previous(job, name, rows, rng["to"], partitions, whole=rng.get("from") is None and not undo)
        value = value - F.coalesce(F.col("_prev"), F.lit(0))
    if undo:
        value = -value
    epoch = rng.get("epoch") or 0
    tag = ("undo|" if undo else "") + (name if not epoch else f"{name}#{epoch + 1}")
    start, end = F.unix_micros("window_start"), F.unix_micros("window_end")
    parts = (F.col("key"), start.cast("string"), end.cast("string"), F.col("pane_index").cast("string"), F.col("kind"))
    ident = F.concat(F.lit(tag), *(p for c in parts for p in (F.lit("|"), c)))  # null if a part is, as in Arrow
    key = F.col("key") if up.key == "keep" else F.lit(ALL_KEY)
    event_time = start if up.event_time == "window_start" else end - F.lit(1)
    return rows.select(ident.alias("id"), key.alias("key"), value.alias("value"), event_time.alias("event_time"),
                       F.unix_micros("processing_time").alias("arrival_time"), F.lit(rank).alias("file_rank"),
                       (F.col("batch").cast("long") * F.lit(1 << 32) + F.col("seq")).alias("pos"))


def _with_previous(job: BatchContext, name: str, rows, version: int | None, partitions: int, whole: bool = False):
    """``rows`` with ``_prev``: over an accumulating upstream, the value of its window's previous value pane as
    of ``version`` (null for a window's first), as ``steps.upstream.previous_values``. ``whole``: ``rows`` are the
    upstream's whole panes at ``version`` (a stage's first range, a backfill from scratch), so they hold every
    earlier pane themselves: the table is not read a second time, and the previous value pane (the last with a
    lower pane index) is found by a window over them, without joining it back."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if whole:  # one window over the rows themselves: no second read, no join back
        earlier = Window.partitionBy(*PANE_KEY).orderBy("pane_index").rangeBetween(Window.unboundedPreceding, -1)
        value = F.when(F.col("kind") == F.lit("value"), F.col("value"))
        return rows.withColumn("_prev", F.last(value, ignorenulls=True).over(earlier))
    hist = _read(job, name, version, snapshot_files(job.tables, name, "panes", version), partitions, ELEMENT_SOURCE)
    if hist is None:
        return rows.withColumn("_prev", F.lit(None).cast("bigint" if job.spec.value_type == "int" else "double"))
    bounds = rows.agg(F.min("window_start").alias("_lo"), F.max("window_start").alias("_hi"))
    windows = rows.select(*PANE_KEY).distinct()
    hist = (hist.where("kind = 'value'").crossJoin(F.broadcast(bounds))
            .where(F.col("window_start").between(F.col("_lo"), F.col("_hi")))
            .join(windows, PANE_KEY, "left_semi"))
    prev = hist.select(*PANE_KEY, "pane_index", F.lag("value").over(
        Window.partitionBy(*PANE_KEY).orderBy("pane_index")).alias("_prev"))
    return rows.join(prev, [*PANE_KEY, "pane_index"], "left")


def stage_elements(spark, rows, tally: Tally | None = None):
    """``spark_batch.read_and_dedup``'s result for a stage's elements (``stage_input``): every one accepted
    (their ids are unique by construction, ``steps.dedup.by_id``; a pane row is never malformed), and no shuffle by
    id. Counted already (``tally``): left to the per-key step's one read; else kept once and counted by the job
    that keeps them, no cache of the rows besides."""
    from pyspark.sql import functions as F

    accepted = rows.select("id", "key", "value", "event_time", "arrival_time")
    if tally is not None:  # its greatest event time may come from the per-key step (``Tally.timed``)
        counts = {"input": tally.rows, "accepted": tally.rows, "duplicates": 0, "quarantined": 0}
        return rows.where(F.lit(False)), accepted, counts, tally.hi, accepted, tally.big
    accepted = keep(spark, accepted)
    tally = collected(accepted.agg(F.count(F.lit(1)).alias("n"), F.max("event_time").alias("max_et"),
                                   F.max(F.abs(F.col("value").cast("double"))).alias("big")))[0]
    counts = {"input": tally["n"], "accepted": tally["n"], "duplicates": 0, "quarantined": 0}
    return rows.where(F.lit(False)), accepted, counts, tally["max_et"], accepted, tally["big"]


def stage_tally(job: BatchContext, the_plan: dict[str, Any], partitions: int) -> Tally | None:
    """A one-key stage's elements counted from its upstream pane files (``plain_tally``), so that
    they are made once, by the per-key step's read, and never kept: where nothing else reads them (no validation
    of the batch's input, no percentile watermark; the stored windows it reads bounded by the tally's times, or
    by the elements' in the frame that reads them), and
    only one task runs the step (a key range sample would read them again). None: made, kept and counted first
    (``stage_elements``)."""
    if job.spec.upstream.key == "keep" or job.validate or job.spec.watermark_policy.kind == "percentile":
        return None
    return plain_tally(job, the_plan, partitions)
