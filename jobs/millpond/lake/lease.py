"""Single writer per pipeline: a lease with a sequencer token (MillWheel section 6.2).

The lease is one object in the lake bucket, changed only by conditional puts (If-None-Match /
If-Match on its ETag), so two runs can never both believe they own it. Every acquisition bumps the
token; a run checks that its token is still the current one before each commit, so a zombie (a run
that lost the lease while paused) stops instead of writing. Delta's own conflict detection on the
batch's application transaction id backs this up for the instant between check and commit.

A run's owner id is ``MILLPOND_RUN_ID`` when set (Airflow passes the DAG run id, so a retry of the
same run takes its lease back at once); otherwise an id of the process, and a crashed process's lease
is taken over after it expires (``MILLPOND_LEASE_TTL_S``, default 600 s).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from millpond.config import Settings
from millpond.errors import LeaseLost, MillpondError, StoreUnreachable

#: a process retrying its own failed batch takes its lease back; the token still fences its older attempts
PROCESS_OWNER = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


_CLIENTS: dict[tuple[str, str, str, str], object] = {}


def s3_client(settings: Settings):
    """One client per endpoint and credentials: creating a boto3 client costs ~10 ms, and a batch
    checks the lease before each of its commits."""
    ident = (settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, settings.s3_region)
    client = _CLIENTS.get(ident)
    if client is None:
        client = _CLIENTS[ident] = _new_client(settings)
    return client


def _new_client(settings: Settings):
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        region_name=settings.s3_region,
        config=Config(connect_timeout=3, read_timeout=30, retries={"max_attempts": 2}),
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
                ttl_s: float | None = None) -> Lease:
        owner = owner or os.environ.get("MILLPOND_RUN_ID") or PROCESS_OWNER
        ttl_s = settings.lease_ttl_s if ttl_s is None else ttl_s
        client = s3_client(settings)
        key = lease_key(settings, pipeline)
        current, etag = _read(client, settings, key)
        now = time.time()
        if current and current["owner"] != owner and current["expires"] > now:
            raise LeaseLost(
                f"pipeline {pipeline} is being run by {current['owner']} (token {current['token']}, lease until "
                f"{time.strftime('%H:%M:%SZ', time.gmtime(current['expires']))}): this run stops without writing"
            )
        token = (current["token"] if current else 0) + 1
        body = json.dumps({"owner": owner, "token": token, "expires": now + ttl_s, "acquired": now}).encode()
        condition = {"IfMatch": etag} if current else {"IfNoneMatch": "*"}
        try:
            resp = client.put_object(Bucket=settings.bucket_lake, Key=key, Body=body, **condition)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise LeaseLost(f"pipeline {pipeline}: another run took the lease at the same moment; "
                                "this run stops without writing") from exc
            raise MillpondError(f"lease for {pipeline}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreUnreachable(f"object store unreachable at {settings.s3_endpoint} (lease): {exc}") from exc
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

    def release(self) -> None:
        """Expire the lease now so the next run need not wait (only if still ours)."""
        body = json.dumps({"owner": self.owner, "token": self.token, "expires": 0, "released": time.time()})
        try:
            s3_client(self.settings).put_object(Bucket=self.settings.bucket_lake, Key=self.key,
                                                Body=body.encode(), IfMatch=self.etag)
        except (ClientError, BotoCoreError):
            pass  # lost meanwhile, or the store is gone: the lease expires on its own


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
        raise StoreUnreachable(f"object store unreachable at {settings.s3_endpoint} (lease): {exc}") from exc
    return json.loads(resp["Body"].read()), resp["ETag"]
