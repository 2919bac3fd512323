"""The bench's Flink peer (``tests/reference/flink_bench.py`` + ``FlinkSessionsBench.java``) on a hand-made
stream whose panes are worked out by hand: the peer's numbers only mean something if it computes the
pipeline's sessions, early/on-time/late panes and retractions.

Runs Flink 2.3 from its own virtualenv (``tests/reference/flink_env.py``, built once under
``var/flink-venv/``); skips only if that venv cannot be built. Parallelism 1: one reader, so the
watermark (largest arrival - 2m, moved per second of arrival) and every pane are deterministic.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parent / "reference"
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
MS0 = int(T0.timestamp() * 1000)
MIN = 60_000


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"millpond_{name}", REFERENCE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SESSIONS = {"value_type": "int", "window": {"type": "sessions", "gap": "5m"},
            "trigger": "AtWatermark(early=AfterDelay('1m'), late=AtCount(1))",
            "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "1h",
            "batch_interval": "5m", "watermark": {"policy": "processing_time", "lag": "2m"}}


def test_refuses_pipelines_it_does_not_implement() -> None:
    bench = _load("flink_bench")
    assert bench.job_args(SESSIONS) == ["300000", "120000", "60000", "3600000"]
    for change in ({"accumulation": "accumulating"}, {"window": {"type": "fixed", "size": "1m"}},
                   {"trigger": "AtWatermark(early=AtPeriod('1m'), late=AtCount(1))"}):
        with pytest.raises(bench.Unsupported):
            bench.job_args({**SESSIONS, **change})


def _event(id_: str, key: str, value: int, event_s: float, arrival_s: float) -> dict:
    def iso(s: float) -> str:
        return (T0 + timedelta(seconds=s)).isoformat().replace("+00:00", "Z")

    return {"id": id_, "key": key, "value": value, "event_time": iso(event_s), "arrival_time": iso(arrival_s)}


@pytest.mark.slow
@pytest.mark.flink
def test_panes_retractions_and_final_sums(tmp_path: Path) -> None:
    flink_env = _load("flink_env")
    try:
        python = flink_env.ensure_flink_python(log=lambda m: print(m, file=sys.stderr))
    except flink_env.FlinkEnvError as exc:
        pytest.skip(f"Apache Flink venv could not be created (needs the package registry): {exc}")
    events = [_event(f"z{k}", "z", 100, k * 30 - 5, k * 30) for k in range(61)]  # moves the watermark to 28m
    events += [
        _event("a1", "a", 1, 0, 10),  # session [0, 5m): on time at arrival 7m
        _event("a1", "a", 1, 0, 60),  # duplicate id: dropped
        _event("a2", "a", 2, 8 * 60, 8 * 60 + 10),  # session [8m, 13m): on time at arrival 15m
        _event("a3", "a", 4, 4 * 60, 20 * 60),  # late (watermark 18m): merges both into [0, 13m)
        _event("b1", "b", 3, 10 * 60, 10 * 60),  # early at arrival 11m, on time at 17m
    ]
    events.sort(key=lambda e: e["arrival_time"])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b00000-00.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "p.json").write_text(json.dumps(SESSIONS))
    proc = subprocess.run([str(python), str(REFERENCE / "flink_bench.py"), "--pipeline", str(tmp_path / "p.json"),
                           "--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--parallelism", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["events"] == len(events)
    assert summary["seconds"] > 0 and summary["wall_s"] >= summary["seconds"]

    def rows(name: str) -> list[tuple]:
        lines = [ln.split("\t") for ln in (tmp_path / "out" / name).read_text().splitlines()]
        return [tuple(int(x) if x.lstrip("-").isdigit() else x for x in ln) for ln in lines]

    panes = rows("panes-0.tsv")  # key, start, end, value, sign, early
    a = [(s - MS0, e - MS0, v, sign, early) for k, s, e, v, sign, early in panes if k == "a"]
    first, second = (0, 5 * MIN), (8 * MIN, 13 * MIN)
    assert a[:6] == [(*first, 1, 1, 1),  # early: 1m of arrivals after a1 (arrival 90s)
                     (*first, 1, -1, 0), (*first, 1, 1, 0),  # on time (arrival 7m), retracting it
                     (*second, 2, 1, 1),  # early (arrival 9m30s)
                     (*second, 2, -1, 0), (*second, 2, 1, 0)]  # on time (arrival 15m)
    # a3 is late and bridges both sessions: both retracted, the merged session's late pane
    assert sorted(a[6:8]) == [(*first, 1, -1, 0), (*second, 2, -1, 0)]
    assert a[8:] == [(0, 13 * MIN, 7, 1, 0)]
    b = [(v, sign, early) for k, _s, _e, v, sign, early in panes if k == "b"]
    assert b == [(3, 1, 1), (3, -1, 0), (3, 1, 0)]  # early, then on time retracting it
    final = {(k, s - MS0, e - MS0): v for k, s, e, v in rows("final.tsv")[1:]}
    assert final == {("a", 0, 13 * MIN): 7, ("b", 10 * MIN, 15 * MIN): 3,
                     ("z", -5 * 1000, 30 * MIN - 5 * 1000 + 5 * MIN): 6100}
    assert summary["final_windows"] == 3 and summary["final_sum"] == 6110
