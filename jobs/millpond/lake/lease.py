"""Single writer per pipeline: a lease with a sequencer token (MillWheel section 6.2).

The lease is one object in the lake bucket, changed only by conditional puts (If-None-Match /
If-Match on its ETag), so two runs can never both believe they own it. Every acquisition bumps the
token; a run checks that its token is still the current one before each commit, so a zombie (a run
that lost the lease while paused) stops instead of writing. Delta's own conflict detection on the
batch's application transaction id backs this up for the instant between check and commit.

A run's owner id is the Airflow run's identity when a DAG task runs the batch (so a retry of the same
run takes its lease back at once, while the killed attempt stays fenced by the token), or
``MILLPOND_RUN_ID`` when set; otherwise an id of the process. A running batch renews its lease every
third of the TTL (``lease.ttl``), so a short TTL is safe and a long batch is never taken over; a crashed
process's lease lapses after at most one TTL, and ``acquire(wait=True)`` waits that long, saying so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from millpond.config import Settings
from millpond.errors import LeaseLost, MillpondError, StoreUnreachable
from millpond.lake.waits import ATTEMPTS, StoreWait, not_answering, timed_out

log = logging.getLogger(__name__)

#: a process retrying its own failed batch takes its lease back; the token still fences its older attempts
PROCESS_OWNER = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


#: longest wait for the release of a lease (best effort: an unreleased lease lapses after its TTL)
RELEASE_WAIT_S = 5.0

_CLIENTS: dict[tuple[str, str, str, str, float], object] = {}


def s3_client(settings: Settings):
    """One client per endpoint and credentials: creating a boto3 client costs ~10 ms, and a batch
    checks the lease before each of its commits."""
    ident = (settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, settings.s3_region,
             settings.store_timeout_s)
    client = _CLIENTS.get(ident)
    if client is None:
        client = _CLIENTS[ident] = _new_client(settings)
    return client


def _new_client(settings: Settings):
    wait = StoreWait.of(settings)  # one call, retries included, within object_store.timeout
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        region_name=settings.s3_region,
        config=Config(connect_timeout=wait.connect, read_timeout=wait.read,
                      retries={"total_max_attempts": ATTEMPTS, "mode": "standard"}),
    )


@dataclass
class Lease:
    """A held lease: ``check()`` before each commit, ``release()`` when done."""

    settings: Settings
    pipeline: str
    owner: str
    token: int
    etag: str
    ttl_s: float

    @property
    def key(self) -> str:
        return lease_key(self.settings, self.pipeline)

    @classmethod
    def acquire(cls, settings: Settings, pipeline: str, owner: str | None = None,
                ttl_s: float | None = None, wait: bool = False) -> Lease:
        """Take the lease, or raise :class:`LeaseLost` naming its holder. ``wait``: while another owner's
        lease is live, wait until it lapses (at most one TTL), logging what it waits for."""
        deadline = time.time() + (settings.lease_ttl_s if ttl_s is None else ttl_s) + 1
        while True:
            try:
                return cls._acquire(settings, pipeline, owner, ttl_s)
            except LeaseLost as exc:
                remaining = getattr(exc, "expires", 0) - time.time()
                if not wait or remaining <= 0 or time.time() + remaining > deadline + 1:
                    raise
                log.warning("%s; waiting %.0f s for it to lapse", str(exc).split(":")[0], remaining)
                time.sleep(min(remaining + 0.2, 5.0))

    @classmethod
    def _acquire(cls, settings: Settings, pipeline: str, owner: str | None, ttl_s: float | None) -> Lease:
        owner = owner or os.environ.get("MILLPOND_RUN_ID") or PROCESS_OWNER
        ttl_s = settings.lease_ttl_s if ttl_s is None else ttl_s
        client = s3_client(settings)
        key = lease_key(settings, pipeline)
        current, etag = _read(client, settings, key)
        now = time.time()
        if current and current["owner"] != owner and current["expires"] > now:
            exc = LeaseLost(
                f"pipeline {pipeline} is being run by {current['owner']} (token {current['token']}, lease until "
                f"{time.strftime('%H:%M:%SZ', time.gmtime(current['expires']))}): this run stops without writing "
                "(see docs/operations.md#after-a-failed-run)"
            )
            exc.expires = current["expires"]
            raise exc
        token = (current["token"] if current else 0) + 1
        body = json.dumps({"owner": owner, "token": token, "expires": now + ttl_s, "acquired": now,
                           "pid": os.getpid(), "host": socket.gethostname()}).encode()  # who, for an operator
        condition = {"IfMatch": etag} if current else {"IfNoneMatch": "*"}
        try:
            resp = client.put_object(Bucket=settings.bucket_lake, Key=key, Body=body, **condition)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise LeaseLost(f"pipeline {pipeline}: another run took the lease at the same moment; "
                                "this run stops without writing") from exc
            raise MillpondError(f"lease for {pipeline}: {exc}") from exc
        except BotoCoreError as exc:
            raise _unreachable(settings, exc) from exc
        return cls(settings, pipeline, owner, token, resp["ETag"], ttl_s)

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this run still holds the current token."""
        current, etag = _read(s3_client(self.settings), self.settings, self.key)
        if not current or current["token"] != self.token or current["owner"] != self.owner:
            holder = f"{current['owner']} (token {current['token']})" if current else "nobody"
            raise LeaseLost(
                f"pipeline {self.pipeline}: lease lost to {holder}; this run (token {self.token}) stops before "
                "committing"
            )
        self.etag = etag

    def renew(self) -> None:
        """Move the expiry one TTL ahead, keeping the token; :class:`LeaseLost` if another run holds it.
        A stale ETag (this run's own check read the object meanwhile) is refreshed once and retried."""
        for attempt in (1, 2):
            now = time.time()
            body = json.dumps({"owner": self.owner, "token": self.token, "expires": now + self.ttl_s, "renewed": now,
                               "pid": os.getpid(), "host": socket.gethostname()})
            try:
                resp = s3_client(self.settings).put_object(Bucket=self.settings.bucket_lake, Key=self.key,
                                                           Body=body.encode(), IfMatch=self.etag)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise MillpondError(f"lease for {self.pipeline}: {exc}") from exc
                current, etag = _read(s3_client(self.settings), self.settings, self.key)
                if attempt == 2 or not current or (current["owner"], current["token"]) != (self.owner, self.token):
                    raise LeaseLost(f"pipeline {self.pipeline}: lease taken over; this run (token {self.token}) "
                                    "stops before committing") from exc
                self.etag = etag
                continue
            except BotoCoreError as exc:
                raise _unreachable(self.settings, exc) from exc
            self.etag = resp["ETag"]
            return

    def keep(self) -> LeaseKeeper:
        """A background renewal for the length of a ``with`` block (see :class:`LeaseKeeper`)."""
        return LeaseKeeper(self)

    def release(self) -> None:
        """Expire the lease now so the next run need not wait (only if still ours)."""
        body = json.dumps({"owner": self.owner, "token": self.token, "expires": 0, "released": time.time()})
        # Briefly: after a failure the store may be the reason, and the batch's error is waiting to be told.
        quick = self.settings.with_overrides(store_timeout_s=min(self.settings.store_timeout_s, RELEASE_WAIT_S))
        try:
            s3_client(quick).put_object(Bucket=self.settings.bucket_lake, Key=self.key,
                                                Body=body.encode(), IfMatch=self.etag)
        except (ClientError, BotoCoreError):
            pass  # lost meanwhile, or the store is gone: the lease expires on its own


class LeaseKeeper:
    """Renews a held lease every third of its TTL while a batch runs. A failed renewal is kept and raised
    by the next ``check()`` of the batch's own thread: the batch stops before its next commit."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.pipeline}", daemon=True)
        self.error: Exception | None = None

    def _run(self) -> None:
        period = max(0.5, self.lease.ttl_s / 3)
        while not self._stop.wait(period):
            try:
                self.lease.renew()
            except (LeaseLost, MillpondError) as exc:
                self.error = exc
                return
            except Exception as exc:  # noqa: BLE001 - a renewal must never kill the batch's process
                log.warning("lease renewal for %s failed: %s", self.lease.pipeline, exc)

    def check(self) -> None:
        """Raise what the renewal found (lost lease), then check the token as before each commit."""
        if isinstance(self.error, LeaseLost):
            raise self.error
        self.lease.check()

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=StoreWait.of(self.lease.settings).total + 1)  # a renewal in flight ends by then


def lease_key(settings: Settings, pipeline: str) -> str:
    return f"{settings.table_root}/{pipeline}/_lease.json"


def _read(client, settings: Settings, key: str) -> tuple[dict | None, str | None]:
    try:
        resp = client.get_object(Bucket=settings.bucket_lake, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None, None
        raise MillpondError(f"lease {key}: {exc}") from exc
    except BotoCoreError as exc:
        raise _unreachable(settings, exc) from exc
    try:
        return json.loads(resp["Body"].read()), resp["ETag"]
    except (BotoCoreError, OSError) as exc:  # the body arrives after the call: a wait of its own
        raise _unreachable(settings, exc) from exc


def _unreachable(settings: Settings, exc: Exception) -> StoreUnreachable:
    if timed_out(exc):
        return not_answering(settings, "the pipeline's lease")
    return StoreUnreachable(f"object store unreachable at {settings.s3_endpoint} (lease): {exc}")
