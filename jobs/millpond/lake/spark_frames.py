"""A few local rows as a Spark frame, and a small result's rows, without first asking the server for its settings.

Why: on a Spark Connect client, ``createDataFrame`` first asks the server for thirteen settings (and, given a DDL
text, asks it to parse that), and every ``collect`` asks how binary columns come back. Each is a round trip (10-40
ms on a warm server, several times that under load) before the job the batch waits on, and a batch made several.
The frames here (a batch's own values, its key ranges, its tasks' pane offsets) hold no timestamp and nothing
large, which is what those settings decide; the results (counts, the files written, a computation's tallies) come
back as ``collect``'s do by default (binary as bytes). On a classic session the public calls cost no round trip
and are used.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

#: a frame of more bytes goes through ``createDataFrame``, which ships a large one as a cached relation
LOCAL_BYTES = 1 << 20


def on_connect(obj: Any) -> bool:
    """A Spark Connect client's object (a session, a frame), not a classic in-process one."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def _plain(schema) -> bool:
    """Only types whose Arrow form the server reads as they are: numbers, strings, booleans."""
    from pyspark.sql.types import BooleanType, IntegerType, LongType, StringType

    return all(isinstance(f.dataType, (BooleanType, IntegerType, LongType, StringType)) for f in schema.fields)


def local_frame(spark, rows: list[tuple], schema):
    """``spark.createDataFrame(rows, schema)`` (``schema``: a ``StructType``), its columns known to the client."""
    if not on_connect(spark) or not _plain(schema):
        return spark.createDataFrame(rows, schema)
    from pyspark.sql.connect.dataframe import DataFrame
    from pyspark.sql.connect.plan import LocalRelation
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow = to_arrow_schema(schema)
    table = pa.Table.from_arrays([pa.array([r[i] for r in rows], f.type) for i, f in enumerate(arrow)], schema=arrow)
    if table.nbytes > LOCAL_BYTES:
        return spark.createDataFrame(rows, schema)
    frame = DataFrame(LocalRelation(table, schema=schema.json()), spark)
    frame._cached_schema = schema
    return frame


def collected(df) -> list[dict[str, Any]]:
    """``df``'s rows as dicts (a small result: counts, file lists), binary as ``bytes``; a timestamp would come
    back zoned (UTC), where ``collect`` gives the session's local time."""
    if not on_connect(df):
        return [r.asDict() for r in df.collect()]
    table, _schema = df._to_table()
    return table.to_pylist()
