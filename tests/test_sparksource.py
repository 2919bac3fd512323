"""The ``millpond`` Spark Python Data Source against real Delta tables on the embedded store."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from millpond.lake.sparksource import read, register
from millpond.lake.tables import Tables
from test_query import committed_batch, crash_before_marker

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")


def batch(n: int, rows: int) -> pa.Table:
    return pa.table({
        "key": [f"k{i % 3}" for i in range(rows)],
        "window_start": pa.array([T0 + timedelta(minutes=i) for i in range(rows)], TS),
        "value": pa.array([n * 100 + i for i in range(rows)], pa.int64()),
        "timing": ["EARLY" if i % 2 else "ON_TIME" for i in range(rows)],
        "batch": pa.array([n] * rows, pa.int64()),
    })


def norm(rows: list[dict]) -> list[tuple]:
    return sorted(tuple(sorted(r.items())) for r in rows)


@pytest.fixture
def lake(tables: Tables, pipeline_name: str) -> str:
    """Four appends (four data files, versions 0..3), plus a partitioned table."""
    for n in range(4):
        tables.append(pipeline_name, "panes", batch(n, 5 + n))
        time.sleep(0.05)
    tables.append(pipeline_name, "byday", pa.table({"day": ["d1", "d1", "d2"], "v": [1, 2, 3]}), partition_by=["day"])
    return pipeline_name


def partitions(df) -> int:
    """How many of the read's partitions hold rows (a Connect DataFrame has no ``rdd`` to ask)."""
    from pyspark.sql import functions as F

    return df.select(F.spark_partition_id().alias("p")).distinct().count()


@pytest.fixture(scope="module")
def registered(spark, settings):
    register(spark, settings)
    return spark


def test_same_rows_as_delta_rs_over_several_partitions(registered, settings, tables: Tables, lake: str) -> None:
    df = read(registered, f"{lake}.panes", settings)
    assert partitions(df) == 4  # one per data file
    expected = tables.read_arrow(lake, "panes")
    got = df.toArrow()
    assert got.schema.field("window_start").type == TS
    assert norm(got.to_pylist()) == norm(expected.to_pylist())
    assert df.count() == 5 + 6 + 7 + 8


def test_partition_values_are_filled_in(registered, settings, lake: str) -> None:
    df = read(registered, f"{lake}.byday", settings)
    got = sorted((r["day"], r["v"]) for r in df.collect())
    assert got == [("d1", 1), ("d1", 2), ("d2", 3)]


def test_time_travel_by_version_and_timestamp(registered, settings, tables: Tables, lake: str) -> None:
    v1 = registered.read.format("millpond").option("table", f"{lake}.panes").option("versionAsOf", 1)
    v1 = v1.options(endpoint=settings.s3_endpoint, accessKey=settings.s3_access_key,
                    secretKey=settings.s3_secret_key).load()
    assert v1.count() == 11 and partitions(v1) == 2
    commits = {h["version"]: h["timestamp"] for h in tables.history(lake, "panes")}
    at_v2 = datetime.fromtimestamp(commits[2] / 1000, UTC).isoformat()
    assert read(registered, f"{lake}.panes", settings, timestamp=at_v2).count() == 18


def test_spark_sql_over_temp_views(registered, settings, lake: str) -> None:
    views = register(registered, settings, pipelines=[lake])
    assert views == {f"{lake}_byday": f"{lake}.byday", f"{lake}_panes": f"{lake}.panes"}
    rows = registered.sql(
        f"SELECT batch, count(*) AS n, sum(value) AS total FROM {lake}_panes WHERE timing = 'EARLY' "
        "GROUP BY batch ORDER BY batch").collect()
    assert [(r["batch"], r["n"]) for r in rows] == [(0, 2), (1, 3), (2, 3), (3, 4)]
    assert rows[0]["total"] == 1 + 3
    plan = registered.sql(f"SELECT * FROM {lake}_panes")._explain_string(extended=True)
    assert settings.s3_secret_key not in plan


def test_unknown_table_is_a_clear_error(registered, settings, lake: str) -> None:
    with pytest.raises(Exception, match=f"unknown table {lake}.nope"):
        read(registered, f"{lake}.nope", settings).count()


def test_empty_table_reads_as_no_rows(registered, settings, tables: Tables, pipeline_name: str) -> None:
    tables.ensure(pipeline_name, "empty", pa.schema([("key", pa.string()), ("value", pa.int64())]))
    df = read(registered, f"{pipeline_name}.empty", settings)
    assert df.columns == ["key", "value"] and df.count() == 0


def test_a_pipeline_is_read_at_its_last_marker(registered, settings, tables: Tables, pipeline_name: str) -> None:
    """No half batch (issue 37, 8): each table at the version the last committed marker names (a table it names
    as not created yet: no rows); versionAsOf and timestampAsOf still read the version asked for."""
    name = pipeline_name
    committed_batch(settings, name, 2, ["a", "b"])
    crash_before_marker(tables, name)
    assert read(registered, f"{name}.panes", settings).count() == 2
    late = read(registered, f"{name}.late", settings)
    assert late.count() == 0 and "reason" in late.columns
    assert read(registered, f"{name}.batches", settings).count() == 1
    assert read(registered, f"{name}.panes", settings, version=1).count() == 4
    commits = {h["version"]: h["timestamp"] for h in tables.history(name, "panes")}
    at_v1 = datetime.fromtimestamp(commits[1] / 1000, UTC).isoformat()
    assert read(registered, f"{name}.panes", settings, timestamp=at_v1).count() == 4
    views = register(registered, settings, pipelines=[name])
    assert {f"{name}_panes", f"{name}_late"} <= set(views)
    assert registered.sql(f"SELECT count(*) AS n FROM {name}_panes").collect()[0]["n"] == 2
    assert registered.sql(f"SELECT count(*) AS n FROM {name}_late").collect()[0]["n"] == 0
    committed_batch(settings, name, 4, ["c"], late=["d"])  # its marker names the versions after its commits
    assert read(registered, f"{name}.panes", settings).count() == 5
    assert read(registered, f"{name}.late", settings).count() == 2
