"""The one module that touches Delta tables (through delta-rs).

Everything else asks for tables by (pipeline, name). A cluster deployment with the Delta jars can
swap this module for one built on delta-spark; the rest of the code does not change.

Idempotency: every write may carry an application transaction ``(app_id, version)``; a write whose
version is not newer than the one already recorded in the table is skipped, so a retried batch
never applies the same commit twice (MillWheel's exactly-once, on the Delta log).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, PostCommitHookProperties, QueryBuilder, write_deltalake
from deltalake.exceptions import TableNotFoundError

from millpond.config import Settings
from millpond.errors import LeaseLost, MillpondError
from millpond.lake.delta_options import (
    TABLE_CONFIG,
    Txn,
    _commit,
    _kept,
    _table_config,
    _wrap,
    _writer_properties,
    storage_options,
)
from millpond.lake.sql import plain_strings, sql_in, sql_str, sql_ts
from millpond.lake.table import EXPIRY_KEY, Table

__all__ = ["TABLE_CONFIG", "Table", "Tables", "Txn", "plain_strings", "sql_in", "sql_str", "sql_ts", "storage_options"]

_SNAPSHOTS: dict[tuple[str, str], dict[str, DeltaTable]] = {}


def forget_pipeline(settings: Settings, pipeline: str) -> None:
    """Drop this process's cached snapshots and rows of a pipeline's tables (after a reset deleted them: a
    cached snapshot would otherwise go on naming files that are gone)."""
    root = settings.table_uri(pipeline, "").rstrip("/") + "/"
    for cache in (_SNAPSHOTS, _PINNED, _FILE_ROWS):
        for entries in cache.values():
            for uri in [u for u in entries if isinstance(u, str) and u.startswith(root)]:
                entries.pop(uri, None)


@dataclass
class _Pinned:
    """One table's snapshot for reads at a numbered version, and the lock its reader holds."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    dt: DeltaTable | None = None


_PINNED: dict[tuple[str, str], dict[str, _Pinned]] = {}
_PINNED_LOCK = threading.Lock()


@dataclass
class _FileRows:
    """The rows of one table's data files as this process last read them, by file path."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    schema: pa.Schema | None = None
    files: dict[str, pa.Table] = field(default_factory=dict)


_FILE_ROWS: dict[tuple[str, str], dict[str, _FileRows]] = {}
_FILE_ROWS_LOCK = threading.Lock()


class Tables:
    """Delta tables of the lake, addressed by pipeline and name."""

    def __init__(self, settings: Settings, auto_checkpoint: bool = True) -> None:
        self.settings = settings
        self.options = storage_options(settings)
        # False: commits never write a checkpoint themselves; the writer calls ``checkpoint`` when it
        # chooses (the micro-batch job spreads them over batches, see ``MicroBatch._maintain``).
        # Nor do they expire the log (the upkeep does, ``expire_log``: delta-rs's would list the log every commit).
        self._hooks = None if auto_checkpoint else PostCommitHookProperties(create_checkpoint=False,
                                                                            cleanup_expired_logs=False)
        # Latest snapshots, shared by every Tables object of this process and refreshed incrementally
        # (only the commits since are read): a batch opens each table several times, and a process that
        # runs many batches (`millpond run`, replay, the bench) would otherwise read each table's
        # checkpoint and log again per batch.
        self._latest = _SNAPSHOTS.setdefault((settings.s3_endpoint, settings.s3_access_key), {})
        # Snapshots for reads at a numbered version (a batch reads its state at the versions its plan
        # pinned), kept apart from the latest ones, which this process's commits move.
        self._pinned = _PINNED.setdefault((settings.s3_endpoint, settings.s3_access_key), {})
        # Rows of the data files that ``read_whole`` has read, shared like the snapshots.
        self._file_rows = _FILE_ROWS.setdefault((settings.s3_endpoint, settings.s3_access_key), {})
        #: tables this object created by writing their first rows (version 0, not opened since)
        self._created: set[str] = set()

    def uri(self, pipeline: str, name: str) -> str:
        return self.settings.table_uri(pipeline, name)

    @property
    def commit_hooks(self) -> PostCommitHookProperties | None:
        """What every commit of this writer passes to delta-rs as its post-commit hooks (``auto_checkpoint``)."""
        return self._hooks

    # -- opening -----------------------------------------------------------------------------
    def table(self, pipeline: str, name: str) -> Table:
        """The noun for one table: ``tables.table(p, "panes").append(rows, txn=txn)``."""
        return Table(self, pipeline, name)

    def open(self, pipeline: str, name: str, version: int | str | None = None) -> DeltaTable | None:
        """The table, or None if it was never created. ``version``: number or ISO timestamp."""
        uri = self.uri(pipeline, name)
        cached = self._latest.get(uri) if version is None else None
        try:
            if cached is not None:
                cached.update_incremental()
                return cached
            dt = DeltaTable(uri, storage_options=self.options, version=version if isinstance(version, int) else None)
        except TableNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, uri, self.settings) from exc
        if isinstance(version, str):
            dt.load_as_version(version)
        if version is None:
            self._latest[uri] = dt
        return dt

    @contextlib.contextmanager
    def _at(self, pipeline: str, name: str, version: int | str | None) -> Iterator[DeltaTable | None]:
        """The table at ``version`` while the block reads it. A numbered version never changes, so one
        snapshot per table serves them all, moved to each version asked for: delta-rs then reads only
        the commits in between, where opening the table anew reads its checkpoint and every commit
        since (a cost that grows until the next checkpoint). The lock holds it still during the read."""
        if not isinstance(version, int):
            yield self.open(pipeline, name, version)
            return
        uri = self.uri(pipeline, name)
        with _PINNED_LOCK:
            pinned = self._pinned.setdefault(uri, _Pinned())
        with pinned.lock:
            if pinned.dt is None:
                pinned.dt = self.open(pipeline, name, version)
            elif pinned.dt.version() != version:
                try:
                    pinned.dt.load_as_version(version)
                except Exception as exc:  # noqa: BLE001
                    pinned.dt = None
                    raise _wrap(exc, uri, self.settings) from exc
            yield pinned.dt

    def exists(self, pipeline: str, name: str) -> bool:
        return self.open(pipeline, name) is not None

    def ensure(
        self, pipeline: str, name: str, schema: pa.Schema, partition_by: Sequence[str] | None = None,
        stats_columns: Sequence[str] | None = None,
    ) -> DeltaTable:
        """Open or create. ``stats_columns`` limits file statistics to the columns readers filter on
        (large JSON columns get none: cheaper commits, and truncated string stats stay out of pruning)."""
        dt = self.open(pipeline, name)
        if dt is not None:
            return dt
        uri = self.uri(pipeline, name)
        try:
            dt = DeltaTable.create(
                uri, schema, mode="ignore", partition_by=list(partition_by) if partition_by else None,
                storage_options=self.options, name=f"{pipeline}.{name}",
                configuration=_table_config(stats_columns, name, self.settings.retention_s),
            )
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, uri, self.settings) from exc
        self._latest[uri] = dt
        return dt

    # -- reading -----------------------------------------------------------------------------
    def read_arrow(
        self,
        pipeline: str,
        name: str,
        *,
        filters: Any = None,
        columns: list[str] | None = None,
        version: int | str | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table:
        """Rows as Arrow; an absent table reads as empty with ``schema`` when given."""
        with self._at(pipeline, name, version) as dt:
            if dt is None:
                if schema is None:
                    raise MillpondError(f"table {pipeline}.{name} does not exist yet")
                return schema.empty_table()
            try:
                return dt.to_pyarrow_dataset().to_table(filter=filters, columns=columns)
            except Exception as exc:  # noqa: BLE001
                raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc

    def read_whole(self, pipeline: str, name: str, schema: pa.Schema) -> pa.Table:
        """Every row of a small, unpartitioned table at its latest version, reading only the data files
        this process has not read before. A Delta data file never changes once written, so its rows can
        be kept by path: an append adds one file to read, a compaction one file (the files it removed
        drop out). For the bookkeeping tables that each batch reads whole: a process that runs many
        batches (`millpond run`, replay, backfill) then reads one new file per table and batch, not a
        number of files that grows until the next compaction. Same rows, in the same order, as
        ``read_arrow``; an absent table reads as empty with ``schema``."""
        uri = self.uri(pipeline, name)
        dt = self.open(pipeline, name)
        if dt is None:
            return schema.empty_table()
        try:
            dataset = dt.to_pyarrow_dataset()
            if dt.metadata().partition_columns:  # a file's partition values are not in its rows
                return dataset.to_table()
            with _FILE_ROWS_LOCK:
                kept = self._file_rows.setdefault(uri, _FileRows())
            with kept.lock:
                if kept.schema is None or not kept.schema.equals(dataset.schema):
                    kept.schema, kept.files = dataset.schema, {}
                files = {}
                for fragment in dataset.get_fragments():
                    rows = kept.files.get(fragment.path)
                    files[fragment.path] = fragment.to_table(schema=dataset.schema) if rows is None else rows
                kept.files = files
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, uri, self.settings) from exc
        return pa.concat_tables(files.values()) if files else dataset.schema.empty_table()

    def select(
        self,
        pipeline: str,
        name: str,
        where: str | None = None,
        *,
        columns: list[str] | None = None,
        version: int | str | None = None,
        schema: pa.Schema | None = None,
    ) -> pa.Table:
        """Rows matching a SQL predicate, through DataFusion (file pruning on Delta statistics).

        Preferred over pyarrow filters: files written by MERGE hold ``string_view`` columns, which
        pyarrow's statistics pruning cannot compare with plain strings.
        """
        cols = ", ".join(f'"{c}"' for c in columns) if columns else "*"
        sql = f"SELECT {cols} FROM t" + (f" WHERE {where}" if where else "")
        with self._at(pipeline, name, version) as dt:
            if dt is None:
                if schema is None:
                    raise MillpondError(f"table {pipeline}.{name} does not exist yet")
                return schema.empty_table() if columns is None else schema.empty_table().select(columns)
            try:
                reader = QueryBuilder().register("t", dt).execute(sql)
                table = pa.RecordBatchReader.from_stream(reader).read_all()
            except Exception as exc:  # noqa: BLE001
                raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc
        return plain_strings(table)

    def read_added(self, pipeline: str, name: str, after: int | None, upto: int | None, schema: pa.Schema
                   ) -> pa.Table:
        """The rows that the data-changing commits after version ``after`` (None: from the table's start)
        up to and including ``upto`` added, through the Delta change feed: only those commits' added
        files are read; a commit that only rewrites files (a compaction, ``dataChange=false``) adds
        nothing. Needs the commits' log entries and added files: kept for the pipeline's retention."""
        if upto is None or (after is not None and upto <= after):
            return schema.empty_table()
        if after is None:  # from the start: the table as of ``upto`` is every row added so far, rewinds applied
            part = self.read_arrow(pipeline, name, version=upto, columns=schema.names)
        else:
            part = self._change_feed(pipeline, name, after + 1, upto, schema)
        return plain_strings(part).select(schema.names).cast(schema)

    def rewinds(self, pipeline: str, name: str, after: int | None, upto: int | None) -> list[int]:
        """The commits after ``after`` (None: from the table's start) up to ``upto`` that took rows away (a
        reprocess's RESTORE, or the DELETE that empties a table rewound to before its first batch), oldest
        first: a reader of the rows that commits added cannot follow those. An expiry (``expire:``,
        ``Table.expire``) is not one: it removes files of rows every reader has added already."""
        if upto is None or (after is not None and upto <= after):
            return []
        start = -1 if after is None else after
        found = [h["version"] for h in self.history(pipeline, name, (self.version(pipeline, name) or upto) - start + 1)
                 if start < h.get("version", -1) <= upto and h.get("operation") in ("RESTORE", "DELETE")
                 and EXPIRY_KEY not in h]
        return sorted(found)

    def _change_feed(self, pipeline: str, name: str, start: int, upto: int, schema: pa.Schema) -> pa.Table:
        """The rows inserted by the commits ``start`` to ``upto`` (both included), from the change feed."""
        dt = self.open(pipeline, name)
        try:
            reader = dt.load_cdf(starting_version=start, ending_version=upto, columns=[*schema.names, "_change_type"])
            table = plain_strings(pa.RecordBatchReader.from_stream(reader).read_all())
        except Exception as exc:  # noqa: BLE001
            if "change data enabled" in str(exc):
                raise MillpondError(
                    f"{pipeline}.{name} was created before stages read it (no change feed): enable it with "
                    f"`millpond reset {pipeline}` and a backfill, which recreate it ({str(exc)[:160]})") from exc
            raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc
        return table.filter(pc.equal(table.column("_change_type"), "insert")).select(schema.names)

    def read_spark(self, spark, pipeline: str, name: str, **kwargs):
        """A Spark DataFrame of the table (read through delta-rs, handed over as Arrow)."""
        return spark.createDataFrame(self.read_arrow(pipeline, name, **kwargs))

    def history(self, pipeline: str, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        dt = self.open(pipeline, name)
        return [] if dt is None else dt.history(limit)

    def version(self, pipeline: str, name: str) -> int | None:
        dt = self.open(pipeline, name)
        return None if dt is None else dt.version()

    def txn_version(self, pipeline: str, name: str, app_id: str) -> int | None:
        dt = self.open(pipeline, name)
        return None if dt is None else dt.transaction_version(app_id)

    # -- writing -----------------------------------------------------------------------------
    def already_applied(self, dt: DeltaTable | None, txn: Txn | None) -> bool:
        """Whether ``txn`` was committed to the table already (a retry skips the write). Every write asks this
        of the snapshot it commits on, so it is also where a fenced writer stops: :class:`LeaseLost` when a
        newer lease holder has committed to the table since (``Txn.fence``)."""
        if dt is None or txn is None:
            return False
        if txn.fence is not None:
            newest = dt.transaction_version(txn.fence[0])
            if newest is not None and newest > txn.fence[1]:
                raise LeaseLost(f"{dt.table_uri}: a newer lease holder (token {newest}) has written here; this "
                                f"writer (token {txn.fence[1]}) is fenced off and stops without writing")
        done = dt.transaction_version(txn.app_id)
        return done is not None and done >= txn.version

    def append(self, pipeline: str, name: str, data: pa.Table, txn: Txn | None = None,
               partition_by: Sequence[str] | None = None, unique: Sequence[str] = ()) -> bool:
        """Append rows; False if ``txn`` was already applied (the retry is skipped). ``unique``: columns
        whose values (nearly) never repeat, written without a dictionary (see ``_writer_properties``)."""
        return self._write(pipeline, name, data, "append", txn, partition_by, unique)

    def overwrite(self, pipeline: str, name: str, data: pa.Table, txn: Txn | None = None) -> bool:
        return self._write(pipeline, name, data, "overwrite", txn, None)

    def _write(self, pipeline: str, name: str, data: pa.Table, mode: str, txn: Txn | None,
               partition_by: Sequence[str] | None, unique: Sequence[str] = ()) -> bool:
        uri = self.uri(pipeline, name)
        dt = self.open(pipeline, name)
        if self.already_applied(dt, txn):
            return False
        try:
            if dt is None:  # the first write creates the table: its version 0 holds these rows
                write_deltalake(uri, data, mode=mode, partition_by=list(partition_by) if partition_by else None,
                                storage_options=self.options, commit_properties=_commit(txn),
                                configuration=_table_config(None, name, self.settings.retention_s),
                                post_commithook_properties=self._hooks,
                                writer_properties=_writer_properties(unique))
                self._created.add(uri)
            else:
                write_deltalake(dt, data, mode=mode, commit_properties=_commit(txn), schema_mode=_evolves(dt, data),
                                post_commithook_properties=self._hooks, writer_properties=_writer_properties(unique))
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, uri, self.settings) from exc
        return True

    def merge(
        self,
        pipeline: str,
        name: str,
        source: pa.Table,
        on: Sequence[str],
        *,
        delete_when: str | None = None,
        txn: Txn | None = None,
        partition_by: Sequence[str] | None = None,
        stats_columns: Sequence[str] | None = None,
        target_filter: str | None = None,
    ) -> dict[str, Any] | None:
        """Upsert ``source`` by the ``on`` columns in one Delta commit.

        Rows matching ``delete_when`` (a predicate over ``s.`` source columns) delete their target
        row instead of updating it. ``target_filter`` (over ``t.`` columns, e.g. the partitions the
        source touches) lets the merge skip the other files. Returns the merge metrics, or None if
        ``txn`` was already applied.
        """
        uri = self.uri(pipeline, name)
        dt = self.open(pipeline, name)
        kept = _kept(source, delete_when)
        if dt is None and kept is not None:
            # Nothing to match yet: the first commit writes the inserted rows (one commit, not a create
            # and a MERGE; the table gets the same schema, partitions and settings).
            try:
                write_deltalake(uri, kept, mode="append", partition_by=list(partition_by) if partition_by else None,
                                storage_options=self.options, name=f"{pipeline}.{name}",
                                configuration=_table_config(stats_columns, name, self.settings.retention_s),
                                commit_properties=_commit(txn), post_commithook_properties=self._hooks)
            except Exception as exc:  # noqa: BLE001
                raise _wrap(exc, uri, self.settings) from exc
            self._created.add(uri)
            return {"num_source_rows": source.num_rows, "num_target_rows_inserted": kept.num_rows,
                    "num_target_rows_updated": 0, "num_target_rows_deleted": 0, "created": True}
        dt = dt or self.ensure(pipeline, name, source.schema, partition_by, stats_columns)
        if self.already_applied(dt, txn):
            return None
        predicate = " AND ".join(([f"({target_filter})"] if target_filter else [])
                                 + [f"t.`{c}` = s.`{c}`" for c in on])
        try:
            merger = dt.merge(source, predicate, source_alias="s", target_alias="t", commit_properties=_commit(txn),
                              post_commithook_properties=self._hooks)
            if delete_when:
                merger = merger.when_matched_delete(predicate=delete_when)
                keep = f"NOT ({delete_when})"
                merger = merger.when_matched_update_all(predicate=keep).when_not_matched_insert_all(predicate=keep)
            else:
                merger = merger.when_matched_update_all().when_not_matched_insert_all()
            return merger.execute()
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, uri, self.settings) from exc

    def known_version(self, pipeline: str, name: str) -> int | None:
        """The version of this process's latest snapshot, without asking the store: exact for a table
        this process has just written (its commits advance the snapshot), stale for any other."""
        uri = self.uri(pipeline, name)
        dt = self._latest.get(uri)
        if dt is None:
            return 0 if uri in self._created else None
        return dt.version()

    def _snapshot(self, pipeline: str, name: str) -> DeltaTable | None:
        """This object's snapshot as of its own last write (no log listing), else the table opened."""
        dt = self._latest.get(self.uri(pipeline, name))
        return dt if dt is not None else self.open(pipeline, name)

    def compact(self, pipeline: str, name: str, over_files: int, target_size: int | None = None) -> bool:
        """Bin-pack a table's small files (below ``target_size`` bytes, default delta-rs's) into as few as
        fit once it has more than ``over_files`` of them (a ``dataChange=false`` commit: readers and time travel
        see the same rows), so that reading, and committing to, a table a batch appends to does not
        grow with the number of batches."""
        dt = self._snapshot(pipeline, name)
        if dt is None or _files_below(dt, target_size) <= over_files:
            return False
        try:
            dt.update_incremental()
            metrics = dt.optimize.compact(target_size=target_size, post_commithook_properties=self._hooks)
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc
        return bool(metrics.get("numFilesRemoved"))  # False: every small file stood alone in its bin

    def replace(self, pipeline: str, name: str, rows: pa.Table, added: pa.Table, base_version: int,
                txn: Txn | None = None, unique: Sequence[str] = ()) -> bool:
        """Replace every file of the table by one file of ``rows``, which were derived from it as of
        ``base_version`` plus ``added``: a compaction that also drops rows (expired dedup ids) in the
        commit that adds the new ones. If the table has moved on since ``base_version`` (other than by a
        vacuum), only ``added`` is appended (nothing is lost; the compaction waits). False if ``txn`` was
        already applied."""
        dt = self.open(pipeline, name)
        if dt is None or dt.version() != base_version and not _same_rows_since(dt, base_version):
            return self.append(pipeline, name, added, txn=txn, unique=unique)
        if self.already_applied(dt, txn):
            return False
        try:
            write_deltalake(dt, rows, mode="overwrite", commit_properties=_commit(txn),
                            post_commithook_properties=self._hooks, writer_properties=_writer_properties(unique))
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc
        return True

    def file_count(self, pipeline: str, name: str, version: int) -> int:
        """How many data files the table has at ``version`` (0 if it does not exist)."""
        with self._at(pipeline, name, version) as dt:
            return 0 if dt is None else len(dt.file_uris())

    def checkpoint(self, pipeline: str, name: str, min_version: int = 0) -> bool:
        """Write a checkpoint at this process's latest snapshot of the table (readers then replay only
        the commits after it); False if the table does not exist or is younger than ``min_version``.
        It may run beside a reader of the same snapshot: delta-rs serializes the calls on one
        DeltaTable (an internal mutex, delta-rs #3101), and a checkpoint does not move its version."""
        dt = self._snapshot(pipeline, name)
        if dt is None or dt.version() < min_version:
            return False
        try:
            dt.create_checkpoint()
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, self.uri(pipeline, name), self.settings) from exc
        return True


#: commits that change neither a table's rows nor its files: the upkeep's (``Tables.vacuum``)
UPKEEP_ONLY = ("VACUUM START", "VACUUM END", "SET TBLPROPERTIES")


def _files_below(dt: DeltaTable, size: int | None) -> int:
    """How many data files the snapshot has (below ``size`` bytes, when given)."""
    if size is None:
        return len(dt.file_uris())
    sizes = pa.table(dt.get_add_actions(flatten=True)).column("size_bytes")
    return int(pc.sum(pc.less(sizes, size)).as_py() or 0)


def _same_rows_since(dt: DeltaTable, version: int) -> bool:
    """Whether every commit after ``version`` left the rows and files as they were (the batch's own upkeep
    step may vacuum the table between the batch's plan and its commits)."""
    later = dt.version() - version
    return later > 0 and all(h.get("operation") in UPKEEP_ONLY for h in dt.history(later))


def _evolves(dt: DeltaTable, data: pa.Table) -> str | None:
    """"merge" when the rows bring columns the table lacks (a contract grew a column: tables written by
    an earlier version take it, their older rows read it as null), else None (the schema must match)."""
    have = {f.name for f in dt.schema().fields}
    return "merge" if any(name not in have for name in data.schema.names) else None
