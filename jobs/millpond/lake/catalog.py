"""What the lake holds: its pipelines and tables, a table's snapshot as of a version or a time (by default,
as of the pipeline's last committed batch), and SQL over snapshots (DataFusion through delta-rs). The query
surface and the Spark data source ask here; they never open Delta themselves."""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.objectstore import ObjectStore, translate
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.lake.tables import Tables
from millpond.model.timeutil import to_us


def _subfolders(settings: Settings, prefix: str) -> list[str]:
    """Immediate 'folders' under ``prefix`` in the lake bucket (a delimiter listing, not a scan)."""
    store = ObjectStore(settings)
    try:
        objects = list(store.mc.list_objects(settings.bucket_lake, prefix=prefix, recursive=False))
    except Exception as exc:  # noqa: BLE001 - every SDK failure is translated
        raise translate(exc, settings, settings.bucket_lake) from exc
    return sorted(o.object_name[len(prefix):].strip("/") for o in objects if o.is_dir)


def _holds_objects(settings: Settings, prefix: str) -> bool:
    """Whether anything is stored under ``prefix`` (some stores keep emptied folders around)."""
    try:
        return next(iter(ObjectStore(settings).mc.list_objects(settings.bucket_lake, prefix=prefix, recursive=True)),
                    None) is not None
    except Exception as exc:  # noqa: BLE001 - every SDK failure is translated
        raise translate(exc, settings, settings.bucket_lake) from exc


def lake_pipelines(settings: Settings) -> list[str]:
    """Pipelines that have at least one table in the lake."""
    return [p for p in _subfolders(settings, f"{settings.table_root.strip('/')}/") if lake_tables(settings, p)]


def lake_tables(settings: Settings, pipeline: str) -> list[str]:
    """Tables of one pipeline in the lake (folders holding a non-empty ``_delta_log``)."""
    root = f"{settings.table_root.strip('/')}/{pipeline}/"
    return [t for t in _subfolders(settings, root) if "_delta_log" in _subfolders(settings, f"{root}{t}/")
            and _holds_objects(settings, f"{root}{t}/_delta_log/")]


def version_at(dt: DeltaTable, when: datetime) -> int | None:
    """The newest version committed at or before ``when``, by the commits' own timestamps.

    delta-rs resolves timestamps by the log files' modification times, which SeaweedFS keeps to
    the second: commits within one second were indistinguishable. The commit timestamps (ms, the
    ones ``history`` shows) are exact.
    """
    limit_ms = to_us(when) // 1000
    found = [int(h["version"]) for h in dt.history() if int(h.get("timestamp", 0)) <= limit_ms]
    return max(found) if found else None


def open_snapshot(tables: Tables, pipeline: str, name: str, version: int | None = None,
                  timestamp: datetime | None = None, label: str = "") -> DeltaTable:
    """The snapshot of ``pipeline.name`` at a version or a time, or a one-line error naming the tables that exist."""
    dt = tables.open(pipeline, name, version)
    if dt is None:
        have = lake_tables(tables.settings, pipeline)
        hint = (f"tables of {pipeline}: {', '.join(have)}" if have
                else f"pipelines with tables: {', '.join(lake_pipelines(tables.settings)) or 'none yet'}")
        raise MillpondError(f"unknown table {pipeline}.{name} ({hint})")
    if timestamp is not None:
        at = version_at(dt, timestamp)
        if at is None:
            raise MillpondError(f"{label or pipeline + '.' + name}: the table did not exist yet at that time")
        dt = tables.open(pipeline, name, at)
    return dt


def committed_versions(tables: Tables, pipeline: str) -> dict[str, int | None]:
    """The table versions the pipeline's last committed batch names (its ``batches`` row, the commit marker,
    written after every other commit of the batch): read at these, a reader never sees half a batch. A table
    named with None did not exist yet. Empty for a pipeline without a marker."""
    done = tables.read_arrow(pipeline, "batches", schema=BATCHES_SCHEMA, columns=["batch", "versions"])
    if not done.num_rows:
        return {}
    last = max(done.to_pylist(), key=lambda r: r["batch"])
    return json.loads(last["versions"] or "{}")


def open_committed(tables: Tables, pipeline: str, name: str, committed: dict[str, int | None],
                   label: str = "") -> tuple[DeltaTable, bool]:
    """A reader's default snapshot of ``pipeline.name``: at the version ``committed`` (``committed_versions``)
    names, latest for a table it does not name (``batches`` itself, ``operations``, a table of a pipeline
    without a marker). Also whether it reads as empty: the marker names the table as not created yet, so all
    it holds is from a batch not committed (the snapshot is the latest, for its columns)."""
    version = committed.get(name)
    dt = open_snapshot(tables, pipeline, name, version, label=label)
    return dt, name in committed and version is None


def execute_sql(snapshots: dict[str, DeltaTable], sql: str, empty: Collection[str] = ()) -> pa.Table:
    """Run ``sql`` with each snapshot registered under its (quoted) name; the names in ``empty`` read as no
    rows with the snapshot's columns. Errors become one line."""
    builder = QueryBuilder()
    try:
        for name, dt in snapshots.items():
            if name in empty:
                hidden = '"' + name.strip('"') + ' (uncommitted)"'
                builder = builder.register(hidden, dt)
                builder.execute(f"CREATE VIEW {name} AS SELECT * FROM {hidden} WHERE false").read_all()
            else:
                builder = builder.register(name, dt)
        return pa.table(builder.execute(sql).read_all())
    except Exception as exc:  # noqa: BLE001 - DataFusion/delta-rs errors become one line
        msg = " ".join(str(exc).split())
        raise MillpondError(f"query failed: {msg[:400]}") from exc


def drop_pipeline(settings: Settings, pipeline: str) -> int:
    """Delete every table of ``pipeline`` and its lease; refused while a batch of it holds a live lease.
    Returns the number of objects deleted."""
    from millpond.lake.lease import Lease

    lease = Lease.acquire(settings, pipeline, owner=f"reset-{pipeline}")  # raises LeaseLost while a batch runs
    lease.release()
    from millpond.lake.tables import forget_pipeline

    deleted = ObjectStore(settings).delete_prefix(settings.bucket_lake, f"{settings.table_root.strip('/')}/{pipeline}/")
    forget_pipeline(settings, pipeline)
    return deleted
