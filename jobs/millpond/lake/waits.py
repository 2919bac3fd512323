"""How long the product waits on the object store: one setting, ``object_store.timeout``, bounds one call
*including its retries*, for every client that talks to the store (minio, boto3 for the lease, delta-rs,
pyarrow on Spark executors). A store that freezes (a paused process, a hung load balancer) accepts
connections and then says nothing: only a read timeout ends such a wait, and a client's retries multiply
it. So each client gets a share of the bound per attempt, and the batch fails within about the bound,
with one line naming the store, instead of waiting as long as the store stays frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

from millpond.config import Settings
from millpond.errors import StoreUnreachable

#: attempts per call: one retry rides out a store that restarts or answers 503 once
ATTEMPTS = 2
#: what a frozen store's calls fail with, as delta-rs, pyarrow and the HTTP clients word it
_TIMEOUT_WORDS = ("timed out", "deadline has elapsed", "timeout was reached")


@dataclass(frozen=True)
class StoreWait:
    """The bound on one store call (``total``, seconds) and its share per attempt."""

    total: float

    @classmethod
    def of(cls, settings: Settings) -> StoreWait:
        return cls(max(1.0, settings.store_timeout_s))

    @property
    def attempt(self) -> float:
        """Longest one attempt may take: the retries and their backoff fit in ``total``."""
        return self.total * 0.9 / ATTEMPTS

    @property
    def connect(self) -> float:
        """A store that is up accepts a connection in well under a second; a stopped one refuses at once."""
        return min(3.0, self.attempt / 4)

    @property
    def read(self) -> float:
        """Longest silence while waiting for an answer, within one attempt."""
        return self.attempt - self.connect


def not_answering(settings: Settings, what: str = "") -> StoreUnreachable:
    """The one line a batch fails with when the store stops answering (see ``object_store.timeout``)."""
    during = f" ({what})" if what else ""
    return StoreUnreachable(
        f"object store at {settings.s3_endpoint} did not answer within {settings.store_timeout_s:.0f}s{during}: "
        "check it (`make status`), then rerun (a batch's rerun redoes the same work); object_store.timeout "
        "sets this wait")


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a call to the store that ran out of time."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
            return True
        if any(word in str(exc).lower() for word in _TIMEOUT_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def s3_filesystem(endpoint: str, access_key: str, secret_key: str, region: str, timeout_s: float):
    """A pyarrow S3 filesystem whose calls wait at most ``timeout_s`` in all (Spark executors' reads and
    writes: they get the bound as an option, not the settings)."""
    from urllib.parse import urlparse

    from pyarrow import fs

    wait, url = StoreWait(max(1.0, timeout_s)), urlparse(endpoint)
    return fs.S3FileSystem(access_key=access_key, secret_key=secret_key, region=region,
                           endpoint_override=url.netloc or endpoint, scheme=url.scheme or "https",
                           connect_timeout=wait.connect, request_timeout=wait.read,
                           retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS))
