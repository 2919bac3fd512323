"""A batch's frame computed once for its several uses (the elements, the per-key step's output, the stored windows
it read): how depends on where the executors are."""

from __future__ import annotations


def keep(spark, df, now: bool = False):
    """``df`` computed once for the batch's several uses. On a ``local`` master, a lazy local checkpoint: its
    later plans then start from the stored rows instead of repeating the whole lineage, which a Connect server
    would analyse and plan again for every action (seconds per small batch). On a cluster, a cache: a lost
    executor's cached rows are recomputed from the lineage, a checkpoint's would fail the batch. ``now``:
    computed here, in a job of its own (else by the first action that needs it)."""
    if _local_master(spark):
        return df.localCheckpoint(eager=now)
    kept = df.cache()
    if now:
        kept.count()
    return kept


_MASTERS: dict[int, bool] = {}


def _local_master(spark) -> bool:
    key = id(spark)
    if key not in _MASTERS:
        _MASTERS[key] = str(spark.conf.get("spark.master")).startswith("local")
    return _MASTERS[key]
