"""Spark's reads and writes of the lake, done on executors: landing files in, Delta data files out.

Spark here has neither hadoop-aws nor the Delta jars, so both directions are Python data sources:

- ``millpond_landing`` reads a batch's planned landing files, one Spark partition per file, each fetched
  and parsed in an executor's Python worker (the same parser as the local engine), bad rows kept with
  their reason;
- ``millpond_files`` writes a DataFrame as Parquet data files into a Delta table's folder, one or more
  files per task; the driver side of the write (``commit``, which over Spark Connect runs in the server)
  records the files' add actions in a small manifest object. The batch (the Connect client, which holds
  the pipeline's lease) then commits them to the table in one Delta commit carrying the batch's
  application transaction (``commit_files``). What passes through the driver is the list of files, never
  their rows.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from millpond.config import Settings
from millpond.lake.waits import s3_filesystem

LANDING_FORMAT, FILES_FORMAT = "millpond_landing", "millpond_files"


def store_options(settings: Settings) -> dict[str, str]:
    """What an executor needs to reach the object store (``accessKey``/``secretKey``: names Spark redacts)."""
    return {"endpoint": settings.s3_endpoint, "region": settings.s3_region, "accessKey": settings.s3_access_key,
            "secretKey": settings.s3_secret_key, "storeTimeout": str(settings.store_timeout_s)}


def _filesystem(options: dict[str, str]):
    return s3_filesystem(options["endpoint"], options["accesskey"], options["secretkey"], options["region"],
                         float(options.get("storetimeout", "120")))


def landing_schema(value_type: str) -> pa.Schema:
    """Every row of the planned files: an element (``reason`` null) or a quarantined line (``reason`` set)."""
    return pa.schema([("id", pa.string()), ("key", pa.string()),
                      ("value", pa.int64() if value_type == "int" else pa.float64()),
                      ("event_time", pa.int64()), ("arrival_time", pa.int64()), ("source_file", pa.string()),
                      ("pos", pa.int64()), ("line", pa.int64()), ("raw", pa.string()), ("reason", pa.string())])


class _File(InputPartition):
    def __init__(self, index: int, key: str, arrival: int) -> None:
        super().__init__(index)
        self.key, self.arrival = key, arrival


class LandingSource(DataSource):
    """``spark.read.format("millpond_landing")`` with options ``files`` (JSON [[key, arrival], ...]),
    ``bucket``, ``valueType``, ``processingTime`` and the store options."""

    @classmethod
    def name(cls) -> str:
        return LANDING_FORMAT

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(landing_schema(self.options.get("valueType", "int")))

    def reader(self, schema: StructType) -> DataSourceReader:
        return LandingReader({k.lower(): v for k, v in self.options.items()})


class LandingReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.files = json.loads(options.get("files", "[]"))

    def partitions(self) -> list[InputPartition]:
        return [_File(i, key, arrival) for i, (key, arrival) in enumerate(self.files)] or [_File(0, "", 0)]

    def read(self, partition: _File) -> Iterator[pa.RecordBatch]:
        from millpond.lake.landing import event_schema, missing_file, parse_file_table

        if not partition.key:
            return
        o = self.options
        schema = landing_schema(o.get("valuetype", "int"))
        try:
            with _filesystem(o).open_input_stream(f"{o['bucket']}/{partition.key}", compression=None) as handle:
                data = handle.read()
        except FileNotFoundError:  # deleted since it was planned: one quarantined row, as on the local engine
            good, bad = event_schema(o.get("valuetype", "int")).empty_table(), [missing_file(partition.key)]
        else:
            good, bad = parse_file_table(partition.key, data, value_type=o.get("valuetype", "int"),
                                         file_arrival_us=partition.arrival, processing_time=int(o["processingtime"]))
        n = good.num_rows
        if n:
            yield pa.RecordBatch.from_arrays(
                [*(c.combine_chunks() for c in good.columns), pa.array([partition.key] * n),
                 pa.array(range(n), pa.int64()), pa.nulls(n, pa.int64()), pa.nulls(n, pa.string()),
                 pa.nulls(n, pa.string())], schema=schema)
        if bad:
            m = len(bad)
            nulls = [pa.nulls(m, f.type) for f in schema][:5]
            yield pa.RecordBatch.from_arrays(
                [*nulls, pa.array([b[0] for b in bad], pa.string()), pa.nulls(m, pa.int64()),
                 pa.array([b[1] for b in bad], pa.int64()), pa.array([b[2] for b in bad], pa.string()),
                 pa.array([b[3] for b in bad], pa.string())], schema=schema)


@dataclass
class FilesWritten(WriterCommitMessage):
    """What one task wrote: the add actions of its data files (path relative to the table, size, stats)."""

    actions: list[dict[str, Any]]


class FilesSink(DataSource):
    """``df.write.format("millpond_files")`` with options ``table`` (s3://bucket/path), ``manifest`` (an
    object key in the table's bucket), ``partitionBy`` (JSON list) and the store options."""

    @classmethod
    def name(cls) -> str:
        return FILES_FORMAT

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        return FilesWriter({k.lower(): v for k, v in self.options.items()})


class FilesWriter(DataSourceArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.partition_by: list[str] = json.loads(options.get("partitionby", "[]"))

    def write(self, iterator: Iterator[Any]) -> FilesWritten:
        """Runs in an executor: the task's rows as one Parquet file per partition of the table."""
        import pyarrow.parquet as pq

        batches = [b if isinstance(b, pa.RecordBatch) else pa.RecordBatch.from_pandas(b) for b in iterator]
        if not batches:
            return FilesWritten([])
        table = pa.Table.from_batches(batches)
        fs, root = _filesystem(self.options), self.options["table"].removeprefix("s3://").rstrip("/")
        actions = []
        for values, part in _partitions(table, self.partition_by):
            folder = "/".join(f"{k}={v}" for k, v in values.items())
            rel = f"{folder + '/' if folder else ''}part-{uuid.uuid4().hex}.parquet"
            data = part.drop_columns(self.partition_by) if self.partition_by else part
            with fs.open_output_stream(f"{root}/{rel}") as out:
                pq.write_table(data, out)
            size = fs.get_file_info(f"{root}/{rel}").size
            actions.append({"path": rel, "size": size, "partition_values": values,
                            "modification_time": int(time.time() * 1000), "stats": _stats(data)})
        return FilesWritten(actions)

    def commit(self, messages: list[FilesWritten]) -> None:
        """Runs once on the driver side: the job's files, for the batch to commit under its lease."""
        actions = [a for m in messages if m is not None for a in m.actions]
        fs, bucket = _filesystem(self.options), urlparse(self.options["table"]).netloc
        with fs.open_output_stream(f"{bucket}/{self.options['manifest']}") as out:
            out.write(json.dumps(actions).encode())

    def abort(self, messages: list[FilesWritten]) -> None:
        """A failed job leaves no files behind that a later commit could name."""
        fs, root = _filesystem(self.options), self.options["table"].removeprefix("s3://").rstrip("/")
        for m in messages:
            for a in (m.actions if m is not None else []):
                fs.delete_file(f"{root}/{a['path']}")


def _partitions(table: pa.Table, columns: list[str]) -> Iterator[tuple[dict[str, str | None], pa.Table]]:
    if not columns:
        yield {}, table
        return
    groups = table.group_by(columns).aggregate([])
    for row in groups.to_pylist():
        mask = None
        for c in columns:
            cond = pa.compute.is_null(table.column(c)) if row[c] is None else pa.compute.equal(table.column(c), row[c])
            mask = cond if mask is None else pa.compute.and_(mask, cond)
        yield {c: (None if row[c] is None else str(row[c])) for c in columns}, table.filter(mask)


def _stats(table: pa.Table) -> str:
    """Delta file statistics: row and null counts, and min/max of string and integer columns (exact; no
    timestamps, whose text form would round)."""
    import pyarrow.compute as pc

    mins, maxs, nulls = {}, {}, {}
    for f in table.schema:
        col = table.column(f.name)
        nulls[f.name] = col.null_count
        if (pa.types.is_string(f.type) or pa.types.is_integer(f.type)) and col.null_count < len(col):
            mm = pc.min_max(col)
            mins[f.name], maxs[f.name] = mm["min"].as_py(), mm["max"].as_py()
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def register(spark) -> None:
    """Make both sources known to the session (once per client session)."""
    spark.dataSource.register(LandingSource)
    spark.dataSource.register(FilesSink)


def read_landing(spark, settings: Settings, files: list[tuple[str, int]], value_type: str, processing_time: int):
    """The planned files' rows as a DataFrame of ``landing_schema``, read and parsed on executors."""
    return (spark.read.format(LANDING_FORMAT).options(**store_options(settings))
            .option("bucket", settings.bucket_landing).option("files", json.dumps([list(f) for f in files]))
            .option("valueType", value_type).option("processingTime", str(processing_time)).load())


def write_files(df, settings: Settings, table_uri: str, partition_by: list[str] | None = None) -> str:
    """Write ``df`` as data files of the table at ``table_uri`` from the executors; returns the manifest key."""
    manifest = f"{urlparse(table_uri).path.strip('/')}/_millpond_manifests/{uuid.uuid4().hex}.json"
    (df.write.format(FILES_FORMAT).mode("append").options(**store_options(settings)).option("table", table_uri)
     .option("manifest", manifest).option("partitionBy", json.dumps(partition_by or [])).save())
    return manifest
