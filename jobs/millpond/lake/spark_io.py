"""Spark's reads and writes of the lake for the engine, done on executors with ``mapInArrow``: landing files in,
Delta snapshots in, Delta data files out.

Spark here has neither hadoop-aws nor the Delta jars. Python data sources would do (``lake.sparksource`` is one,
for ad-hoc queries), but each of their operations makes the server start fresh Python planner processes
(``create_data_source``, ``plan_data_source_read``, ``write_into_data_source``, ``commit_data_source_write``),
each importing pyarrow and millpond: seconds per operation on a warm server. So the engine plans on the client
and ships plain functions instead, which run in the executors' reused Python workers:

- ``read_landing``: ``spark.range`` with one partition per planned file; each task fetches and parses its file
  with the local engine's parser, bad rows kept with their reason;
- ``read_table``: the client lists a Delta version's data files with delta-rs; each task reads one file with
  pyarrow and conforms it to the table's schema (``lake.snapshot_files``);
- ``write_files``: each task writes its rows as Parquet data files into the table's folder and returns one row
  per file, its add action as JSON. ``collect_writes`` runs every table's write as one Spark job and brings back
  only those rows; the batch (the Connect client, which holds the pipeline's lease) commits each table's files
  in one Delta commit carrying its application transaction (``commit_files``).

What reaches the client is bounded by the number of files and tables, never by rows. The functions shipped to
executors are top-level (bound with ``functools.partial``) so they pickle by reference: a reused worker imports
this module once. The engine's ``mapInArrow`` calls go through ``map_arrow``, which names their input's columns:
else a Connect client asks the server for them first, a round trip per call.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from millpond.config import Settings
from millpond.lake.snapshot_files import Storage, data_files, read_file, table_schema
from millpond.lake.spark_frames import collected

#: the rows a write returns: the table it wrote and one file's add action (JSON)
WRITTEN = pa.schema([("tbl", pa.string()), ("action", pa.string())])


def landing_schema(value_type: str) -> pa.Schema:
    """Every row of the planned files: an element (``reason`` null) or a quarantined line (``reason`` set).
    An element names its file by ``file_rank`` (the file's place among the batch's files by name: dedup's
    order, at an integer's cost in its sort), a quarantined line by ``source_file``."""
    return pa.schema([("id", pa.string()), ("key", pa.string()),
                      ("value", pa.int64() if value_type == "int" else pa.float64()),
                      ("event_time", pa.int64()), ("arrival_time", pa.int64()), ("file_rank", pa.int32()),
                      ("pos", pa.int64()), ("source_file", pa.string()), ("line", pa.int64()), ("raw", pa.string()),
                      ("reason", pa.string())])


def spark_schema(schema: pa.Schema):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema, prefer_timestamp_ntz=False)


def map_arrow(df, task, schema, columns: Sequence[str] | None = None):
    """``df.mapInArrow(task, schema)``. A Connect client first asks the server for ``df``'s columns, a round trip
    in which the server analyses ``df``'s whole plan (15-60 ms here, several per batch); ``columns``, the columns
    ``task`` reads in their order, spares it: ``df`` is narrowed to them, and their names, all that the call
    sends, are taken as known (a name ``df`` lacks fails the job on the server)."""
    if columns is not None:
        df = df.select(*columns)
        if getattr(df, "_cached_schema", False) is None:  # a Connect frame whose columns are not known yet
            from pyspark.sql.types import NullType, StructField, StructType

            df._cached_schema = StructType([StructField(c, NullType()) for c in columns])
    return df.mapInArrow(task, schema)


def _per_item(spark, items: list[Any], task, tasks: int | None = None) -> Any:
    """One Spark partition per item, or ``tasks`` partitions of consecutive items (``spark.range``: no shuffle,
    no rows from the client); ``task`` gets the items (``Slices``) and the record batches of its partition.
    The range has a row per partition, not per item: Spark writes its length into the code it generates, which
    then stays the same from batch to batch however many files a batch has."""
    slices = min(max(len(items), 1), tasks or max(len(items), 1))
    return spark.range(0, slices, 1, slices), functools.partial(task, Slices(items, slices))


class Slices:
    """Items cut into ``slices`` runs of consecutive items, as ``spark.range`` cuts its rows."""

    def __init__(self, items: list[Any], slices: int) -> None:
        self.items, self.slices = items, slices

    def of(self, batches: Iterable[pa.RecordBatch]) -> Iterator[Any]:
        """The items of the partitions whose numbers ``batches`` hold."""
        n = len(self.items)
        for b in batches:
            for s in b.column(0).to_pylist():
                yield from self.items[s * n // self.slices:(s + 1) * n // self.slices]


# landing ------------------------------------------------------------------------------------------------------
def read_landing(spark, settings: Settings, files: list[tuple[str, int]], value_type: str, processing_time: int,
                 tasks: int | None = None):
    """The planned files' rows as a DataFrame of ``landing_schema``, read and parsed on executors; ``tasks``:
    at most this many read tasks (a task per file by default: a small batch's few files need not cost a task
    each, a Python worker's round trip)."""
    rank = {key: i for i, key in enumerate(sorted(key for key, _ in files))}
    ids, task = _per_item(spark, [(key, arrival, rank[key]) for key, arrival in files], _landing_task, tasks)
    task = functools.partial(task, Storage.of(settings), settings.bucket_landing, value_type, processing_time)
    return map_arrow(ids, task, spark_schema(landing_schema(value_type)), ["id"])


def _landing_task(files: Slices, storage: Storage, bucket: str, value_type: str,
                  processing_time: int, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: each of the partition's files fetched and parsed (the local engine's parser)."""
    filesystem = None
    for key, arrival, rank in files.of(batches):  # an empty plan still has one (empty) partition
        if filesystem is None:
            filesystem, _ = storage.filesystem(f"s3://{bucket}/{key}")
        yield from _landing_rows(filesystem, bucket, key, arrival, rank, value_type, processing_time)


def _landing_rows(filesystem, bucket: str, key: str, arrival: int, rank: int, value_type: str,
                  processing_time: int) -> Iterator[pa.RecordBatch]:
    from millpond.lake.landing import event_schema, missing_file, parse_file_table

    schema = landing_schema(value_type)
    try:
        # a random-access file reads the object in one ranged GET; an input stream reads it in small pieces
        # (36 MB: 0.1 s against 1.8 s here)
        with filesystem.open_input_file(f"{bucket}/{key}") as handle:
            data = handle.read()
    except FileNotFoundError:  # deleted since it was planned: one quarantined row, as on the local engine
        good, bad = event_schema(value_type).empty_table(), [missing_file(key)]
    else:
        good, bad = parse_file_table(key, data, value_type=value_type, file_arrival_us=arrival,
                                     processing_time=processing_time)
    n = good.num_rows
    if n:
        yield pa.RecordBatch.from_arrays(
            [*(c.combine_chunks() for c in good.columns), pa.array(np.full(n, rank, np.int32)),
             pa.array(np.arange(n, dtype=np.int64)), *(pa.nulls(n, f.type) for f in list(schema)[7:])], schema=schema)
    if bad:
        m = len(bad)
        yield pa.RecordBatch.from_arrays(
            [*(pa.nulls(m, f.type) for f in list(schema)[:7]), pa.array([b[0] for b in bad], pa.string()),
             pa.array([b[1] for b in bad], pa.int64()), pa.array([b[2] for b in bad], pa.string()),
             pa.array([b[3] for b in bad], pa.string())], schema=schema)


# Delta snapshots ----------------------------------------------------------------------------------------------
def read_table(spark, tables, pipeline: str, name: str, version: int | None = None, *,
               only: list[tuple[str, dict[str, Any]]] | None = None, tasks: int | None = None,
               columns: Sequence[str] | None = None):
    """``pipeline.name`` at ``version`` (latest if None) as a DataFrame, its data files listed here with
    delta-rs and read on executors (a task per file, or at most ``tasks``); ``only``: just these of its files
    (as ``snapshot_files.data_files`` lists them), e.g. the partitions a rewrite replaces; ``columns``: only these
    (in the table's order), the others not read from the files (Spark cannot prune the columns of a Python
    task's output). None if the table does not exist."""
    dt = tables.open(pipeline, name, version)
    if dt is None:
        return None
    files = data_files(dt) if only is None else only
    schema = table_schema(dt)
    if columns is not None:
        schema = pa.schema([f for f in schema if f.name in set(columns)])
    ids, task = _per_item(spark, files, _table_task, tasks)
    return map_arrow(ids, functools.partial(task, Storage.of(tables.settings), schema), spark_schema(schema),
                     ["id"])


def table_files(tables, pipeline: str, name: str, version: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The data files of ``pipeline.name`` at ``version`` (URI, typed partition values); [] if no table."""
    dt = tables.open(pipeline, name, version)
    return [] if dt is None else data_files(dt)


def table_rows(tables, pipeline: str, name: str, version: int | None) -> int:
    """The rows of ``pipeline.name`` at ``version`` by its files' statistics (0 without the table or a version)."""
    if version is None:
        return 0
    dt = tables.open(pipeline, name, version)
    if dt is None:
        return 0
    import pyarrow.compute as pc

    return int(pc.sum(pa.table(dt.get_add_actions(flatten=True)).column("num_records")).as_py() or 0)


def _table_task(files: Slices, storage: Storage, schema: pa.Schema,
                batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: the partition's data files, conformed to the table's schema."""
    for uri, parts in files.of(batches):
        filesystem, path = storage.filesystem(uri)
        yield from read_file(filesystem, path, schema, parts)


# data files out -----------------------------------------------------------------------------------------------
def write_files(df, settings: Settings, table: str, table_uri: str, partition_by: list[str] | None = None,
                columns: Sequence[str] | None = None):
    """A lazy DataFrame (of ``WRITTEN``) that writes ``df`` as data files of the table at ``table_uri`` from the
    executors, one row per file written; run it with ``collect_writes``. ``columns``: ``df``'s, in the files'
    order, when the caller knows them (``map_arrow``)."""
    task = functools.partial(_write_task, Storage.of(settings), table, table_uri, list(partition_by or []))
    return map_arrow(df, task, spark_schema(WRITTEN), columns)  # a struct, not DDL text: no parse on the server


def collect_writes(writes: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """Every write in one Spark job; each table's add actions (only the file list comes to the client)."""
    if not writes:
        return {}
    rows = collected(functools.reduce(lambda a, b: a.unionByName(b), writes))
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["tbl"], []).append(json.loads(r["action"]))
    return out


def _write_task(storage: Storage, table_name: str, table_uri: str, partition_by: list[str],
                batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: the task's rows as one Parquet file per partition of the table; one row per file."""
    got = [b for b in batches if b.num_rows]
    if not got:
        return
    actions = write_table(storage, table_uri, pa.Table.from_batches(got), partition_by)
    yield pa.RecordBatch.from_arrays([pa.array([table_name] * len(actions), pa.string()),
                                      pa.array(actions, pa.string())], names=["tbl", "action"])


def write_table(storage: Storage, table_uri: str, table: pa.Table, partition_by: list[str] | None = None
                ) -> list[str]:
    """``table``'s rows as data files of the Delta table at ``table_uri``, one per partition; their add
    actions (JSON), for a commit by the batch (``file_commits.commit_files``)."""
    import pyarrow.parquet as pq

    partition_by = list(partition_by or [])
    filesystem, root = storage.filesystem(table_uri.rstrip("/"))
    actions = []
    for values, part in _partitions(table, partition_by):
        folder = "/".join(f"{k}={v}" for k, v in values.items())
        rel = f"{folder + '/' if folder else ''}part-{uuid.uuid4().hex}.parquet"
        data = part.drop_columns(partition_by) if partition_by else part
        buffer = pa.BufferOutputStream()  # written whole, then one PUT; its size is known without asking
        pq.write_table(data, buffer)
        body = buffer.getvalue()
        with filesystem.open_output_stream(f"{root}/{rel}") as out:
            out.write(body)
        actions.append(json.dumps({"path": rel, "size": body.size, "partition_values": values,
                                   "modification_time": int(time.time() * 1000), "stats": _stats(data)}))
    return actions


def _partitions(table: pa.Table, columns: list[str]) -> Iterator[tuple[dict[str, str | None], pa.Table]]:
    if not columns:
        yield {}, table
        return
    import pyarrow.compute as pc

    groups = table.group_by(columns).aggregate([])
    for row in groups.to_pylist():
        mask = None
        for c in columns:
            cond = pc.is_null(table.column(c)) if row[c] is None else pc.equal(table.column(c), row[c])
            mask = cond if mask is None else pc.and_(mask, cond)
        yield {c: (None if row[c] is None else str(row[c])) for c in columns}, table.filter(mask)


def _stats(table: pa.Table) -> str:
    """Delta file statistics: row and null counts, and min/max of every column a reader may filter on. A filtered
    read by delta-rs skips a file that has no min/max for the filtered column, so every type gets them:
    timestamps as delta-rs writes them (milliseconds), widened to whole milliseconds (min down, max up) so that
    no row falls outside them."""
    import pyarrow.compute as pc

    mins, maxs, nulls = {}, {}, {}
    for f in table.schema:
        col = table.column(f.name)
        nulls[f.name] = col.null_count
        if col.null_count == len(col):
            continue
        if pa.types.is_timestamp(f.type):
            mm = pc.min_max(col.cast(pa.timestamp(f.type.unit, f.type.tz)).cast(pa.int64()))
            per_ms = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}[f.type.unit]
            if per_ms is None:
                continue
            lo, hi = mm["min"].as_py() // per_ms, min(-(-mm["max"].as_py() // per_ms), LAST_MS)
            mins[f.name], maxs[f.name] = _ms_text(lo), _ms_text(hi)
        elif pa.types.is_date(f.type):
            mm = pc.min_max(col)
            mins[f.name], maxs[f.name] = mm["min"].as_py().isoformat(), mm["max"].as_py().isoformat()
        elif (pa.types.is_string(f.type) or pa.types.is_integer(f.type) or pa.types.is_floating(f.type)
              or pa.types.is_boolean(f.type)):
            mm = pc.min_max(col)
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            if lo is None or (isinstance(lo, float) and (lo != lo or hi != hi)):  # NaN only: no bounds
                continue
            mins[f.name], maxs[f.name] = lo, hi
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


#: 9999-12-31T23:59:59.999Z, the last millisecond a statistic can name (delta-rs writes the end of time so)
LAST_MS = 253402300799999


def _ms_text(ms: int) -> str:
    """A timestamp in milliseconds since the epoch, as Delta statistics write it (UTC, three decimals)."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"
