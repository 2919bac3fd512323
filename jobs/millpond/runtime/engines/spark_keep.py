"""A batch's frame computed once for its several uses (the elements, the per-key step's output, the stored windows
it read): how depends on where the executors are."""

from __future__ import annotations

import threading
from collections.abc import Iterable


def keep(spark, df, now: bool = False):
    """``df`` computed once for the batch's several uses. On a ``local`` master, a lazy local checkpoint: its
    later plans then start from the stored rows instead of repeating the whole lineage, which a Connect server
    would analyse and plan again for every action (seconds per small batch). On a cluster, a cache: a lost
    executor's cached rows are recomputed from the lineage, a checkpoint's would fail the batch. ``now``:
    computed here, in a job of its own (else by the first action that needs it)."""
    if _local_master(spark):
        return _ours(spark, df.localCheckpoint(eager=now))
    kept = df.cache()
    if now:
        kept.count()
    return kept


def _ours(spark, kept):
    """``kept`` (a checkpoint) on ``spark``. pyspark's Connect client binds a checkpoint to the thread's active
    session (``SparkSession.active()``: the first one the process made), not to the checkpointed frame's: a batch on
    any other session (the one ``spark_client.connect`` makes after the server froze and the old one was closed, a
    second endpoint's) then sent its next job to a session that had no such frame, or to a closed one, and failed."""
    if kept.sparkSession is spark:
        return kept
    from pyspark.sql.connect.dataframe import DataFrame
    from pyspark.sql.connect.plan import CachedRemoteRelation

    relation = kept._plan
    frame = DataFrame(CachedRemoteRelation(relation._relation_id, spark), spark)
    relation._relation_id = None  # released by ``frame``, on its own session (the other has no such frame)
    return frame


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
