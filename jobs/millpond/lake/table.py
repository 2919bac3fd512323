"""One Delta table of a pipeline as a noun with typed verbs, in the spirit of delta-rs's own ``DeltaTable``.

``Tables`` keeps the process-wide snapshots and caches; a ``Table`` names one of its tables, so code that
works on a table says ``table.append(rows, txn=txn)`` rather than passing (pipeline, name) each time.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import RemoveAction

from millpond.config import Settings
from millpond.lake.delta_options import Txn, _commit, _wrap, retention_config, retention_seconds
from millpond.lake.objectstore import ObjectStore

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: the commit info key of a time to live's deletion (``Table.expire``)
EXPIRY_KEY = "millpond_expire"


@dataclass(frozen=True)
class Table:
    """``s3://<lake>/<root>/<pipeline>/<name>``: read, append, merge, history, restore; its history kept for a
    retention (vacuum, expire_log)."""

    #: the process's ``millpond.lake.tables.Tables`` (its snapshots and caches)
    tables: Any
    pipeline: str
    name: str

    @property
    def uri(self) -> str:
        return self.tables.uri(self.pipeline, self.name)

    @property
    def key(self) -> str:
        """The table's key prefix in the lake bucket (its uri without ``s3://bucket/``): where its objects are."""
        return self.uri.split("/", 3)[3]

    def exists(self) -> bool:
        return self.tables.exists(self.pipeline, self.name)

    def version(self) -> int | None:
        """The latest committed version, or None while the table does not exist."""
        return self.tables.version(self.pipeline, self.name)

    def read(self, version: int | None = None, columns: Sequence[str] | None = None, filters: Any = None,
             schema: pa.Schema | None = None) -> pa.Table:
        """Rows at ``version`` (default: latest); an absent table reads as empty when ``schema`` is given."""
        return self.tables.read_arrow(self.pipeline, self.name, version=version, columns=columns, filters=filters,
                                      schema=schema)

    def select(self, where: str | None = None, columns: Sequence[str] | None = None, version: int | None = None,
               schema: pa.Schema | None = None) -> pa.Table:
        """Rows matching a SQL predicate over the table (registered as ``t``)."""
        return self.tables.select(self.pipeline, self.name, where, columns=columns, version=version, schema=schema)

    def append(self, rows: pa.Table, txn: Txn | None = None, unique: Sequence[str] = ()) -> bool:
        """Append ``rows`` in one commit; False when ``txn`` was applied already (a retry is skipped)."""
        return self.tables.append(self.pipeline, self.name, rows, txn=txn, unique=unique)

    def merge(self, rows: pa.Table, on: Sequence[str], txn: Txn | None = None, **options: Any) -> bool:
        """Upsert ``rows`` by the key columns ``on`` in one commit (``delete_when`` deletes matches)."""
        return self.tables.merge(self.pipeline, self.name, rows, on=list(on), txn=txn, **options)

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The commits, newest first, as delta-rs reports them (version, timestamp, operation, ...)."""
        return self.tables.history(self.pipeline, self.name, limit)

    def restore(self, version: int, txn: Txn | None = None) -> int | None:
        """Make ``version``'s rows current again as a new commit (history and time travel keep the rest).
        Returns the new version, or None when ``txn`` was applied already. A table still at ``version`` keeps
        its rows (delta-rs refuses to restore a table to its latest version): only ``txn`` is committed, so the
        rewind's fence and its idempotency reach it like the others."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None:
            return None
        if self.tables.already_applied(dt, txn):
            return None
        if dt.version() == version:  # nothing to undo: a commit of the transaction alone (its fence too)
            if txn is not None:
                try:
                    dt.create_write_transaction([], "append", dt.schema(), dt.metadata().partition_columns or None,
                                                commit_properties=_commit(txn),
                                                post_commithook_properties=self.tables.commit_hooks)
                except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
                    raise _wrap(exc, self.uri, self.tables.settings) from exc
            return self.version()
        try:
            dt.restore(version, commit_properties=_commit(txn), post_commithook_properties=self.tables.commit_hooks)
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        return self.version()

    def clear(self, where: str | None = None, txn: Txn | None = None) -> int | None:
        """Delete the rows matching the SQL predicate ``where`` (default: every row) as a new commit; history
        keeps them. Returns the new version, or None when the table does not exist or ``txn`` was applied."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None or self.tables.already_applied(dt, txn):
            return None
        try:
            dt.delete(where, commit_properties=_commit(txn), post_commithook_properties=self.tables.commit_hooks)
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        return self.version()

    def expire(self, column: str, before_us: int, note: dict[str, Any],
               batch_below: int | None = None) -> dict[str, int]:
        """Remove the data files all of whose rows have ``column`` (a timestamp) before ``before_us`` (and, with
        ``batch_below``, ``batch`` below it): a time to live's expiry (``expire:``). By the files' statistics
        alone, so nothing is read or rewritten (no copy for the retention to keep, no change-data file), and a
        file goes once its last row has expired. One commit of removes, whose info carries ``note`` with the
        horizon and the last batch removed under EXPIRY_KEY, so that a reader of the table's changes tells it from
        a rewind (``expiries``). Returns the files and rows removed and that last batch (0: none)."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None:
            return {"files": 0, "rows": 0, "last_batch": 0}
        # statistics keep timestamps to the millisecond, rounded down: a file whose maximum is in H's millisecond
        # may hold a row at or after H, so it waits
        files = [a for a in pa.table(dt.get_add_actions(flatten=True)).to_pylist()
                 if _ts_us(a.get(f"max.{column}")) is not None and _ts_us(a[f"max.{column}"]) + 1000 <= before_us
                 and (batch_below is None or (a.get("max.batch") is not None and a["max.batch"] < batch_below))]
        out = {"files": len(files), "rows": sum(a.get("num_records") or 0 for a in files),
               "last_batch": max((a.get("max.batch") or 0 for a in files), default=0)}
        if not files:
            return out
        now = int(time.time() * 1000)
        gone = [RemoveAction(a["path"], True, now, a["size_bytes"],
                             {k[len("partition."):]: None if v is None else str(v)
                              for k, v in a.items() if k.startswith("partition.")}) for a in files]
        info = {**note, "horizon": before_us, "last_batch": out["last_batch"]}
        try:
            dt.create_write_transaction(gone, "append", dt.schema(), dt.metadata().partition_columns or None,
                                        commit_properties=CommitProperties(
                                            custom_metadata={EXPIRY_KEY: json.dumps(info, sort_keys=True)}),
                                        post_commithook_properties=self.tables.commit_hooks)
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        self.tables.open(self.pipeline, self.name)  # this process's snapshot moves forward
        return out

    def bytes_per_span(self, column: str, span_us: int) -> int | None:
        """About how many bytes of the table's files hold rows whose ``column`` (a timestamp) falls in ``span_us``:
        the live files' bytes over the range their statistics give the column (at least ``span_us``); None for a
        table with no such statistics. Sizes a compaction that must not mix rows of different expiries."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None:
            return None
        actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
        lows = [_ts_us(a.get(f"min.{column}")) for a in actions]
        highs = [_ts_us(a.get(f"max.{column}")) for a in actions]
        if not actions or None in lows or None in highs:
            return None
        size = sum(a["size_bytes"] for a in actions)
        return size * span_us // max(span_us, max(highs) - min(lows))

    def expiries(self, after: int | None, upto: int | None) -> list[dict[str, Any]]:
        """The notes of the expiry commits after version ``after`` up to ``upto`` (with their ``version``), oldest
        first."""
        if upto is None or (after is not None and upto <= after):
            return []
        start = -1 if after is None else after
        found = [{**json.loads(h[EXPIRY_KEY]), "version": h["version"]}
                 for h in self.history((self.version() or upto) - start + 1)
                 if start < h.get("version", -1) <= upto and EXPIRY_KEY in h]
        return sorted(found, key=lambda e: e["version"])

    # -- retention: what of the table's history is kept (``runtime.upkeep`` keeps it) ------------------------
    def commit_times(self, after: int | None = None, upto: int | None = None) -> dict[int, float]:
        """{version: when it was committed} (epoch seconds: its log entry's time in the store, to the second)
        for the commits the log keeps, after ``after`` and up to ``upto`` when given: one listing of the log."""
        return {v: o.last_modified for v, kind, o in self._log(after, upto) if kind == "json"}

    def _log(self, after: int | None = None, upto: int | None = None) -> list[tuple[int, str, Any]]:
        """The log's entries (version, "json" or "checkpoint", the stored object) after ``after``'s commit and up
        to ``upto``."""
        prefix = self.key + "/_delta_log/"
        start = None if after is None else f"{prefix}{after:020d}.json"
        stop = None if upto is None else f"{prefix}{upto + 1:020d}"
        settings = self.tables.settings
        out = []
        for o in log_store(settings).list(settings.bucket_lake, prefix, start_after=start, stop_at=stop):
            m = _LOG_ENTRY.fullmatch(o.key[len(prefix):])
            if m:
                out.append((int(m.group(1)), "json" if m.group(2) == "json" else "checkpoint", o))
        return out

    def replaced_at(self, version: int) -> float | None:
        """When ``version`` stopped being the table's latest (the next commit's time; 0.0 when the log no longer
        keeps that commit); None while it is the latest. A version stays readable while it was the latest within
        the table's retention: ``vacuum`` keeps its files and ``expire_log`` its log entries."""
        found = self.commit_times(after=version, upto=version + 1)
        if version + 1 in found:
            return found[version + 1]
        latest = self.version()
        return None if latest is None or latest <= version else 0.0

    def retention(self) -> float | None:
        """The retention (seconds) the table's properties record (None: none, or no table)."""
        dt = self.tables.open(self.pipeline, self.name)
        return None if dt is None else retention_seconds(dt.metadata().configuration)

    def vacuum(self, retention_s: float, writes_since: float | None = None) -> int:
        """Delete the data files that no version within ``retention_s`` needs: the files that versions replaced
        more than ``retention_s`` ago (delta-rs's vacuum), so every version that was the table's latest at any
        time since keeps its files. Returns how many went. The retention is first recorded in the table's
        properties (a commit, when they differ), which the vacuum reads to the second (its ``retention_hours``
        would round to hours), and with which the log expires (``expire_log``).

        A full vacuum when it is safe: also the files no commit names that are older than the retention (a killed
        write's, and those whose removal a checkpoint forgot: a checkpoint drops the removes older than the
        retention, so one written just after a vacuum strands the files that came due in between). Safe from an
        hour on, or when no file being written can be older than the retention: ``writes_since``, the time from
        which the pipeline's batch writes its files (its lease keeps other batches out), less IN_FLIGHT_MARGIN_S
        for a write outside a batch (an operator's command: seconds). Otherwise (tests' retentions of seconds),
        only the files commits removed."""
        dt = self.tables.open(self.pipeline, self.name)
        if dt is None:
            return 0
        hooks = self.tables.commit_hooks  # the writer's: no checkpoint, no log expiry of delta-rs's own
        try:
            wanted = retention_config(retention_s)
            if any(dt.metadata().configuration.get(k) != v for k, v in wanted.items()):
                dt.alter.set_table_properties(wanted, raise_if_not_exists=False, post_commithook_properties=hooks)
            deleted = dt.vacuum(retention_hours=None, dry_run=False, enforce_retention_duration=False,
                                full=_full_vacuum_safe(retention_s, writes_since), post_commithook_properties=hooks)
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        if dt.metadata().configuration.get("delta.enableChangeDataFeed") == "true":
            return len(deleted) + self._vacuum_change_data(retention_s)
        return len(deleted)

    def discard(self, paths: Sequence[str]) -> int:
        """Delete data files written for a commit that will not happen (a batch its validation stopped after
        executors wrote its files): they go now, not at a full vacuum a retention later. ``paths`` as in the add
        actions (relative, URL-encoded); files a commit names must never be given."""
        from urllib.parse import unquote

        settings = self.tables.settings
        keys = [f"{self.key}/{unquote(p)}" for p in paths]
        return log_store(settings).delete_keys(settings.bucket_lake, keys) if keys else 0

    def _vacuum_change_data(self, retention_s: float) -> int:
        """Delete the change-data files (``_change_data/``: a DELETE's on a table with the change feed, e.g. a
        rewind's) written longer than ``retention_s`` ago, which delta-rs's vacuum leaves: only a read of the
        change feed over the commit that wrote one needs it, and such a read reaches back a retention at most."""
        settings = self.tables.settings
        store = log_store(settings)
        cutoff = time.time() - retention_s - 1
        old = [o.key for o in store.list(settings.bucket_lake, self.key + "/_change_data/")
               if o.last_modified < cutoff]
        return store.delete_keys(settings.bucket_lake, old) if old else 0

    def expire_log(self, retention_s: float, now: float | None = None) -> int:
        """Delete the log entries no version within ``retention_s`` needs: those before the last checkpoint at
        or before the version that was the table's latest ``retention_s`` ago, so that version and every later
        one stay loadable (delta-rs's ``cleanup_metadata`` on that version: its own expiry after a commit
        deletes up to the latest checkpoint, stranding versions still within retention). Needs the table's
        ``delta.logRetentionDuration`` at that version to be at most ``retention_s`` (``vacuum`` sets it);
        until then it deletes less. Returns how many commits' entries went."""
        now = time.time() if now is None else now
        log = self._log()
        then = max((v for v, kind, o in log if kind == "json" and o.last_modified <= now - retention_s - 1),
                   default=None)
        since = max((v for v, kind, _ in log if kind == "checkpoint" and then is not None and v <= then), default=None)
        if since is None or not any(v < since for v, _, _ in log):
            return 0
        try:
            DeltaTable(self.uri, storage_options=self.tables.options, version=then).cleanup_metadata()
        except Exception as exc:  # noqa: BLE001 - delta-rs errors become one line
            raise _wrap(exc, self.uri, self.tables.settings) from exc
        expired = {v for v, kind, _ in log if kind == "json" and v < since}
        return len(expired - {v for v, kind, _ in self._log(upto=since - 1) if kind == "json"})


#: how long a write outside a batch (an operator's command, delta-rs writing and committing) keeps a data file
#: uncommitted, at most: a full vacuum leaves the files younger than the retention, so it must be longer
IN_FLIGHT_MARGIN_S = 10.0


def _full_vacuum_safe(retention_s: float, writes_since: float | None) -> bool:
    """Whether no data file still being written can be older than ``retention_s`` (``Table.vacuum``)."""
    if retention_s >= 3600:
        return True
    return writes_since is not None and retention_s >= time.time() - writes_since + IN_FLIGHT_MARGIN_S


#: an entry of a table's log: a commit (``00000000000000000012.json``) or a checkpoint (``...12.checkpoint.parquet``)
_LOG_ENTRY = re.compile(r"(\d{20})\.(json|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)")


def _ts_us(value: Any) -> int | None:
    """A statistic's timestamp (datetime, or None) in microseconds since the epoch; None if it is not one."""
    if not isinstance(value, datetime):
        return None
    return (value - _EPOCH) // timedelta(microseconds=1)


@functools.lru_cache(maxsize=8)
def log_store(settings: Settings) -> ObjectStore:
    """The object store the tables' logs are listed in (one client per deployment and process)."""
    return ObjectStore(settings)
