"""A batch's own numbers (its index, clock, horizons) as one broadcast row its Spark plans join, not as literals.

Why: Spark writes a numeric literal into the Java it generates for a plan. A batch whose number or watermark
differs from the last one's would make the server compile its plans' classes anew (about seventy for a
sessions batch), evict the earlier ones from the code cache, and have the JIT compile their hot loops again:
on two cores, several seconds of every batch of a long-running pipeline. A value read from a row leaves the
generated code the same from batch to batch, so a warm server compiles it once (``bench/README.md``).
"""

from __future__ import annotations

from millpond.lake.spark_frames import local_frame


def batch_values(spark, **values: int | None):
    """One row, a ``bigint`` column per value named ``_`` + its name, marked for broadcast; join it with
    :func:`with_values`. A null value compares as a null literal would."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField(f"_{name}", LongType(), True) for name in values])
    return F.broadcast(local_frame(spark, [tuple(values.values())], schema))


def with_values(df, values):
    """``df`` with the batch's values as columns on every row (a cross join with the one broadcast row: the
    rows keep their partitions)."""
    return df.crossJoin(values)
