"""A Spark Python Data Source over the lake's Delta tables, read through delta-rs.

Spark here has neither the Delta jars nor hadoop-aws, so ``spark.read.format("delta")`` cannot work.
This source plans on the driver with delta-rs (the snapshot's data files, with time travel) and
reads each file in a Python worker with pyarrow, yielding Arrow record batches:

    register(spark, settings)
    df = spark.read.format("millpond").option("table", "video_sessions.panes").option("versionAsOf", 3).load()

Without ``versionAsOf``/``timestampAsOf`` a table is read at the version its pipeline's last committed batch
names (the ``batches`` marker: never half a batch), or at its latest for a table the marker does not name.

Credentials travel as options (``accessKey``/``secretKey``: names Spark redacts from plans) taken
from :class:`~millpond.config.Settings`; without them the source loads the settings itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from millpond.config import Settings
from millpond.lake.snapshot_files import Storage, data_files, read_file, table_schema

FORMAT = "millpond"


def settings_options(settings: Settings) -> dict[str, str]:
    """The options that let a worker reach the object store (from settings, never hard-coded)."""
    return {
        "endpoint": settings.s3_endpoint,
        "region": settings.s3_region,
        "accessKey": settings.s3_access_key,
        "secretKey": settings.s3_secret_key,
        "bucket": settings.bucket_lake,
        "tableRoot": settings.table_root,
    }


class FilePartition(InputPartition):
    """One data file of the snapshot, with the partition values Delta keeps out of the file."""

    def __init__(self, index: int, path: str | None, partition_values: dict[str, Any]) -> None:
        super().__init__(index)
        self.path = path
        self.partition_values = partition_values


def _options_settings(options: dict[str, str]) -> Settings:
    from millpond.config import load_settings

    base = load_settings()
    changes = {k: options[o] for k, o in (
        ("s3_endpoint", "endpoint"), ("s3_region", "region"), ("s3_access_key", "accesskey"),
        ("s3_secret_key", "secretkey"), ("bucket_lake", "bucket"), ("table_root", "tableroot"),
    ) if options.get(o)}
    return base.with_overrides(**changes)


class MillpondDataSource(DataSource):
    """``spark.read.format("millpond").option("table", "pipeline.name")``; options ``versionAsOf``,
    ``timestampAsOf`` (without either: as of the pipeline's last committed batch); S3 options ``endpoint``,
    ``region``, ``accessKey``, ``secretKey``, ``bucket``, ``tableRoot`` (default: the process's Millpond
    settings)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def _lookup(self) -> tuple[Settings, Any, bool]:
        """The delta-rs snapshot the options name, and whether it reads as empty (a table the last marker
        names as not created yet: only a batch not committed has written it).

        Only the resolved version is kept on ``self`` (the source is pickled between planning steps
        and a DeltaTable is not), so ``timestampAsOf`` and the marker resolve once and schema and files agree.
        """
        from millpond.errors import MillpondError
        from millpond.lake.tables import Tables
        from millpond.model.timeutil import to_datetime, to_us

        opts = {k.lower(): v for k, v in self.options.items()}
        table = opts.get("table") or opts.get("path")
        if not table or "." not in table:
            raise MillpondError('the millpond source needs .option("table", "pipeline.name")')
        pipeline, _, name = table.partition(".")
        settings = _options_settings(opts)
        tables = Tables(settings)
        version = getattr(self, "_version", None)
        empty = getattr(self, "_empty", False)
        stamp = opts.get("timestampasof")
        if version is None and opts.get("versionasof") not in (None, ""):
            version = int(opts["versionasof"])
        elif version is None and not stamp:  # no time travel asked for: as of the last committed batch
            from millpond.lake.catalog import committed_versions

            committed = committed_versions(tables, pipeline)
            version, empty = committed.get(name), name in committed and committed[name] is None
        dt = tables.open(pipeline, name, version)
        if dt is None:
            raise MillpondError(f"unknown table {table}")
        if stamp and version is None:
            from millpond.lake.catalog import version_at

            at = version_at(dt, to_datetime(to_us(stamp)))
            if at is None:
                raise MillpondError(f"{table}: the table did not exist yet at {stamp}")
            dt = tables.open(pipeline, name, at)
        self._version, self._empty = dt.version(), empty
        return settings, dt, empty

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        _settings, dt, _empty = self._lookup()
        return from_arrow_schema(table_schema(dt), prefer_timestamp_ntz=False)

    def reader(self, schema: StructType) -> DataSourceReader:
        settings, dt, empty = self._lookup()
        return MillpondReader(settings, dt, empty)


class MillpondReader(DataSourceReader):
    """Plans on the driver (file list of the snapshot); reads one file per Spark partition."""

    def __init__(self, settings: Settings, dt, empty: bool = False) -> None:
        self.schema = table_schema(dt)
        self.files = [] if empty else data_files(dt)
        self.storage = Storage.of(settings)

    def partitions(self) -> list[InputPartition]:
        if not self.files:  # an empty snapshot still needs one (empty) partition
            return [FilePartition(0, None, {})]
        return [FilePartition(i, uri, parts) for i, (uri, parts) in enumerate(self.files)]

    def read(self, partition: FilePartition) -> Iterator[pa.RecordBatch]:
        if partition.path is None:
            return
        filesystem, path = self.storage.filesystem(partition.path)
        yield from read_file(filesystem, path, self.schema, partition.partition_values)


def register(spark, settings: Settings | None = None, pipelines: list[str] | None = None) -> dict[str, str]:
    """Register the source with ``spark``; with ``pipelines``, also one temp view per table.

    Views are named ``<pipeline>_<table>`` (Spark temp views are single-part names); returns
    {view name: "pipeline.table"}. A pipeline's views read the versions of one marker, its last committed.
    """
    spark.dataSource.register(MillpondDataSource)
    views: dict[str, str] = {}
    if not pipelines:
        return views
    from millpond.lake.catalog import committed_versions, lake_tables
    from millpond.lake.tables import Tables

    if settings is None:
        from millpond.config import load_settings

        settings = load_settings()
    for pipeline in pipelines:
        committed = committed_versions(Tables(settings), pipeline)
        for table in lake_tables(settings, pipeline):
            view = f"{pipeline}_{table}"
            read(spark, f"{pipeline}.{table}", settings, version=committed.get(table)).createOrReplaceTempView(view)
            views[view] = f"{pipeline}.{table}"
    return views


def read(spark, table: str, settings: Settings | None = None, *, version: int | None = None,
         timestamp: str | None = None):
    """A DataFrame of ``pipeline.table`` (optionally at a version or time) through this source."""
    reader = spark.read.format(FORMAT).option("table", table)
    if settings is not None:
        reader = reader.options(**settings_options(settings))
    if version is not None:
        reader = reader.option("versionAsOf", str(version))
    if timestamp is not None:
        reader = reader.option("timestampAsOf", str(timestamp))
    return reader.load()
