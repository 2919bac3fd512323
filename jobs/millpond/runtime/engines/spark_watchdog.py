"""A bound on a Spark Connect server that stops answering while a batch runs on it.

A frozen server (a paused JVM, a hung host) still accepts TCP connections, and a gRPC call waits on it
for as long as the batch's Spark job might legitimately take, so no per-call deadline fits. Instead a
probe asks the server for a setting every few seconds beside the batch (a cheap RPC that the server's
gRPC threads answer while jobs run); when one goes unanswered for ``spark.timeout``, the session's channel
is closed, the batch's pending call fails, and the batch ends with one line naming the server. Nothing is
committed by then: the Spark engine commits after its jobs, and a rerun does the same work.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from millpond.errors import MillpondError
from millpond.lake.spark_frames import on_connect

#: seconds between probes while a batch runs
EVERY = 5.0


class ServerFrozen(MillpondError):
    """The Connect server stopped answering during a batch."""


@contextmanager
def watched(session, url: str, timeout: float) -> Iterator[None]:
    """Run the block with ``session``'s server probed; a server silent for ``timeout`` fails it in one line.
    A classic (in-process) SparkSession is not a service: nothing to watch."""
    if not on_connect(session):
        yield
        return
    client = session.client
    done, frozen = threading.Event(), threading.Event()

    def ask(answered: threading.Event) -> None:
        try:
            session.conf.get("spark.app.name", None)
        except Exception:  # noqa: BLE001 - a closed or failing channel: the batch's own call reports it
            pass
        answered.set()

    def probe() -> None:
        while not done.wait(EVERY):
            answered = threading.Event()
            threading.Thread(target=ask, args=(answered,), name="spark-probe", daemon=True).start()
            if not answered.wait(timeout) and not done.is_set():
                frozen.set()
                threading.Thread(target=client.close, name="spark-close", daemon=True).start()
                return

    watcher = threading.Thread(target=probe, name="spark-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    except Exception as exc:
        if frozen.is_set():
            raise ServerFrozen(_message(url, timeout)) from exc
        raise
    finally:
        done.set()


def _message(url: str, timeout: float) -> str:
    return (f"Spark Connect server at {url} did not answer within {timeout:.0f}s (spark.timeout): check it "
            "(make status; restart it with make down && make up), then rerun the batch")
