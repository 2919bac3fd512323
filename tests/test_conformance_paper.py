"""The Dataflow paper's examples (Figures 7-14) through the real job and real Delta tables.

Inputs are one reconstruction of Figure 5 consistent with the text: ten values for one key
(5, 7, 3, 4, 3, 8, 3, 8, 1 and the late 9; total 51), arriving over processing time 12:05-12:10,
with a heuristic watermark that lets the 9 be late. See tests/scenarios/fig14_sessions_retracting.*.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engines import ONE_TASK, PLAN, on, same_tables
from millpond.model.spec import pipeline_from_dict
from millpond.surface.replay import read_events, replay

SCENARIOS = Path(__file__).parent / "scenarios"
EVENTS = read_events(SCENARIOS / "fig14_sessions_retracting.jsonl")
WATERMARKS = ["2026-01-01T12:01:00Z", "2026-01-01T12:02:00Z", "2026-01-01T12:03:00Z",
              "2026-01-01T12:05:30Z", "2026-01-01T12:06:00Z", "2026-01-01T12:08:30Z"]
EXPLICIT = {"policy": "explicit", "values": WATERMARKS}


def run(settings, pipeline_name: str, **cfg) -> list[tuple]:
    doc = {"name": pipeline_name, "aggregation": "sum", "batch_interval": "1m", "allowed_lateness": "10m",
           "source": {"prefix": f"replay/{pipeline_name}/"}, **cfg}
    panes = replay(settings, pipeline_from_dict(doc), EVENTS)
    return [(p["batch"], p["window_start"][11:19], p["kind"][0], p["value"], p["timing"]) for p in panes]


def values(panes: list[tuple]) -> list[int]:
    return [p[3] for p in panes if p[2] == "v"]


def test_total_is_51() -> None:
    assert sum(e["value"] for e in EVENTS) == 51 and len(EVENTS) == 10


def test_fig7_global_atperiod_accumulating(settings, pipeline_name) -> None:
    panes = run(settings, pipeline_name, window={"type": "global"}, trigger="Repeat(AtPeriod('1m'))",
                accumulation="accumulating", watermark={"policy": "processing_time", "lag": "1h"})
    assert values(panes) == [12, 22, 25, 33, 42, 51]
    assert {p[4] for p in panes} == {"EARLY"}


def test_fig8_global_atperiod_discarding(settings, pipeline_name) -> None:
    panes = run(settings, pipeline_name, window={"type": "global"}, trigger="Repeat(AtPeriod('1m'))",
                accumulation="discarding", watermark={"policy": "processing_time", "lag": "1h"})
    assert values(panes) == [12, 10, 3, 8, 9, 9]
    assert sum(values(panes)) == 51


def test_fig9_global_atcount_discarding(settings, pipeline_name) -> None:
    # A streaming engine sees one element at a time: 10-second batches hold one arrival each.
    panes = run(settings, pipeline_name, window={"type": "global"}, trigger="Repeat(AtCount(2))",
                accumulation="discarding", batch_interval="10s",
                watermark={"policy": "processing_time", "lag": "1h"})
    assert values(panes) == [12, 7, 6, 17, 9]  # five outputs, each the sum of two adjacent data


def test_fig10_fixed_windows_batch(settings, pipeline_name) -> None:
    # Classic batch: one batch holds everything; the simulated watermark then jumps to the end of time.
    panes = run(settings, pipeline_name, window={"type": "fixed", "size": "2m"}, accumulation="accumulating",
                batch_interval="10m", watermark={"policy": "explicit", "values": ["1970-01-01T00:00:00Z"]})
    assert panes == [(2, "12:00:00", "v", 14, "ON_TIME"), (2, "12:02:00", "v", 22, "ON_TIME"),
                     (2, "12:04:00", "v", 3, "ON_TIME"), (2, "12:06:00", "v", 12, "ON_TIME")]


def test_fig11_fixed_windows_microbatch(settings, pipeline_name) -> None:
    # A micro-batch engine re-emits every window whose contents changed in the batch.
    panes = run(settings, pipeline_name, window={"type": "fixed", "size": "2m"}, trigger="Repeat(AtCount(1))",
                accumulation="accumulating", watermark=EXPLICIT)
    assert [(p[0], p[1], p[3]) for p in panes] == [
        (1, "12:00:00", 5), (1, "12:02:00", 7),
        (2, "12:02:00", 14), (2, "12:04:00", 3),
        (3, "12:06:00", 3),
        (4, "12:02:00", 22),
        (5, "12:00:00", 14),
        (6, "12:06:00", 12),
    ]


def test_fig12_fixed_windows_streaming(settings, pipeline_name) -> None:
    panes = run(settings, pipeline_name, window={"type": "fixed", "size": "2m"}, accumulation="accumulating",
                watermark=EXPLICIT)  # default trigger: Repeat(AtWatermark())
    assert panes == [
        (2, "12:00:00", "v", 5, "ON_TIME"),
        (4, "12:02:00", "v", 22, "ON_TIME"),
        (5, "12:00:00", "v", 14, "LATE"),  # the late 9 retriggers the first window
        (5, "12:04:00", "v", 3, "ON_TIME"),
        (6, "12:06:00", "v", 12, "ON_TIME"),
    ]


def test_fig13_fixed_windows_early_and_late(settings, pipeline_name) -> None:
    panes = run(settings, pipeline_name, window={"type": "fixed", "size": "2m"}, accumulation="accumulating",
                trigger="SequenceOf(RepeatUntil(AtPeriod('1m'), AtWatermark()), Repeat(AtWatermark()))",
                watermark=EXPLICIT)
    assert panes == [
        (1, "12:00:00", "v", 5, "EARLY"), (1, "12:02:00", "v", 7, "EARLY"),
        (2, "12:00:00", "v", 5, "ON_TIME"), (2, "12:02:00", "v", 14, "EARLY"), (2, "12:04:00", "v", 3, "EARLY"),
        (3, "12:06:00", "v", 3, "EARLY"),
        (4, "12:02:00", "v", 22, "ON_TIME"),
        (5, "12:00:00", "v", 14, "LATE"), (5, "12:04:00", "v", 3, "ON_TIME"),
        (6, "12:06:00", "v", 12, "ON_TIME"),
    ]
    # The shorthand says the same thing.
    other = run(settings, pipeline_name + "b", window={"type": "fixed", "size": "2m"}, accumulation="accumulating",
                trigger="AtWatermark(early=AtPeriod('1m'), late=AtCount(1))", watermark=EXPLICIT)
    assert other == panes


FIG14 = [
    (1, "12:00:26", "v", 5, "EARLY"), (1, "12:02:05", "v", 7, "EARLY"),
    (2, "12:00:26", "r", 5, "ON_TIME"), (2, "12:00:26", "v", 5, "ON_TIME"), (2, "12:03:30", "v", 10, "EARLY"),
    (3, "12:06:00", "v", 3, "EARLY"),
    # 8 joins the 7 and 10 sessions: both are retracted, then the merged 25.
    (4, "12:02:05", "r", 7, "ON_TIME"), (4, "12:03:30", "r", 10, "ON_TIME"), (4, "12:02:05", "v", 25, "ON_TIME"),
    # the late 9 bridges the 5 and 25 sessions: 39.
    (5, "12:00:26", "r", 5, "LATE"), (5, "12:02:05", "r", 25, "LATE"), (5, "12:00:26", "v", 39, "LATE"),
    # 8 and 1 join the early 3: 12.
    (6, "12:06:00", "r", 3, "ON_TIME"), (6, "12:06:00", "v", 12, "ON_TIME"),
]


def test_fig14_sessions_retracting_via_cli(settings, tmp_path) -> None:
    out = tmp_path / "panes.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "millpond", "replay", "--pipeline", str(SCENARIOS / "fig14_sessions_retracting.yaml"),
         "--events", str(SCENARIOS / "fig14_sessions_retracting.jsonl"), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    panes = [json.loads(line) for line in out.read_text().splitlines()]
    got = [(p["batch"], p["window_start"][11:19], p["kind"][0], p["value"], p["timing"]) for p in panes]
    assert got == FIG14
    final = {}
    for p in panes:  # replaying values minus retractions leaves the final sessions
        w = (p["window_start"], p["window_end"])
        final[w] = final.get(w, 0) + (p["value"] if p["kind"] == "value" else -p["value"])
    assert sorted(v for v in final.values() if v) == [12, 39]


def _fig14_doc(name: str) -> dict:
    return {"name": name, "window": {"type": "sessions", "gap": "1m"},
            "trigger": "SequenceOf(RepeatUntil(AtPeriod('1m'), AtWatermark()), Repeat(AtWatermark()))",
            "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "10m",
            "batch_interval": "1m", "watermark": EXPLICIT, "source": {"prefix": f"replay/{name}/"}}


@pytest.fixture(scope="module")
def fig14_local(settings) -> str:
    """Figure 14 on the local engine: the pipeline whose tables every engine's must equal."""
    import uuid

    name = f"t_fig14_{uuid.uuid4().hex[:8]}"
    replay(on(settings, "local"), pipeline_from_dict(_fig14_doc(name)), EVENTS)
    return name


@pytest.mark.parametrize(("engine", "partitions", "one_task"),
                         [("local", None, False), ("spark", 3, False), ("spark", 1, True)],
                         ids=["local", "spark-plan-3", "spark-one_task"])
def test_fig14_gives_the_same_tables_on_every_engine(settings, tables, fig14_local, pipeline_name, monkeypatch,
                                                     request, engine, partitions, one_task) -> None:
    """Figure 14's panes, current view and state on the local engine; the Spark engine gives the same tables
    (``engines.same_tables``) at any parallelism (the batch's shuffle width is its size's, capped by
    ``spark.shuffle_partitions``: one row per task makes the cap the width here; a plan of one partition is
    ``tests/test_cores.py``'s), and as a small batch's one task."""
    from millpond.runtime.engines import spark_batch
    from millpond.surface.replay import read_panes

    name = fig14_local
    if engine == "spark":
        monkeypatch.setattr(spark_batch, "ROWS_PER_TASK", 1)
        name = pipeline_name
        on_spark = on(settings, "spark", ONE_TASK if one_task else PLAN, spark_shuffle_partitions=partitions)
        replay(on_spark, pipeline_from_dict(_fig14_doc(name)), EVENTS, spark=request.getfixturevalue("spark"))
    panes = read_panes(settings, name)
    assert [(p["batch"], p["window_start"][11:19], p["kind"][0], p["value"], p["timing"]) for p in panes] == FIG14
    current = tables.read_arrow(name, "current").sort_by("window_start").to_pylist()
    assert [(c["window_start"].strftime("%H:%M:%S"), c["value"]) for c in current] == [
        ("12:00:26", 39), ("12:06:00", 12)]
    assert tables.read_arrow(name, "windows").num_rows == 0  # all garbage-collected at the end
    if engine == "spark":
        same_tables(tables, fig14_local, name)
