"""A Spark Connect client for a batch: the warm server does the work; no JVM starts in this process.

Every client passes the deployment's token (``connect_token``): the server runs any Python a client sends on
its executors, so it serves only clients holding its token (``orchestration.spark_server``, docs/deploy.md).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
from pathlib import Path
from urllib.parse import quote, urlparse

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.runtime.engines.spark_keep import known_master
from millpond.runtime.engines.spark_watchdog import ServerFrozen, watched

_SESSIONS: dict[str, object] = {}


def _close_sessions() -> None:
    """Close this process's open sessions as it exits, while its threads still run. pyspark closes a session only
    in its ``__del__``, during the interpreter's finalization, when gRPC's own threads no longer run: once a
    server had frozen and a new session had replaced the closed one, that close waited on them for good, and a
    process that had finished its batches (``millpond run``, a DAG task) never exited."""
    for session in list(_SESSIONS.values()):
        if not session.client.is_closed:
            with contextlib.suppress(Exception):  # exiting: a failed close changes nothing
                session.client.close()


atexit.register(_close_sessions)


def connect(settings: Settings):
    """A session on the deployment's Connect endpoint (reused within the process), or one line naming
    ``make up`` when nothing answers there, or naming the token when the server refuses this client's."""
    url = settings.spark_connect_url  # never the token: this one is printed and logged
    session = _SESSIONS.get(url)
    if session is not None and not session.client.is_closed:  # closed: its server froze (``spark_watchdog``)
        return session
    _probe(url)
    logging.getLogger("pyspark").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    token = connect_token(settings)
    try:
        # a new session (not the process's default one, which may be another endpoint's or a refused one)
        session = SparkSession.builder.remote(remote_url(url, token)).create()
        with watched(session, url, settings.spark_timeout_s):
            master = session.conf.get("spark.master")  # where a missing server shows first (no Spark job)
    except ServerFrozen:
        raise
    except Exception as exc:  # noqa: BLE001 - gRPC errors become one line
        text = " ".join(str(exc).split())
        refused = "UNAUTHENTICATED" in text
        text = (text.replace(token, "<token>") if token else text)[:200]
        if refused:
            given = "a wrong token" if token else "no token"
            raise MillpondError(f"Spark Connect server at {url} refused this client ({given}): "
                                f"{_token_hint(settings)}; {text}") from exc
        raise MillpondError(f"Spark Connect server at {url} is not answering: start it with `make up` "
                            f"(or set spark.connect); {text}") from exc
    known_master(session, master)  # a batch's kept frames depend on it (``spark_keep``)
    _SESSIONS[url] = session
    return session


def token_file(settings: Settings) -> Path:
    """Where ``make up`` keeps the token of the stack's own Connect server (owner-only, mode 0600)."""
    return settings.home / "spark" / "connect.token"


def connect_token(settings: Settings) -> str:
    """The token this deployment's clients pass: ``spark.connect_token`` (``MILLPOND_SPARK_CONNECT_TOKEN``)
    when set; else, for the stack's own server, the one ``make up`` generated under the home (Airflow tasks
    share the stack's ``MILLPOND_HOME``); else none (an endpoint of a deployment's own that takes none)."""
    if settings.spark_connect_token or settings.spark_connect:
        return settings.spark_connect_token
    try:
        return token_file(settings).read_text().strip()
    except FileNotFoundError:
        return ""


def remote_url(url: str, token: str) -> str:
    """The connection string with the token as its ``token`` parameter (one already there is kept).

    pyspark (4.2, ``DefaultChannelBuilder.toChannel``) sends a token only on a secure channel: TLS, unless
    the host is exactly ``localhost`` (and ``use_ssl`` is not true), where it takes gRPC's local credentials:
    plaintext, to a loopback peer only. ``use_ssl=false`` does not turn TLS off. So the stack's ``127.0.0.1``
    is named ``localhost`` here (a TLS handshake against its plaintext server would only retry); any other
    host is reached over TLS, which its server needs in front of it (docs/deploy.md)."""
    if not token:
        return url
    parsed = urlparse(url.replace("sc://", "http://", 1))
    params = [p for p in parsed.params.split(";") if p]
    if any(p.split("=", 1)[0] == "token" for p in params):
        return url
    netloc = parsed.netloc
    if parsed.hostname == "127.0.0.1" and "use_ssl=true" not in (p.lower() for p in params):
        netloc = "localhost" + (f":{parsed.port}" if parsed.port else "")
    return f"sc://{netloc}/;" + ";".join([*params, f"token={quote(token, safe='')}"])


def _token_hint(settings: Settings) -> str:
    if settings.spark_connect_token:
        return "spark.connect_token (MILLPOND_SPARK_CONNECT_TOKEN) must be the server's token"
    if settings.spark_connect:
        return "set spark.connect_token (MILLPOND_SPARK_CONNECT_TOKEN) to the server's token"
    return (f"the stack's server takes the token `make up` wrote to {token_file(settings)}: is MILLPOND_HOME "
            "the stack's?")


def _probe(url: str, timeout: float = 3.0) -> None:
    """Fail in one line when nothing listens at the endpoint: the client itself would retry for minutes."""
    target = urlparse(url.replace("sc://", "http://", 1))
    try:
        with socket.create_connection((target.hostname or "127.0.0.1", target.port or 15002), timeout=timeout):
            return
    except OSError as exc:
        raise MillpondError(f"Spark Connect server at {url} is not answering: start it with `make up` "
                            f"(or set spark.connect); {exc}") from exc
