"""The per-key step's key ranges on the Spark engine (``runtime.engines.spark_keys.key_ranges``): ranges of
about equal cost, a key with stored windows costing more than a row (one without, about a row), each range in a
task of its own."""

from __future__ import annotations

import pytest
from millpond.runtime.engines.spark_keys import (
    COST_PER_TASK,
    RANGE,
    SIZE_BY_COST_FROM,
    key_ranges,
    murmur3_int,
    slot_for,
    tasks_for,
    weighted_bounds,
)
from millpond.runtime.layout import KEY_COST, NEW_KEY_COST


def _skewed(heavy: int = 10, heavy_rows: int = 2_000, light: int = 6_000) -> list[tuple[str, int]]:
    """(key, rows): a few hot keys sorting first (``a…``), then many keys of one row (``b…``): Zipf keys'
    shape, where the rows are half hot and the keys nearly all cold."""
    return [(f"a{i:04d}", heavy_rows) for i in range(heavy)] + [(f"b{i:06d}", 1) for i in range(light)]


@pytest.mark.unit
def test_bounds_split_the_cost_of_keys_not_their_rows() -> None:
    keys = _skewed()  # every key with stored windows: each costs KEY_COST beside its rows
    bounds = weighted_bounds([k for k, _ in keys], [KEY_COST + n for _, n in keys], 2)
    assert bounds is not None and len(bounds) == 1
    cost = [sum(KEY_COST + n for k, n in keys if (k <= bounds[0]) == first) for first in (True, False)]
    assert max(cost) / min(cost) < 1.05
    # by rows alone, the cut would fall at the last hot key, leaving every cold key to the second range
    assert bounds[0] > "b"


@pytest.mark.unit
def test_bounds_are_distinct_and_need_enough_keys() -> None:
    assert weighted_bounds(["a", "b", "c"], [1, 1, 1], 2) is None
    keys = [f"k{i:02d}" for i in range(30)] + ["m"] + [f"y{i:02d}" for i in range(30)]
    bounds = weighted_bounds(keys, [1] * 30 + [100_000] + [1] * 30, 4)
    # one key holds most of the cost: the cuts fall on it once, not three times (no empty range between)
    assert bounds == ["m"]
    assert weighted_bounds(keys[:31], [1] * 30 + [100_000], 4) == []  # the last key: no empty range after it


@pytest.mark.unit
def test_the_step_s_tasks_follow_its_estimated_cost_within_the_rows_and_the_width() -> None:
    # 1,000 sampled keys of one element and stored windows, one key in 60: 60,000 keys, about 1.26M of cost
    light = [KEY_COST + 1] * 1_000
    assert tasks_for(light, 60, 1, 8) == -(-60 * 1_000 * (KEY_COST + 1) // COST_PER_TASK)
    assert tasks_for(light, 60, 1, 2) == 2  # never above the deployment's width
    assert tasks_for(light, 1, 3, 8) == 3  # never below the rows' tasks
    assert tasks_for([], 1, 1, 8) == 1
    # the same keys without stored windows fire on columns: about a row's cost each, one task
    assert tasks_for([NEW_KEY_COST + 1] * 1_000, 60, 1, 8) == 1


@pytest.mark.unit
def test_the_slot_of_a_task_is_the_int_spark_s_hash_partitioning_sends_there() -> None:
    assert murmur3_int(0) == 933211791  # Spark: SELECT hash(0)
    assert murmur3_int(-1) == -1604776387  # SELECT hash(-1)
    for tasks in (2, 3, 8):
        assert [murmur3_int(slot_for(t, tasks)) % tasks for t in range(tasks)] == list(range(tasks))


def test_murmur_matches_spark_s_hash(spark) -> None:
    from pyspark.sql import functions as F

    got = spark.range(-300, 700).select(F.col("id").cast("int").alias("v")).select("v", F.hash("v").alias("h"))
    assert all(murmur3_int(r["v"]) == r["h"] for r in got.collect())


def test_each_range_runs_in_its_own_task_with_a_fair_share_of_the_keys(spark) -> None:
    from pyspark.sql import functions as F

    rows = [(k, None) for k, n in _skewed() for _ in range(n)]
    rows += [(k, "{}") for k, _ in _skewed()]  # each key has a stored window: it costs KEY_COST
    frame = spark.createDataFrame(rows, "key string, state string")
    spread = key_ranges(frame, 2, len(rows)).select("key", RANGE, F.spark_partition_id().alias("task"))
    tasks = spread.groupBy("task").agg(F.countDistinct("key").alias("keys"), F.count(F.lit(1)).alias("rows"),
                                       F.min(RANGE).alias("lo"), F.max(RANGE).alias("hi"),
                                       F.min("key").alias("first"), F.max("key").alias("last")).collect()
    by_task = sorted(tasks, key=lambda r: r["task"])
    assert [(r["task"], r["lo"], r["hi"]) for r in by_task] == [(0, 0, 0), (1, 1, 1)]
    assert by_task[0]["last"] < by_task[1]["first"]  # ranges in key order, task by task
    assert sum(r["rows"] for r in by_task) == len(rows)
    cost = [KEY_COST * r["keys"] + r["rows"] for r in by_task]
    assert max(cost) / min(cost) < 1.3, by_task  # Spark's repartitionByRange: 1 : 9 here


def test_keys_without_stored_windows_are_split_by_their_rows(spark) -> None:
    """A first batch's keys have no stored window: their windows fire on columns, at about a row's cost, so the
    ranges balance rows (the hot keys' range is not the one with every row, as by ``KEY_COST`` a key: 780k of a
    1M batch's rows in one task of four, measured)."""
    from pyspark.sql import functions as F

    rows = [(k, None) for k, n in _skewed() for _ in range(n)]
    spread = key_ranges(spark.createDataFrame(rows, "key string, state string"), 2, len(rows)).select(
        "key", F.spark_partition_id().alias("task"))
    by_task = sorted(spread.groupBy("task").agg(F.count(F.lit(1)).alias("rows"),
                                                F.countDistinct("key").alias("keys")).collect(),
                     key=lambda r: r["task"])
    cost = [NEW_KEY_COST * r["keys"] + r["rows"] for r in by_task]
    assert len(by_task) == 2 and max(cost) / min(cost) < 1.3, by_task


def test_a_batch_of_many_light_keys_runs_its_step_in_more_tasks_than_its_rows_ask(spark) -> None:
    """A batch of as many keys as elements costs the per-key step about ``KEY_COST`` times its rows: its rows
    alone ask for one task (a core idle while it runs, measured 2.7 s of a 7 s batch); its cost, estimated from
    the key sample, spreads it over the deployment's width, in balanced ranges of keys."""
    from pyspark.sql import functions as F

    n = max(SIZE_BY_COST_FROM, COST_PER_TASK // (KEY_COST + 1) + 2_000)
    # each key one element and a stored window it reads (the step's Python objects: KEY_COST a key)
    frame = spark.createDataFrame([(f"k{i:07d}", None) for i in range(n)] + [(f"k{i:07d}", "{}") for i in range(n)],
                                  "key string, state string")
    spread = key_ranges(frame, 1, n, most=2).select("key", RANGE, F.spark_partition_id().alias("task"))
    tasks = sorted(spread.groupBy("task").agg(F.count(F.lit(1)).alias("rows"), F.min("key").alias("first"),
                                              F.max("key").alias("last")).collect(), key=lambda r: r["task"])
    assert [r["task"] for r in tasks] == [0, 1]
    assert tasks[0]["last"] < tasks[1]["first"]
    assert min(r["rows"] for r in tasks) / max(r["rows"] for r in tasks) > 0.8, tasks
    # a short step keeps its rows' single task, with no sample job
    few = frame.limit(SIZE_BY_COST_FROM - 1)
    one = key_ranges(few, 1, SIZE_BY_COST_FROM - 1, most=2).select(F.spark_partition_id().alias("task"))
    assert [r["task"] for r in one.distinct().collect()] == [0]
