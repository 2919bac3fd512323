"""Single writer per pipeline: a lease with a sequencer token (MillWheel section 6.2).

The lease is one object in the lake bucket, changed only by conditional puts (If-None-Match /
If-Match on its ETag), so two runs can never both believe they own it. Every acquisition bumps the
token; a run checks that its token is still the current one before each commit, so a zombie (a run
that lost the lease while paused) stops instead of writing. Delta's own conflict detection backs this up
for a commit whose snapshot predates the other run's commit (one carrying the same application id, a RESTORE
or a DELETE); it does not fence a run that paused between its check and opening its snapshot
(``tests/test_lease.py``, issue 37).

A run's owner id is the Airflow run's identity when a DAG task runs the batch (so a retry of the same
run takes its lease back at once, while the killed attempt stays fenced by the token), or
``MILLPOND_RUN_ID`` when set; otherwise an id of the process. A running batch renews its lease every
third of the TTL (``lease.ttl``), so a short TTL is safe and a long batch is never taken over; a failed
renewal is retried, and a batch whose lease is about to lapse unrenewed stops before its next commit.

The lease names its holder's process: host, pid, the process's start time (a pid comes round again) and
the machine's boot id and pid namespace (a host name does not tell containers apart). A holder on this
machine whose process is gone is dead: its lease is taken over at once (by the same conditional put, so
of two takers one wins). A holder elsewhere cannot be checked: its lease lapses one TTL after its last
renewal, and a run refused meanwhile is told until when; ``acquire(wait=True)`` waits for it, saying so.
A lease taken for longer than ``lease.ttl`` (a rewind's) is meant to outlive its process: only its owner
takes it back before it lapses.
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
from millpond.errors import LeaseHeld, LeaseLapsed, LeaseLost, MillpondError, StoreUnreachable
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
    #: when the lease lapses unless renewed (epoch seconds, as last written by this run)
    expires: float = 0.0
    #: held past this run's process (a rewind's): a run on the same host does not take it over when it dies
    outlives: bool = False

    @property
    def key(self) -> str:
        return lease_key(self.settings, self.pipeline)

    @classmethod
    def acquire(cls, settings: Settings, pipeline: str, owner: str | None = None,
                ttl_s: float | None = None, wait: bool = False, outlives: bool | None = None) -> Lease:
        """Take the lease, or raise :class:`LeaseHeld` naming its holder and until when it holds it. A holder
        on this host whose process is gone is taken over at once. ``wait``: while another owner's lease is
        live, wait until it lapses (at most one TTL), logging what it waits for. ``outlives``: the lease is
        meant to outlive this process (default: when ``ttl_s`` is longer than ``lease.ttl``)."""
        deadline = time.time() + (settings.lease_ttl_s if ttl_s is None else ttl_s) + 1
        told = None
        while True:
            try:
                return cls._acquire(settings, pipeline, owner, ttl_s, outlives)
            except LeaseHeld as exc:
                remaining = exc.expires - time.time()
                if not wait or time.time() + remaining > deadline + 1:
                    raise
                if told != exc.expires:  # once, and again each time the holder renews
                    told = exc.expires
                    log.warning("pipeline %s: waiting for the lease of %s to lapse at %s (in %.0f s)", pipeline,
                                exc.holder, _at(exc.expires), max(0.0, remaining))
                time.sleep(min(max(remaining, 0.0) + 0.2, 5.0))
            except LeaseLost:
                if not wait or time.time() > deadline:
                    raise  # another run took the lease at the same moment; waiting, see who holds it now
                time.sleep(0.2)

    @classmethod
    def _acquire(cls, settings: Settings, pipeline: str, owner: str | None, ttl_s: float | None,
                 outlives: bool | None) -> Lease:
        owner = owner or os.environ.get("MILLPOND_RUN_ID") or PROCESS_OWNER
        ttl_s = settings.lease_ttl_s if ttl_s is None else ttl_s
        outlives = ttl_s > settings.lease_ttl_s if outlives is None else outlives
        client = s3_client(settings)
        key = lease_key(settings, pipeline)
        current, etag = _read(client, settings, key)
        now = time.time()
        if current and current["owner"] != owner and current["expires"] > now:
            state = None if current.get("outlives") else holder_state(current)
            if state != GONE:
                raise _held(pipeline, current, state, now)
            log.warning("pipeline %s: taking over the lease of %s: its process is gone", pipeline, _holder(current))
        lease = cls(settings, pipeline, owner, (current["token"] if current else 0) + 1, "", ttl_s,
                    outlives=outlives)
        body = lease._body(now, acquired=now)
        # The same condition whether the lease is free, lapsed or its holder dead: of two takers, one wins.
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
        lease.etag, lease.expires = resp["ETag"], now + ttl_s
        return lease

    def _body(self, now: float, **when: float) -> bytes:
        """The lease object: who holds it (for an operator, and for a rerun on this host), its token and
        expiry, and its TTL (a live holder renews every third of it)."""
        return json.dumps({"owner": self.owner, "token": self.token, "expires": now + self.ttl_s, **when,
                           "ttl": self.ttl_s, "outlives": self.outlives, **this_process()}).encode()

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this run still holds the current token, and :class:`LeaseLapsed`
        once the lease's expiry has passed on this host's clock (another run may take it at any moment)."""
        current, etag = _read(s3_client(self.settings), self.settings, self.key)
        if not current or current["token"] != self.token or current["owner"] != self.owner:
            holder = f"{current['owner']} (token {current['token']})" if current else "nobody"
            raise LeaseLost(
                f"pipeline {self.pipeline}: lease lost to {holder}; this run (token {self.token}) stops before "
                "committing"
            )
        self.etag = etag
        self.expires = max(self.expires, float(current.get("expires") or 0))  # a renewal whose answer was lost
        if time.time() >= self.expires:
            raise LeaseLapsed(
                f"pipeline {self.pipeline}: this run's lease (token {self.token}) lapsed at {_at(self.expires)} "
                "unrenewed, so another run may take it at any moment: this run stops before committing; rerun "
                "it (a rerun redoes the same work)")

    def renew(self) -> None:
        """Move the expiry one TTL ahead, keeping the token; :class:`LeaseLost` if another run holds it.
        A stale ETag (this run's own check read the object meanwhile) is refreshed once and retried."""
        for attempt in (1, 2):
            now = time.time()
            body = self._body(now, renewed=now)
            try:
                resp = s3_client(self.settings).put_object(Bucket=self.settings.bucket_lake, Key=self.key,
                                                           Body=body, IfMatch=self.etag)
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
            self.etag, self.expires = resp["ETag"], now + self.ttl_s
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


#: a batch stops committing once less than this share of its lease's TTL is left unrenewed: a commit it
#: starts then still ends before the lease lapses (at the default TTL, 200 s, more than a store call's 120 s)
LAPSE_MARGIN = 1 / 3


class LeaseKeeper:
    """Renews a held lease every third of its TTL while a batch runs. A failed renewal is retried with a
    bounded backoff (a store that blinks does not end the batch); a lost lease ends the renewals. The batch's
    own thread calls ``check()`` before each commit, which raises when the lease was lost, or when less than
    a third of its TTL is left unrenewed: the batch stops before a commit could outlive its lease."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.pipeline}", daemon=True)
        #: the lease was lost (raised by ``check``); renewals ended
        self.error: Exception | None = None
        #: the last renewal's failure while renewals are retried (None once one succeeds)
        self.failure: Exception | None = None
        self.margin = lease.ttl_s * LAPSE_MARGIN

    def _run(self) -> None:
        period = max(0.5, self.lease.ttl_s / 3)
        first, failures, delay = min(1.0, period / 10), 0, period
        while not self._stop.wait(delay):
            try:
                self.lease.renew()
            except LeaseLost as exc:
                self.error = exc
                return
            except Exception as exc:  # noqa: BLE001 - a store that blinks; a renewal must never kill the process
                failures += 1
                self.failure, delay = exc, min(period / 2, first * 2 ** (failures - 1))
                log.warning("lease renewal for %s failed (%s); retrying in %.1f s, the lease lapses at %s",
                            self.lease.pipeline, exc, delay, _at(self.lease.expires))
                continue
            self.failure, failures, delay = None, 0, period

    def check(self) -> None:
        """Raise what the renewal found (lost lease) or a lease about to lapse unrenewed, then check the token
        as before each commit."""
        if self.error is not None:
            raise self.error
        if self.lease.expires - time.time() < self.margin:
            failure = self.failure
            why = (f"its renewal keeps failing ({_first_line(failure)})" if failure is not None
                   else "it was not renewed in time")
            raise LeaseLapsed(
                f"pipeline {self.lease.pipeline}: this run's lease (token {self.lease.token}) lapses at "
                f"{_at(self.lease.expires)} and {why}: this run stops before committing, so that no commit outlives "
                "its lease; rerun it once the object store answers (a rerun redoes the same work)")
        self.lease.check()

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=StoreWait.of(self.lease.settings).total + 1)  # a renewal in flight ends by then


# -- who holds a lease, and whether that process still lives ------------------------------------------------

#: what :func:`holder_state` tells of a lease's holder
GONE, ALIVE = "gone", "alive"


def _proc_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _stat(pid: int) -> tuple[int, str] | None:
    """A process's start time (clock ticks since boot) and state letter, from ``/proc/<pid>/stat``."""
    text = _proc_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and parentheses
    try:
        return int(fields[19]), fields[0]  # fields 22 (starttime) and 3 (state) of proc(5)
    except (IndexError, ValueError):
        return None


def _machine() -> dict[str, str | None]:
    """This machine's kernel boot and this process's pid namespace: pids compare only within both."""
    boot = _proc_text("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot": boot.strip() if boot else None, "pidns": pidns}


def this_process() -> dict:
    """What a lease records of its holder: host and pid (for an operator), and what a later run on the same
    machine checks the holder's liveness by (the machine's boot id and pid namespace, the start time)."""
    stat = _stat(os.getpid())
    return {**_machine(), "pid": os.getpid(), "start": stat[0] if stat else None}


def holder_state(record: dict) -> str | None:
    """:data:`GONE` when the lease's holder ran on this machine, in this pid namespace, and its process has
    ended (no process has its pid, or the one that has was started at another time, or is a zombie);
    :data:`ALIVE` when it still runs; None when this process cannot tell (another host or container, a lease
    written before the start time was recorded, a process of another user hidden from /proc)."""
    here = _machine()
    if any(record.get(k) is None or record.get(k) != here[k] for k in ("host", "boot", "pidns")):
        return None
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or pid <= 0 or not isinstance(start, int):
        return None
    exists = _exists(pid)
    if exists is not True:
        return None if exists is None else GONE
    stat = _stat(pid)
    if stat is None:  # it may have ended in between
        return GONE if _exists(pid) is False else None
    started, state = stat
    return GONE if started != start or state in ("Z", "X") else ALIVE


def _exists(pid: int) -> bool | None:
    """Whether a process has ``pid`` in this pid namespace (None: cannot tell)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OSError:
        return None
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _at(ts: float) -> str:
    """A time as a refusal names it: the time of day within a day from now, else the date too."""
    fmt = "%H:%M:%SZ" if abs(ts - time.time()) < 86400 else "%Y-%m-%dT%H:%M:%SZ"
    return time.strftime(fmt, time.gmtime(ts))


def _holder(record: dict) -> str:
    where = f", pid {record['pid']} on {record['host']}" if record.get("pid") and record.get("host") else ""
    return f"{record['owner']} (token {record['token']}{where})"


def _held(pipeline: str, record: dict, state: str | None, now: float) -> LeaseHeld:
    """The one line a run refused by a live lease stops with: who holds it, and what to do when."""
    expires, holder = float(record["expires"]), _holder(record)
    if record.get("outlives"):
        advice = (f"that owner holds it past its process until {_at(expires)} and only it takes it back before "
                  "then (a reprocess cut off half-way: run the same reprocess again)")
    elif state == ALIVE:
        advice = "that process is alive on this host: wait for it to end (it renews its lease while it runs) or stop it"
    else:
        every = float(record.get("ttl") or 0) / 3
        renews = f" (a running batch renews it every {every:.0f} s)" if every else ""
        advice = (f"it cannot be checked from this host, and its lease lapses at {_at(expires)} (in "
                  f"{max(0.0, expires - now):.0f} s) unless renewed{renews}: if that run is gone, rerun after "
                  f"{_at(expires)}")
    return LeaseHeld(f"pipeline {pipeline} is being run by {holder}: this run stops without writing; {advice} "
                     "(see docs/operations.md#after-a-failed-run)", expires, holder)


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
