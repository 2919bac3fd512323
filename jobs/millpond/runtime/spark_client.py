"""A Spark Connect client for a batch: the warm server does the work; no JVM starts in this process."""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlparse

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.runtime.spark_watchdog import ServerFrozen, watched

_SESSIONS: dict[str, object] = {}


def connect(settings: Settings):
    """A session on the deployment's Connect endpoint (reused within the process), or one line naming
    ``make up`` when nothing answers there."""
    url = settings.spark_connect_url
    session = _SESSIONS.get(url)
    if session is not None and not session.client.is_closed:  # closed: its server froze (``spark_watchdog``)
        return session
    _probe(url)
    logging.getLogger("pyspark").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    try:
        session = SparkSession.builder.remote(url).getOrCreate()
        with watched(session, url, settings.spark_timeout_s):
            session.conf.get("spark.master")  # the first call is where a missing server shows (no Spark job)
    except ServerFrozen:
        raise
    except Exception as exc:  # noqa: BLE001 - gRPC errors become one line
        text = " ".join(str(exc).split())[:200]
        raise MillpondError(f"Spark Connect server at {url} is not answering: start it with `make up` "
                            f"(or set spark.connect); {text}") from exc
    _SESSIONS[url] = session
    return session


def _probe(url: str, timeout: float = 3.0) -> None:
    """Fail in one line when nothing listens at the endpoint: the client itself would retry for minutes."""
    target = urlparse(url.replace("sc://", "http://", 1))
    try:
        with socket.create_connection((target.hostname or "127.0.0.1", target.port or 15002), timeout=timeout):
            return
    except OSError as exc:
        raise MillpondError(f"Spark Connect server at {url} is not answering: start it with `make up` "
                            f"(or set spark.connect); {exc}") from exc


def disconnect(settings: Settings) -> None:
    """Close this process's session on the endpoint (the server keeps running)."""
    session = _SESSIONS.pop(settings.spark_connect_url, None)
    if session is not None:
        session.stop()
