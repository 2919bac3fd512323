"""S3 access through the ``minio`` SDK: works against MinIO, SeaweedFS or AWS alike.

Every failure a user can cause (store down, wrong keys, missing bucket) becomes a one-line
:class:`~millpond.errors.MillpondError` instead of a urllib3 stack trace.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.error import S3Error

from millpond.config import Settings
from millpond.errors import BadCredentials, BucketMissing, MillpondError, ObjectMissing, StoreUnreachable
from millpond.lake.waits import ATTEMPTS, StoreWait, not_answering, timed_out

_BAD_KEYS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken"}


@dataclass(frozen=True)
class StoredObject:
    bucket: str
    key: str
    size: int
    etag: str
    last_modified: float


def client(settings: Settings) -> Minio:
    url = urlparse(settings.s3_endpoint)
    # Fail fast: a stopped store refuses in seconds, a frozen one fails the call within object_store.timeout
    # (attempts x per-attempt timeout, see ``lake.waits``), never after minutes of retries.
    wait = StoreWait.of(settings)
    http = urllib3.PoolManager(
        maxsize=16,  # a batch reads its files on 8 threads beside other requests: keep their connections
        timeout=urllib3.Timeout(connect=wait.connect, read=wait.read),
        retries=urllib3.Retry(total=ATTEMPTS - 1, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
    )
    return Minio(
        url.netloc,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=url.scheme == "https",
        region=settings.s3_region,
        http_client=http,
    )


def translate(exc: BaseException, settings: Settings, bucket: str | None = None) -> MillpondError:
    """Map SDK and network failures to actionable one-line errors."""
    if isinstance(exc, MillpondError):
        return exc
    if isinstance(exc, S3Error):
        if exc.code in _BAD_KEYS:
            return BadCredentials(
                f"object store at {settings.s3_endpoint} refused the credentials ({exc.code}): "
                "check MILLPOND_S3_ACCESS_KEY / MILLPOND_S3_SECRET_KEY"
            )
        if exc.code == "NoSuchBucket":
            return BucketMissing(
                f"bucket '{bucket or exc.bucket_name}' does not exist at {settings.s3_endpoint}: "
                "run `make up` (creates the buckets) or set MILLPOND_BUCKET_*"
            )
        if exc.code == "NoSuchKey":
            return ObjectMissing(f"object {exc.bucket_name}/{exc.object_name} does not exist at {settings.s3_endpoint}")
        return MillpondError(f"object store error {exc.code}: {exc.message}")
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        if timed_out(exc):
            return not_answering(settings, f"bucket {bucket}" if bucket else "")
        return StoreUnreachable(
            f"object store unreachable at {settings.s3_endpoint}: start it with `make up` "
            "or set MILLPOND_S3_ENDPOINT"
        )
    return MillpondError(f"object store error: {exc}")


class ObjectStore:
    """The few object-store operations the product needs, with clear errors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.mc = client(settings)

    def _call(self, fn, *args, bucket: str | None = None, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every SDK failure is translated
            raise translate(exc, self.settings, bucket) from exc

    def check(self) -> None:
        """Raise the clear error if the store is down, the keys are wrong or a bucket is missing."""
        existing = {b.name for b in self._call(self.mc.list_buckets)}
        for bucket in self.settings.buckets:
            if bucket not in existing:
                raise translate(S3Error(None, "NoSuchBucket", "", "", "", "", bucket), self.settings, bucket)

    def ensure_buckets(self) -> list[str]:
        """Create the configured buckets that are missing; return those created."""
        created = []
        for bucket in self.settings.buckets:
            if not self._call(self.mc.bucket_exists, bucket, bucket=bucket):
                self._call(self.mc.make_bucket, bucket, bucket=bucket)
                created.append(bucket)
        return created

    def probe_reads(self) -> None:
        """Read one byte of one stored object per bucket. A restarted store answers listings before its
        volumes serve data again (SeaweedFS: a GET meanwhile fails with 500), so "up" waits for this."""
        for bucket in self.settings.buckets:
            first = self._call(lambda b=bucket: next(iter(self.mc.list_objects(b, recursive=True)), None),
                               bucket=bucket)
            if first is not None and not first.is_dir and (first.size or 0) > 0:
                resp = self._call(self.mc.get_object, bucket, first.object_name, offset=0, length=1, bucket=bucket)
                resp.close()
                resp.release_conn()

    def put_bytes(self, bucket: str, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self._call(
            self.mc.put_object, bucket, key, io.BytesIO(data), len(data), content_type=content_type, bucket=bucket
        )

    def get_bytes(self, bucket: str, key: str) -> bytes:
        resp = self._call(self.mc.get_object, bucket, key, bucket=bucket)
        try:
            return self._call(resp.read, bucket=bucket)  # the body arrives after the call: a wait of its own
        finally:
            resp.close()
            resp.release_conn()

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None,
             stop_at: str | None = None) -> Iterator[StoredObject]:
        """The objects under ``prefix`` in key order: after ``start_after`` if given, and before ``stop_at``
        (the listing stops there: the pages after it are not fetched)."""
        def fetch() -> list[Any]:
            found = self.mc.list_objects(bucket, prefix=prefix, recursive=True, start_after=start_after)
            if stop_at is not None:
                found = itertools.takewhile(lambda o: o.object_name < stop_at, found)
            return list(found)

        objects = self._call(fetch, bucket=bucket)
        for o in objects:
            if o.is_dir:
                continue
            yield StoredObject(
                bucket, o.object_name, o.size or 0, (o.etag or "").strip('"'),
                o.last_modified.timestamp() if o.last_modified else 0.0,
            )

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Delete every object under ``prefix``; return how many were deleted."""
        return self.delete_keys(bucket, [o.key for o in self.list(bucket, prefix)])

    def delete_keys(self, bucket: str, keys: list[str]) -> int:
        """Delete the objects ``keys`` (a thousand a request); return how many were asked for."""
        from minio.deleteobjects import DeleteObject

        for lo in range(0, len(keys), 1000):
            errors = self._call(lambda lo=lo: list(self.mc.remove_objects(
                bucket, [DeleteObject(k) for k in keys[lo:lo + 1000]])), bucket=bucket)
            if errors:
                raise MillpondError(f"could not delete {errors[0].object_name} in {bucket}: {errors[0].message}")
        return len(keys)

    def upload_dir(self, bucket: str, prefix: str, root, manifest=None) -> int:
        """Upload a local folder (e.g. Data Docs) under ``prefix``; return the number of files uploaded.

        With ``manifest`` (a local JSON file), only files added or changed since the last upload through the
        same manifest are sent, and objects of files deleted locally since then are removed: a site that
        gains a page per batch is published in time that does not grow with its history."""
        import hashlib
        import json
        import mimetypes
        from pathlib import Path

        root = Path(root)
        sent: dict[str, str] = {}
        if manifest is not None and Path(manifest).exists():
            sent = json.loads(Path(manifest).read_text()).get(f"{bucket}/{prefix}", {})
        now: dict[str, str] = {}
        n = 0
        for path in sorted(root.rglob("*")):
            if not path.is_file() or (manifest is not None and path == Path(manifest)):
                continue
            rel = path.relative_to(root).as_posix()
            now[rel] = hashlib.sha1(path.read_bytes()).hexdigest()  # a rebuild rewrites unchanged files
            if sent.get(rel) == now[rel]:
                continue
            key = f"{prefix.rstrip('/')}/{rel}"
            # A content type per file so the site is browsable straight from the bucket.
            ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            self._call(self.mc.fput_object, bucket, key, str(path), content_type=ctype, bucket=bucket)
            n += 1
        if manifest is not None:
            for rel in sorted(set(sent) - set(now)):
                self._call(self.mc.remove_object, bucket, f"{prefix.rstrip('/')}/{rel}", bucket=bucket)
            doc = json.loads(Path(manifest).read_text()) if Path(manifest).exists() else {}
            doc[f"{bucket}/{prefix}"] = now
            Path(manifest).write_text(json.dumps(doc))
        return n
