"""How this project talks to delta-rs: storage options, commit properties carrying application
transactions, writer and table properties, and delta-rs errors turned into one line that says what to do."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import ColumnProperties, CommitProperties, Transaction, WriterProperties

from millpond.config import Settings
from millpond.errors import MillpondError, StoreUnreachable
from millpond.lake.waits import ATTEMPTS, StoreWait, not_answering, timed_out

#: Checkpoint every 10 commits: opening a table replays at most 10 JSON commits, however long its history.
#: No log expiry after each commit: delta-rs's would list the whole log every commit and expire entries that a
#: version still within retention needs (the upkeep expires the log instead, ``Tables.expire_log``).
TABLE_CONFIG = {"delta.checkpointInterval": "10", "delta.enableExpiredLogCleanup": "false"}
#: how long a "Generic S3 error" waits for a stopping store's endpoint to close (``_endpoint_down``)
ENDPOINT_SETTLE_S = 3.0
#: tables created with the Delta change feed enabled: a stage reads the rows each commit of its upstream's
#: ``panes`` added (``Tables.read_added``); an append-only table writes no change files for it
CHANGE_FEED_TABLES = ("panes",)
CHANGE_FEED = {"delta.enableChangeDataFeed": "true"}


@dataclass(frozen=True)
class Txn:
    """An application transaction: (app_id, version) recorded in the Delta log with the commit."""

    app_id: str
    version: int
    #: the writer's fence, ``(fence_app(pipeline), lease token)``: recorded with the commit too, so the Delta
    #: log itself fences a zombie writer. A table whose fence is newer refuses the write
    #: (``Tables.already_applied``), and one that a newer holder commits to between the writer's snapshot and
    #: its commit fails the commit (delta-rs's conflict check: a concurrent commit carries the same app id)
    fence: tuple[str, int] | None = None


def fence_app(pipeline: str) -> str:
    """The application id that fences a pipeline's writers: its version is the writing lease's token."""
    return f"millpond/{pipeline}/fence"


def storage_options(settings: Settings) -> dict[str, str]:
    """delta-rs's options: the store, and waits bounded by ``object_store.timeout`` (``lake.waits``):
    ``timeout`` is one request's whole time, ``retry_timeout`` stops retrying once that much has passed."""
    wait = StoreWait.of(settings)
    return {
        "AWS_ENDPOINT_URL": settings.s3_endpoint,
        "AWS_ACCESS_KEY_ID": settings.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": settings.s3_secret_key,
        "AWS_REGION": settings.s3_region,
        "AWS_ALLOW_HTTP": "true" if settings.s3_endpoint.startswith("http://") else "false",
        "AWS_S3_ALLOW_UNSAFE_RENAME": "false",
        "conditional_put": "etag",
        "timeout": f"{wait.attempt:.3f}s",
        "connect_timeout": f"{wait.connect:.3f}s",
        "max_retries": str(ATTEMPTS - 1),
        "retry_timeout": f"{wait.attempt:.3f}s",
    }


def _writer_properties(unique: Sequence[str]) -> WriterProperties | None:
    """No dictionary for columns of (nearly) unique values, e.g. record ids: the writer would build one,
    find it as large as the column and fall back to plain encoding. Measured on 100k ids: the write took
    half the time."""
    if not unique:
        return None
    return WriterProperties(column_properties={c: ColumnProperties(dictionary_enabled=False) for c in unique})


def _commit(txn: Txn | None) -> CommitProperties | None:
    if txn is None:
        return None
    actions = [Transaction(app_id=txn.app_id, version=txn.version)]
    if txn.fence is not None:
        actions.append(Transaction(app_id=txn.fence[0], version=txn.fence[1]))
    return CommitProperties(app_transactions=actions)


def _endpoint_down(endpoint: str | None, settle_s: float = ENDPOINT_SETTLE_S) -> bool:
    """True if nothing accepts connections at the store's endpoint (a request cut mid-way by a store
    that stopped surfaces from delta-rs as a bare "Generic S3 error"). A store caught stopping still
    accepts for a moment (a commit of another table failed while it shut down), so the endpoint is
    asked again for ``settle_s`` before the error is called the store's own."""
    import socket
    from urllib.parse import urlparse

    if not endpoint:
        return False
    url = urlparse(endpoint)
    deadline = time.monotonic() + settle_s
    while True:
        try:
            with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                          timeout=1):
                pass
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _wrap(exc: Exception, uri: str, settings: Settings | None = None) -> MillpondError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = text.lower()
    endpoint = settings.s3_endpoint if settings is not None else None
    if settings is not None and timed_out(exc):
        return not_answering(settings, uri)
    if ("connect" in lowered or "dns" in lowered or "timed out" in lowered or "error sending request" in lowered
            or ("generic s3 error" in lowered and _endpoint_down(endpoint))):
        return StoreUnreachable(f"object store unreachable at {endpoint or 'its endpoint'} while accessing {uri}: "
                                f"start it with `make up` ({text[:160]})")
    if "invalidaccesskeyid" in lowered or "signaturedoesnotmatch" in lowered or "403" in lowered:
        return MillpondError(f"object store refused the credentials for {uri}: check MILLPOND_S3_ACCESS_KEY/SECRET_KEY")
    if "concurrent" in lowered or "conflict" in lowered or "version already exists" in lowered:
        return MillpondError(f"concurrent commit to {uri}: another run of this pipeline committed first ({text[:160]})")
    if "nosuchbucket" in lowered:
        return MillpondError(f"bucket missing for {uri}: run `make up` (creates the buckets)")
    return MillpondError(f"Delta operation on {uri} failed: {text[:300]}")


def store_failure(exc: BaseException, settings: Settings) -> MillpondError | None:
    """The one-line error for a raw object-store failure that reached a batch's boundary unwrapped (a delta-rs
    call made outside ``Tables``, e.g. on a commit's worker thread or by the Spark engine's client), or None if
    ``exc`` is not one the store explains (then the batch's own failure line, with its way forward, says it).
    Same words as a wrapped one: a stopped store says unreachable and what to do."""
    if not isinstance(exc, OSError) or isinstance(exc, MillpondError):
        return None
    text = str(exc).lower()
    if not any(s in text for s in ("generic s3 error", "error sending request", "object store", "kernel error")):
        return None
    err = _wrap(exc, f"s3://{settings.bucket_lake}", settings)
    return None if str(err).startswith("Delta operation on") else err


def _table_config(stats_columns: Sequence[str] | None, name: str = "", retention_s: float | None = None
                  ) -> dict[str, str]:
    config = dict(TABLE_CONFIG) | (CHANGE_FEED if name in CHANGE_FEED_TABLES else {})
    if retention_s is not None:  # the deployment's; a pipeline's longer one is set by its first vacuum
        config |= retention_config(retention_s)
    if stats_columns:
        config["delta.dataSkippingStatsColumns"] = ",".join(stats_columns)
    return config


#: the table properties that say how long a table keeps its history (``Tables.vacuum`` sets them): replaced files
#: and log entries alike, for the pipeline's retention (``runtime.upkeep.retention_of``)
RETENTION_PROPERTIES = ("delta.deletedFileRetentionDuration", "delta.logRetentionDuration")
_INTERVAL = re.compile(r"interval\s+(\d+)\s+(second|minute|hour|day|week)s?", re.I)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}


def retention_config(retention_s: float) -> dict[str, str]:
    """The table properties of a history kept ``retention_s`` seconds (whole seconds, at least one)."""
    interval = f"interval {max(1, math.ceil(retention_s))} seconds"
    return {**dict.fromkeys(RETENTION_PROPERTIES, interval), "delta.enableExpiredLogCleanup": "false"}


def retention_seconds(config: dict[str, str]) -> float | None:
    """The retention a table's properties record (the shorter of its two), None when they record none."""
    found = [_INTERVAL.fullmatch(config.get(k, "").strip()) for k in RETENTION_PROPERTIES]
    values = [int(m.group(1)) * _UNIT_S[m.group(2).lower()] for m in found if m]
    return float(min(values)) if values else None


def _kept(source: pa.Table, delete_when: str | None) -> pa.Table | None:
    """The rows a MERGE into an empty table inserts, when ``delete_when`` is absent or names a boolean
    source column (``s.deleted``); None for any other predicate (the MERGE evaluates it)."""
    if delete_when is None:
        return source
    m = re.fullmatch(r"s\.`?(\w+)`?", delete_when.strip())
    flag = m.group(1) if m else None
    if flag not in source.column_names or not pa.types.is_boolean(source.schema.field(flag).type):
        return None
    return source.filter(pc.invert(source.column(flag)))  # a null flag is neither deleted nor inserted
