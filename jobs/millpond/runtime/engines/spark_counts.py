"""The counts a Spark batch's writes need, taken in one job over the per-key step's output.

The marker's counts, the ``current`` partitions to rewrite, and the per-task sums that number the panes
(``spark_batch.task_offsets``) all come from one small aggregate the client collects before the write job:
each would otherwise be a job of its own, or a broadcast computed on executors ahead of the write.
"""

from __future__ import annotations

from typing import Any

from millpond.lake.spark_frames import collected


def output_counts(out) -> list[dict[str, Any]]:
    """Rows per table and kind (``n``), the (day, hour) partitions of ``window_end`` the current rows touch (``d``,
    ``h``), and for each of the step's tasks (``p``: its ``read`` row) its panes (``m``) and its elements' greatest
    event time (``e``)."""
    from pyspark.sql import functions as F

    is_current, is_read = F.col("tbl") == "current", F.col("tbl") == "read"
    groups = out.groupBy("tbl", "kind", F.when(is_current, F.to_date(F.timestamp_micros("window_end"))).alias("d"),
                         F.when(is_current, F.hour(F.timestamp_micros("window_end"))).alias("h"),
                         F.when(is_read, F.col("part")).alias("p"))
    return collected(groups.agg(F.sum(F.when(is_read, F.col("pane_index")).otherwise(1)).alias("n"),
                                F.sum(F.when(is_read, F.col("seq"))).alias("m"),
                                F.max(F.when(is_read, F.col("event_time"))).alias("e")))
