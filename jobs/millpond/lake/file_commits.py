"""Commit data files written elsewhere (by Spark's executors) to a Delta table: one commit per table, carrying
the batch's application transaction, optionally removing the files the new ones replace (copy-on-write)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pyarrow as pa
from deltalake.transaction import AddAction, RemoveAction

from millpond.lake.delta_options import Txn, _commit, _wrap
from millpond.lake.tables import Tables


def commit_files(tables: Tables, pipeline: str, name: str, files: Sequence[dict], schema: pa.Schema, txn: Txn | None,
                 partition_by: Sequence[str] | None = None, removes: Sequence[dict] = (),
                 stats_columns: Sequence[str] | None = None) -> bool:
    """Add ``files`` (add actions of data files executors wrote, see ``lake.spark_io``) and remove ``removes``
    (add actions of files being replaced) in one commit; False when ``txn`` was applied already (a retried
    batch commits nothing twice)."""
    dt = tables.open(pipeline, name)
    if tables.already_applied(dt, txn):
        return False
    adds = [AddAction(a["path"], a["size"], a["partition_values"], a["modification_time"], True, a["stats"])
            for a in files]
    now = int(time.time() * 1000)
    gone = [RemoveAction(r["path"], True, now, r.get("size"), r.get("partition_values")) for r in removes]
    if not adds and not gone:
        if dt is None:  # as the local engine's MERGE of nothing (a batch closing every window it opened): the
            # table exists after the batch, empty, and the marker names its version
            tables.ensure(pipeline, name, schema, partition_by=partition_by, stats_columns=stats_columns)
        return False
    dt = dt or tables.ensure(pipeline, name, schema, partition_by=partition_by, stats_columns=stats_columns)
    try:
        dt.create_write_transaction([*adds, *gone], "append", schema, list(partition_by) if partition_by else None,
                                    commit_properties=_commit(txn), post_commithook_properties=tables.commit_hooks)
    except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
        raise _wrap(exc, tables.uri(pipeline, name), tables.settings) from exc
    tables.open(pipeline, name)  # moves this process's snapshot forward (the marker reads its version)
    return True


def live_files(tables: Tables, pipeline: str, name: str, version: int | None) -> list[dict]:
    """The data files of a snapshot, as the add actions a replacement removes (path, size, partitions)."""
    if version is None:
        return []
    dt = tables.open(pipeline, name, version)
    if dt is None:
        return []
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    return [{"path": a["path"], "size": a["size_bytes"],
             "partition_values": {k[len("partition."):]: (None if v is None else str(v))
                                  for k, v in a.items() if k.startswith("partition.")}}
            for a in actions]
