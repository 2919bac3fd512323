"""Combiner lifting on the Spark engine (``runtime.engines.spark_lift``): which batches lift, and that Spark's
lifted elements are the per-key step's reference lifting (``tests/test_fast_paths.py``, ``_lifted``), late
elements passed one by one."""

from __future__ import annotations

import json
import random

import pytest
from millpond.model.clock import BatchClock
from millpond.model.step import Element
from millpond.runtime.assembly import strategy_of
from millpond.runtime.engines.spark_lift import SAFE_SUM, lift_for, lifted

from tests.test_fast_paths import _lifted

MIN = 60_000_000
T0 = 1_780_000_000_000_000


def _spec(aggregation: str = "sum", window: dict | None = None) -> str:
    return json.dumps({"name": "l", "source": {"prefix": "l/"}, "value_type": "int", "aggregation": aggregation,
                       "window": window or {"type": "fixed", "size": "5m", "offset": "1m"},
                       "allowed_lateness": "10m", "trigger": "AtWatermark(early=AtCount(2), late=AtCount(1))"},
                      sort_keys=True)


@pytest.mark.unit
def test_a_batch_lifts_only_where_nothing_can_tell() -> None:
    s = strategy_of(_spec())
    got = lift_for(s, "int", T0, one_key=True, biggest=100.0, rows=1_000)
    assert got is not None and (got.how, got.size, got.offset, got.late_end) == ("sum", 5 * MIN, MIN, T0 - 10 * MIN)
    assert lift_for(s, "int", T0, one_key=False, biggest=100.0, rows=1_000) is None  # many keys
    assert lift_for(s, "int", T0, one_key=True, biggest=None, rows=1_000) is None  # unknown values
    # a running sum that could overflow: a checked sum drops the element that would, one by one
    assert lift_for(s, "int", T0, one_key=True, biggest=SAFE_SUM / 10, rows=10) is None
    assert lift_for(strategy_of(_spec("max")), "int", T0, True, None, 10).how == "max"  # max cannot overflow
    assert lift_for(strategy_of(_spec(window={"type": "sessions", "gap": "5m"})), "int", T0, True, 1.0, 10) is None


@pytest.mark.parametrize(("aggregation", "with_state"), [("sum", False), ("sum", True), ("min", True),
                                                         ("max", False)])
def test_spark_lifts_as_the_reference_does(spark, aggregation: str, with_state: bool) -> None:
    """Spark's lifted rows (``lifted``) are the reference lifting's elements: one per key and on-time window
    (its window's id, the smallest event time and arrival; the aggregate; the count), every late element as it
    came, weight 1, and so every element of a stored window that is closed or (a sum) holds more than can be
    bounded."""
    rng = random.Random(5)
    spec = _spec(aggregation)
    clock = BatchClock(3, T0, T0 - 4 * MIN, T0 - 2 * MIN)
    by_key: dict[str, list[Element]] = {}
    for n in range(3_000):
        key = rng.choice(["all", "b", "c"])
        event = T0 - rng.randint(0, 40) * MIN // 2 - rng.randint(0, 59_999_999)  # some behind the lateness
        by_key.setdefault(key, []).append(Element(f"e{n:05d}", key, rng.randint(-50, 500), event,
                                                  T0 - rng.randint(0, 4) * MIN))
    rows = [el[:5] for els in by_key.values() for el in els]
    frame = spark.createDataFrame(rows, "id string, key string, value bigint, event_time bigint, arrival_time bigint")
    lift = lift_for(strategy_of(spec), "int", clock.input_watermark, True, 500.0, len(rows))
    # stored windows the batch read: "all"'s newest closed, "b"'s newest holding a sum too large to bound, "c"'s
    # newest open (its elements lifted onto it)
    newest = (T0 - MIN) - (T0 - 2 * MIN) % (5 * MIN)
    state = spark.createDataFrame(
        [("all", newest, '{"acc":null,"closed":true}'), ("b", newest, f'{{"acc":{2**62},"closed":false}}'),
         ("c", newest, '{"acc":12,"closed":false}')], "key string, window_start bigint, state string")
    if with_state:
        frame_lifted = lifted(frame, lift, state)
        apart = {("all", newest)} | ({("b", newest)} if aggregation == "sum" else set())  # min: nothing to bound
    else:
        frame_lifted, apart = lifted(frame, lift), set()
    got = sorted(tuple(r) for r in frame_lifted.collect())
    want = sorted(tuple(el) for els in _lifted(spec, clock, by_key, apart).values() for el in els)
    assert got == want
    combined = [r for r in got if r[5] > 1]
    assert len(got) - len(combined) > 0 and len(combined) <= 3 * 5  # late ones passed, a row per key and window


def test_lifting_aggregates_by_hash_in_one_pass(spark) -> None:
    """The lifted frame's plan aggregates by hash (no aggregate buffer is a string, which would make Spark sort
    every element by window: the 1M-row stage batch's largest task) and reads its elements once (no union of a
    combined and a passed-apart branch, each a scan of the batch's elements)."""
    spec = _spec()
    clock = BatchClock(3, T0, T0 - 4 * MIN, T0 - 2 * MIN)
    frame = spark.createDataFrame([("e1", "all", 1, T0 - MIN, T0), ("e2", "all", 2, T0 - 30 * MIN, T0)],
                                  "id string, key string, value bigint, event_time bigint, arrival_time bigint")
    lift = lift_for(strategy_of(spec), "int", clock.input_watermark, True, 2.0, 2)
    plan = lifted(frame, lift)._explain_string(mode="formatted")
    assert "SortAggregate" not in plan and "HashAggregate" in plan
    assert "Union" not in plan
    assert sorted(r["weight"] for r in lifted(frame, lift).collect()) == [1, 1]  # one on time, one late
