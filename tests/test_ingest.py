"""A batch on both engines, input to tables: bad input never disappears (each bad row is quarantined with its
reason, and counts add up), reruns take files once, and the Spark engine's copy-on-write keeps a file per
partition."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_datetime, to_us
from millpond.runtime.job import run_batch
from session_specs import SESSIONS

from bench.workload import WorkloadSpec, generate, land

P = datetime(2026, 3, 1, 12, 5, tzinfo=UTC)
ARRIVAL = arrival_tag(to_us(datetime(2026, 3, 1, 12, 0, tzinfo=UTC)))


def ev(i, **kw):
    base = {"id": f"e{i}", "key": "k", "value": 1, "event_time": "2026-03-01T12:01:00Z"}
    base.update(kw)
    return json.dumps(base)


CORPUS = {
    "good.jsonl": "\n".join([ev(1), ev(2, value=2), ev(3, value=3.0)]) + "\n",
    "malformed.jsonl": '{"id": "m1", "key": "k", "value": 1,\n' + ev(4) + "\n[1, 2]\n",
    "missing.jsonl": "\n".join([json.dumps({"id": "x1", "value": 1, "event_time": "2026-03-01T12:00:00Z"}),
                               json.dumps({"id": "x2", "key": "k", "value": None,
                                           "event_time": "2026-03-01T12:00:00Z"})]) + "\n",
    "types.jsonl": "\n".join([ev(10, value="7"), ev(11, value=True), ev(12, value=1.5), ev(13, key=["k"])]) + "\n",
    "times.jsonl": "\n".join([ev(20, event_time="yesterday"), ev(21, event_time="1969-12-31T23:59:59Z"),
                             ev(22, event_time="2030-01-01T00:00:00Z")]) + "\n",
    "huge.jsonl": ev(30, value=2**70) + "\n",
    "dupes.jsonl": "\n".join([ev(1), ev(40), ev(40)]) + "\n",
    "empty.jsonl": "",
    "schema_changed.jsonl": json.dumps({"event_id": "s1", "user": "k", "amount": 3, "ts": "2026-03-01T12:00:00Z"})
    + "\n",
}


def _engine(request, settings, kind: str):
    """(settings, Spark session or None) for the in-process engine, or the whole batch on Spark (a session from
    the fixture) as one task (a small batch's default) or as the multi-stage plan."""
    if kind == "local":
        return settings.with_overrides(engine="local"), None
    one_task_below = 0 if kind == "spark_plan" else settings.engine_one_task_below
    return (settings.with_overrides(engine="spark", engine_one_task_below=one_task_below),
            request.getfixturevalue("spark"))


@pytest.fixture(params=["local", "spark", "spark_plan"])
def every_path(request, settings):
    """The local engine, and both of the Spark engine's paths."""
    return _engine(request, settings, request.param)


@pytest.fixture(params=["local", "spark"])
def engine(request, settings):
    """Both engines (a small batch on Spark: its one task; a validated one: the plan)."""
    return _engine(request, settings, request.param)


def test_bad_input_corpus_is_quarantined_with_reasons(every_path, tables, pipeline_name) -> None:
    settings, spark = every_path
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "aggregation": "sum", "value_type": "int", "source": {"prefix": f"{pipeline_name}/"},
                               "watermark": {"policy": "processing_time", "lag": "1m"}})
    store = ObjectStore(settings)
    for name, body in CORPUS.items():
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{ARRIVAL}-{name}", body.encode())
    result = run_batch(settings, spec, P, spark=spark)
    one_task = spark is not None and settings.engine_one_task_below > 0
    assert ("spark_task" in result.phases) == one_task
    assert ("dedup" in result.phases) == (spark is None or one_task)  # the local engine's steps, here or in a task
    q = tables.read_arrow(pipeline_name, "quarantine")
    reasons = {(r["source_file"].rsplit("-", 1)[-1], r["line"]): r["reason"] for r in q.to_pylist()}
    assert reasons[("malformed.jsonl", 1)].startswith("malformed JSON")
    assert reasons[("malformed.jsonl", 3)] == "not a JSON object: list"
    assert reasons[("missing.jsonl", 1)] == "missing field: key"
    assert reasons[("missing.jsonl", 2)] == "missing field: value"
    assert reasons[("types.jsonl", 1)] == "wrong type: value must be a number, got str"
    assert reasons[("types.jsonl", 2)] == "wrong type: value must be a number, got bool"
    assert reasons[("types.jsonl", 3)] == "wrong type: value 1.5 is not an integer"
    assert reasons[("types.jsonl", 4)] == "wrong type: key must be a string or integer"
    assert reasons[("times.jsonl", 1)].startswith("unparseable event_time")
    assert reasons[("times.jsonl", 2)] == "implausible event_time: before 1970"
    assert reasons[("times.jsonl", 3)].startswith("implausible event_time: more than a day")
    assert reasons[("huge.jsonl", 1)] == "value out of range for a 64-bit integer"
    assert reasons[("empty.jsonl", 0)] == "empty file"
    assert reasons[("schema_changed.jsonl", 1)] == "missing field: id, key, value, event_time"
    assert all(r["batch"] == 1 and r["raw"] is not None for r in q.to_pylist())
    c = result.counts
    # good: e1, e2, e3 (3.0 is an integer), e4 (line 2 of malformed), e40; dupes: e1 again, e40 again
    assert c["accepted"] == 5 and c["duplicates"] == 2
    assert c["quarantined"] == q.num_rows == 14
    assert c["input"] == c["accepted"] + c["quarantined"] + c["duplicates"]
    panes = tables.read_arrow(pipeline_name, "current")
    assert panes.column("value").type.equals(__import__("pyarrow").int64())  # a sum of integers stays an integer
    assert pc.sum(panes.column("value")).as_py() == 1 + 2 + 3 + 1 + 1


def test_rerun_is_skipped_and_files_are_taken_once(engine, tables, pipeline_name) -> None:
    settings, spark = engine
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "source": {"prefix": f"{pipeline_name}/"},
                               "watermark": {"policy": "processing_time", "lag": "0s"}})
    store = ObjectStore(settings)
    store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{ARRIVAL}-a.jsonl", (ev(1) + "\n").encode())
    first = run_batch(settings, spec, P, validate=True, spark=spark)
    assert not first.skipped and first.counts["accepted"] == 1
    assert first.quality.ok and "validation" in first.phases  # GX ran before the commit
    again = run_batch(settings, spec, P, spark=spark)  # an Airflow retry of the same interval
    assert again.skipped and again.batch == 1
    # The same file uploaded again under another name: its ids are deduplicated.
    store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{ARRIVAL}-a-copy.jsonl", (ev(1) + "\n").encode())
    second = run_batch(settings, spec, datetime(2026, 3, 1, 12, 10, tzinfo=UTC), spark=spark)
    assert second.counts["duplicates"] == 1 and second.counts["accepted"] == 0
    assert tables.read_arrow(pipeline_name, "panes").num_rows == 1
    assert tables.read_arrow(pipeline_name, "batches").num_rows == 2


@pytest.mark.parametrize("one_task", [False, True], ids=["plan", "one_task"])
def test_spark_rewrites_a_touched_current_partition_as_one_file(settings, tables, spark, pipeline_name,
                                                                 one_task) -> None:
    """Batch after batch, the Spark engine's copy-on-write of ``current`` (by the multi-stage plan, or in the one
    task of a small batch) leaves one file per (day, hour) partition: the partitions several batches touch do not
    gain a file per batch (their old rows were read file by file and written back as they came)."""
    spec_w = WorkloadSpec(events=4_000, keys=100, batches=4, seed=11)
    store = ObjectStore(settings)
    land(store, settings.bucket_landing, f"{pipeline_name}/", spec_w, generate(spec_w))
    spec = pipeline_from_dict({"name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"}, **SESSIONS,
                               "allowed_lateness": "1h"})
    chosen = settings.with_overrides(engine="spark", engine_local_below=0,
                                     engine_one_task_below=10**6 if one_task else 0)
    for b in range(spec_w.batches + 1):
        result = run_batch(chosen, spec, to_datetime(spec_w.start_us + (b + 1) * spec_w.interval_us), spark=spark)
        assert ("spark_task" in result.phases) == one_task
    current = tables.read_arrow(pipeline_name, "current", schema=pa.schema([]))
    batches: dict[tuple, set[int]] = {}
    for r in current.select(["window_end", "batch"]).to_pylist():
        batches.setdefault((r["window_end"].date().isoformat(), r["window_end"].hour), set()).add(r["batch"])
    assert any(len(b) > 1 for b in batches.values()), batches  # some partition was rewritten by a later batch
    actions = pa.table(tables.open(pipeline_name, "current").get_add_actions(flatten=True)).to_pylist()
    files = Counter((str(a["partition.window_end_day"]), int(a["partition.window_end_hour"])) for a in actions)
    assert set(files) == set(batches) and max(files.values()) == 1, files
