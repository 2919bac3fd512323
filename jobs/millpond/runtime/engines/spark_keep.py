"""A batch's frame computed once for its several uses (the elements, the per-key step's output, the stored windows
it read): how depends on where the executors are."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from millpond.lake.spark_frames import on_connect


def keep(spark, df, now: bool = False):
    """``df`` computed once for the batch's several uses. On a ``local`` master, a lazy local checkpoint: its
    later plans then start from the stored rows instead of repeating the whole lineage, which a Connect server
    would analyse and plan again for every action (seconds per small batch). On a cluster, a cache: a lost
    executor's cached rows are recomputed from the lineage, a checkpoint's would fail the batch. ``now``:
    computed here, in a job of its own (else by the first action that needs it)."""
    if _local_master(spark):
        return _checkpoint(spark, df, now)
    kept = df.cache()
    if now:
        kept.count()
    return kept


def _checkpoint(spark, df, eager: bool):
    """``df``'s local checkpoint, on ``spark``. pyspark's Connect client gives a checkpoint the thread's active session
    (``SparkSession.active()``), not the checkpointed frame's: that is the process's first session, or none at all
    once the watchdog has closed a frozen server's session (``spark_watchdog``). A batch on a later session (the one
    ``spark_client.connect`` makes after a freeze) then sent its next job to a session without the frame, or failed
    on "No active or default Spark session found", every multi-stage batch of the process. So ``spark`` is the
    active session while the checkpoint is made."""
    if not on_connect(spark):
        return df.localCheckpoint(eager=eager)
    from pyspark.sql.connect.session import SparkSession

    active = SparkSession._active_session  # a thread-local
    before = getattr(active, "session", None)
    active.session = spark
    try:
        return df.localCheckpoint(eager=eager)
    finally:
        active.session = before


def release(frames: Iterable) -> None:
    """Each kept frame of ``frames`` (None: none) released on the server: at once, each a round trip of its own,
    so that a batch waits for one instead of one after the other."""
    kept = [f for f in frames if f is not None]
    failed: list[BaseException] = []

    def unpersist(frame) -> None:
        try:
            frame.unpersist()
        except BaseException as exc:  # noqa: BLE001 - raised on the batch's thread below
            failed.append(exc)

    threads = [threading.Thread(target=unpersist, args=(f,), name="spark-release", daemon=True) for f in kept[1:]]
    for t in threads:
        t.start()
    if kept:
        unpersist(kept[0])
    for t in threads:
        t.join()
    if failed:  # as one after the other would: the batch fails on the server's error
        raise failed[0]


_MASTERS: dict[int, bool] = {}


def known_master(spark, master: str) -> None:
    """``spark``'s master, read already (``spark_client.connect`` reads it as it connects): not asked again."""
    _MASTERS[id(spark)] = str(master).startswith("local")


def _local_master(spark) -> bool:
    key = id(spark)
    if key not in _MASTERS:
        known_master(spark, spark.conf.get("spark.master"))
    return _MASTERS[key]
