"""A Delta snapshot as the Parquet files behind it, read with pyarrow: what both Spark readers of the lake share
(the ad-hoc data source in ``lake.sparksource`` and the engine's executor reads in ``lake.spark_io``).

The driver (or client) lists a version's add actions with delta-rs; each file is then read anywhere pyarrow
reaches the store, its batches conformed to the table's schema (partition values filled in, columns added
later null). Only plain snapshots are readable this way: deletion vectors and column mapping change what a
file's rows mean, so they fail clearly instead of reading wrong rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa

BATCH_ROWS = 65_536
#: reader features that make a data file's rows differ from the table's rows
UNSUPPORTED = ("deletionVectors", "columnMapping")


@dataclass(frozen=True)
class Storage:
    """What a reader needs to reach the store (from settings; plain values so it pickles to executors)."""

    endpoint: str
    region: str
    access_key: str
    secret_key: str
    timeout: float

    @classmethod
    def of(cls, settings: Any) -> Storage:
        return cls(settings.s3_endpoint, settings.s3_region, settings.s3_access_key, settings.s3_secret_key,
                   settings.store_timeout_s)

    def filesystem(self, uri: str):
        """(pyarrow filesystem, path in it) for a file's URI (s3 through ``lake.waits``; local otherwise)."""
        from pyarrow import fs

        from millpond.lake.waits import s3_filesystem

        parsed = urlparse(uri)
        if parsed.scheme in ("s3", "s3a"):
            return (s3_filesystem(self.endpoint, self.access_key, self.secret_key, self.region, self.timeout),
                    f"{parsed.netloc}{parsed.path}")
        if parsed.scheme == "file":
            return fs.LocalFileSystem(), parsed.path
        return fs.LocalFileSystem(), uri


def table_schema(dt) -> pa.Schema:
    return pa.schema(dt.schema().to_arrow())


def data_files(dt) -> list[tuple[str, dict[str, Any]]]:
    """The snapshot's data files: (URI, partition values as typed by delta-rs); fails on unsupported features."""
    from millpond.errors import MillpondError

    features = set(dt.protocol().reader_features or [])
    if features & set(UNSUPPORTED):
        raise MillpondError(f"{dt.table_uri}: uses {sorted(features & set(UNSUPPORTED))}, which the Spark "
                            "readers of the lake do not support (they read data files as they are)")
    by_name = {u.rsplit("/", 1)[-1]: u for u in dt.file_uris()}
    files = []
    for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
        uri = by_name.get(str(a["path"]).rsplit("/", 1)[-1], a["path"])
        files.append((uri, {k[len("partition."):]: v for k, v in a.items() if k.startswith("partition.")}))
    return files


def read_file(filesystem, path: str, schema: pa.Schema, partition_values: dict[str, Any]) -> Iterator[pa.RecordBatch]:
    """One data file's rows in ``schema``'s columns and types."""
    import pyarrow.parquet as pq

    with filesystem.open_input_file(path) as handle:
        pf = pq.ParquetFile(handle)
        present = set(pf.schema_arrow.names)
        wanted = [n for n in schema.names if n in present]
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
            yield conform(batch, schema, partition_values)


def conform(batch: pa.RecordBatch, schema: pa.Schema, partition_values: dict[str, Any]) -> pa.RecordBatch:
    """Columns in table order and types: partition values filled in, columns added later null."""
    arrays = []
    for f in schema:
        if f.name in batch.schema.names:
            col = batch.column(f.name)
            arrays.append(col if col.type == f.type else col.cast(f.type))
        elif f.name in partition_values:
            arrays.append(pa.array([partition_values[f.name]] * batch.num_rows).cast(f.type))
        else:
            arrays.append(pa.nulls(batch.num_rows, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
