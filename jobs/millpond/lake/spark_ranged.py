"""A key-ranged table's files read and rewritten on executors, file by file in Arrow: the ``windows`` rows a
batch can change, and its MERGE into ``windows``, at a cost that follows the files the batch touches, not the
rows around them in Spark.

Reads (``read_touched``): the batch's keys, with the event-time range of each key's elements, are tagged with
every file whose key range may hold them; a task per group of files reads each of its files with pyarrow and
keeps only the rows a batch can change: a timer due at the batch's clock, or a window of a tagged key within
reach of its elements (any window of the key when the reach is unknown). Only those rows enter Spark.

Rewrites (``rewrite_files``): copy-on-write.

The batch's changed rows (upserts, and keys to drop: the table's ``deleted`` column set) are tagged with every
file whose key range may hold the old row (its statistics' min and max) and with one home file, where an upsert
goes (the last file, by its smallest key, that starts at or below the key: its range then grows by the keys that
fall between files). A task per group of files then reads each of its files with pyarrow, drops the rows the
batch changed, adds the upserts homed there, sorts by the table's order and writes the result back as one file
or, once it outgrows ``file_rows`` by half, as several of about that many rows. Each task returns the new files'
add actions and the replaced file's, marked ``remove``. Files no changed row can be in are neither read nor
replaced, and no stored row passes through Spark's own rows or shuffles: only the changes do.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.config import Settings
from millpond.lake.snapshot_files import Storage, read_file
from millpond.lake.spark_frames import local_frame
from millpond.lake.spark_io import WRITTEN, map_arrow, spark_schema, write_table

#: the tag columns ``tag_task`` adds to a changed row: the file it concerns and whether it is the row's home
TAGS = (("_f", pa.int32()), ("_home", pa.bool_()))


@dataclass(frozen=True)
class RangedFile:
    """One data file a rewrite may replace: its URI, partition values, the add action that removes it, its key
    range by statistics (``lo`` None: no statistics, any key; ``hi`` None: no upper bound) and its rows (0: not
    known)."""

    uri: str
    partition_values: dict[str, Any]
    remove: dict[str, Any]
    lo: str | None
    hi: str | None
    rows: int = 0


def holding(files: Sequence[RangedFile], keys: pa.Array | pa.ChunkedArray) -> Iterator[tuple[int, np.ndarray]]:
    """(file number, the ascending positions in ``keys`` of those its key range holds) for each file that holds
    any: the keys sorted once, each file's range two binary searches (not a comparison of every key with every
    file, which grows with the table's files times the batch's keys). A file without statistics holds every
    key. (Arrow sorts strings by their UTF-8 bytes, Python by code points: the same order.)"""
    order = np.asarray(pc.sort_indices(keys)).astype(np.int64)
    ordered = keys.take(order).to_numpy(zero_copy_only=False)
    for f, file in enumerate(files):
        if file.lo is None:
            at = np.arange(len(keys))
        else:
            lo = int(np.searchsorted(ordered, file.lo, "left"))
            hi = len(ordered) if file.hi is None else int(np.searchsorted(ordered, file.hi, "right"))
            at = np.sort(order[lo:hi])
        if len(at):
            yield f, at


def rewrite_files(changes, files: Sequence[RangedFile], settings: Settings, table: str, table_uri: str,
                  schema: pa.Schema, keys: Sequence[str], order: Sequence[str], file_rows: int, tasks: int):
    """A lazy DataFrame (of ``spark_io.WRITTEN``) that rewrites the files of ``files`` that ``changes`` concern
    (rows in ``schema``; ``deleted`` true: a key to drop only), run with ``spark_io.collect_writes``. ``keys``:
    the table's merge key; ``order``: its sort within a file; at most ``tasks`` tasks."""
    from pyspark.sql import functions as F

    tagged_schema = pa.schema([*schema, *TAGS])
    tagged = map_arrow(changes, functools.partial(tag_task, list(files), schema), spark_schema(tagged_schema),
                       schema.names)
    task = functools.partial(rewrite_task, Storage.of(settings), list(files), schema, table, table_uri, list(keys),
                             list(order), file_rows)
    return tagged.repartition(max(1, min(tasks, len(files))), F.col("_f")).mapInArrow(task, spark_schema(WRITTEN))


def read_touched(spark, ranges, files: Sequence[RangedFile], always: Collection[int], settings: Settings,
                 schema: pa.Schema, watermark: int, processing_time: int, reach: int | None, tasks: int):
    """The rows of ``files`` a batch can change, read on executors (``stored_schema``'s columns: times in
    microseconds): only files whose key range holds one of its keys, and those numbered in ``always`` (a due
    timer, no statistics). ``ranges``: the batch's keys and their elements' event-time bounds (``key``, ``lo``,
    ``hi``, microseconds); ``schema``: the table's; ``reach``: as ``WindowFn.reach``."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    tagged = map_arrow(ranges, functools.partial(key_tags, list(files)), spark_schema(KEY_TAGS), ["key", "lo", "hi"])
    # a row per file read whatever the keys, so that a file read for its timers alone is read too
    probe_schema = StructType([StructField("key", StringType()), StructField("lo", LongType()),
                               StructField("hi", LongType()), StructField("_f", IntegerType(), False)])
    probes = local_frame(spark, [(None, None, None, f) for f in sorted(always)], probe_schema)
    task = functools.partial(read_task, Storage.of(settings), list(files), schema, watermark, processing_time, reach)
    return map_arrow(tagged.unionByName(probes).repartition(max(1, min(tasks, len(files))), F.col("_f")), task,
                     spark_schema(STORED), KEY_TAGS.names)


#: a batch key tagged with a file that may hold its windows (``key_tags``)
KEY_TAGS = pa.schema([("key", pa.string()), ("lo", pa.int64()), ("hi", pa.int64()), ("_f", pa.int32())])
#: the stored rows a read keeps: the per-key step's state input (times in microseconds)
STORED = pa.schema([("key", pa.string()), ("window_start", pa.int64()), ("window_end", pa.int64()),
                    ("state", pa.string()), ("event_timer", pa.int64()), ("ptime_timer", pa.int64())])


def key_tags(files: list[RangedFile], batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: each key once per file whose key range holds it."""
    for batch in batches:
        if not batch.num_rows:
            continue
        for f, at in holding(files, batch.column("key")):
            rows = batch.take(pa.array(at))
            yield pa.RecordBatch.from_arrays([*rows.columns, pa.array(np.full(rows.num_rows, f, np.int32))],
                                             schema=KEY_TAGS)


def read_task(storage: Storage, files: list[RangedFile], schema: pa.Schema, watermark: int, processing_time: int,
              reach: int | None, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: for each file of the partition, its rows with a due timer or within reach of a
    tagged key's elements."""
    got = [b for b in batches if b.num_rows]
    if not got:
        return
    tags = pa.Table.from_batches(got)
    for f in sorted(set(tags.column("_f").to_pylist())):
        keys = tags.filter(pc.and_(pc.equal(tags.column("_f"), f), pc.is_valid(tags.column("key"))))
        file = files[f]
        filesystem, path = storage.filesystem(file.uri)
        rows = pa.Table.from_batches(list(read_file(filesystem, path, schema, file.partition_values)), schema=schema)
        kept = touched_rows(rows, keys.select(["key", "lo", "hi"]), watermark, processing_time, reach)
        if kept.num_rows:
            yield from kept.to_batches()


def touched_rows(rows: pa.Table, keys: pa.Table, watermark: int, processing_time: int,
                 reach: int | None) -> pa.Table:
    """``rows`` (the table's) a batch can change, as ``STORED``: a due timer, or a window of one of ``keys``
    (key, lo, hi: its elements' event-time bounds) within ``reach`` of them."""
    def us(name: str) -> pa.ChunkedArray:
        return rows.column(name).cast(pa.int64())

    micros = pa.table({"key": rows.column("key"), "window_start": us("window_start"), "window_end": us("window_end"),
                       "state": rows.column("state"), "event_timer": us("event_timer"),
                       "ptime_timer": us("ptime_timer")}, schema=STORED)
    due = pc.or_(pc.fill_null(pc.less_equal(micros.column("event_timer"), watermark), False),
                 pc.fill_null(pc.less_equal(micros.column("ptime_timer"), processing_time), False))
    near = pa.array(np.zeros(rows.num_rows, bool))
    if keys.num_rows:
        # the event-time bounds of each row's key, null for a key the batch does not touch
        bounds = keys.group_by("key").aggregate([("lo", "min"), ("hi", "max")])
        index = pc.index_in(micros.column("key"), value_set=bounds.column("key"))
        lo, hi = pc.take(bounds.column("lo_min"), index), pc.take(bounds.column("hi_max"), index)
        near = pc.is_valid(index)
        if reach is not None:
            near = pc.and_(near, pc.and_(pc.greater_equal(micros.column("window_end"), lo),
                                         pc.less_equal(micros.column("window_start"), pc.add(hi, reach))))
        near = pc.fill_null(near, False)
    return micros.filter(pc.or_(due, near))


def homes(files: Sequence[RangedFile], keys: list[str]) -> np.ndarray:
    """Each key's home file (its number in ``files``): the last file with statistics whose smallest key is at or
    below it, else the first such file; without any statistics, file 0."""
    starts = sorted((f.lo, i) for i, f in enumerate(files) if f.lo is not None)
    if not starts:
        return np.zeros(len(keys), np.int32)
    los = [lo for lo, _i in starts]
    nums = [i for _lo, i in starts]
    return np.array([nums[max(0, bisect.bisect_right(los, k) - 1)] for k in keys], np.int32)


def tag_task(files: list[RangedFile], schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: each changed row once per file that may hold its old version, and once for its home
    (``_home``), with the file's number (``_f``)."""
    tagged = pa.schema([*schema, *TAGS])
    for batch in batches:
        if not batch.num_rows:
            continue
        key = batch.column("key")
        home = homes(files, key.to_pylist())
        by_home = np.argsort(home, kind="stable")
        starts = np.searchsorted(home[by_home], np.arange(len(files) + 1))
        held = dict(holding(files, key))
        for f in range(len(files)):
            at = np.union1d(held.get(f, np.empty(0, np.int64)), by_home[starts[f]:starts[f + 1]])
            if len(at):
                rows = batch.take(pa.array(at))
                yield pa.RecordBatch.from_arrays(
                    [*rows.columns, pa.array(np.full(len(at), f, np.int32)), pa.array(home[at] == f)], schema=tagged)


def rewrite_task(storage: Storage, files: list[RangedFile], schema: pa.Schema, table: str, table_uri: str,
                 keys: list[str], order: list[str], file_rows: int,
                 batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: each file its partition's changed rows concern, replaced (one row per file written,
    and one, marked ``remove``, for the file replaced)."""
    got = [b for b in batches if b.num_rows]
    if not got:
        return
    rows = pa.Table.from_batches(got)
    for f in sorted(set(rows.column("_f").to_pylist())):
        mine = rows.filter(pc.equal(rows.column("_f"), f))
        actions = replace_file(storage, files[f], mine, schema, table_uri, keys, order, file_rows)
        actions.append(json.dumps({"remove": files[f].remove}))
        yield pa.RecordBatch.from_arrays([pa.array([table] * len(actions), pa.string()),
                                          pa.array(actions, pa.string())], names=["tbl", "action"])


def replace_file(storage: Storage, file: RangedFile, changes: pa.Table, schema: pa.Schema, table_uri: str,
                 keys: list[str], order: list[str], file_rows: int) -> list[str]:
    """The add actions of ``file``'s rows after ``changes`` (tagged rows for it): none if no row is left."""
    filesystem, path = storage.filesystem(file.uri)
    old = pa.Table.from_batches(list(read_file(filesystem, path, schema, file.partition_values)), schema=schema)
    changed = changes.select(list(schema.names)).cast(schema)
    kept = old.join(changed.select(keys), keys=keys, join_type="left anti", use_threads=False)
    added = changed.filter(pc.and_(changes.column("_home"), pc.invert(pc.fill_null(changed.column("deleted"), False))))
    after = pa.concat_tables([kept.select(list(schema.names)), added]).sort_by([(c, "ascending") for c in order])
    n = after.num_rows
    if not n:
        return []
    pieces = max(1, round(n / file_rows)) if n > file_rows * 3 // 2 else 1
    actions: list[str] = []
    for i in range(pieces):
        lo, hi = i * n // pieces, (i + 1) * n // pieces
        actions += write_table(storage, table_uri, after.slice(lo, hi - lo))
    return actions


def split_written(actions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the files added, the add actions of the files they replace) of ``rewrite_files``' rows."""
    return [a for a in actions if "remove" not in a], [a["remove"] for a in actions if "remove" in a]
