"""A batch's shuffle width on its Spark session: read once, set only where it changes, put back at the end.

Why: each read or write of a session's setting on a Connect client is a round trip before the batch's next job can
start, and a batch sized its shuffles up to three times, mostly to the width they had already; the session's own
width is put back after (a shared session's other users keep theirs).
"""

from __future__ import annotations

KEY = "spark.sql.shuffle.partitions"


class ShuffleWidth:
    """The session's ``spark.sql.shuffle.partitions`` over one batch."""

    def __init__(self, spark) -> None:
        self.spark = spark
        self.before = self.now = str(spark.conf.get(KEY))

    def set(self, partitions: int | str) -> None:
        if str(partitions) != self.now:
            self.spark.conf.set(KEY, str(partitions))
            self.now = str(partitions)

    def restore(self) -> None:
        """The session's width as it was before the batch."""
        self.set(self.before)
