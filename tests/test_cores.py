"""Every way to run the per-key step gives the same tables: one process, forked workers, with and without
windows formed on columns, and Spark."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, iso, to_datetime, to_us
from millpond.runtime import cores, layout
from millpond.runtime.engines import spark_batch
from millpond.runtime.job import run_batch
from millpond.runtime.steps.dedup import SEEN_FOLD_OVER_FILES
from session_specs import SESSIONS

from bench.workload import WorkloadSpec, generate, land

pytestmark = pytest.mark.skipif(not cores.can_fork(), reason="forked workers are Linux-only")


def test_ranges_are_contiguous_and_balanced() -> None:
    assert cores.ranges([1] * 10, 2) == [(0, 5), (5, 10)]
    assert cores.ranges([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]  # by weight, not by count
    assert cores.ranges([1, 1], 5) == [(0, 1), (1, 2)]  # never an empty range
    assert cores.ranges([], 3) == []


def test_ranges_run_in_other_processes_and_come_back_in_order() -> None:
    out = cores.map_ranges(lambda lo, hi: (os.getpid(), lo, hi), [1] * 9, workers=2, min_range=3)
    assert [(lo, hi) for _, lo, hi in out] == [(0, 3), (3, 6), (6, 9)]
    assert out[0][0] == os.getpid() and len({pid for pid, _, _ in out}) == 3
    # too little work for a fork: one range, here
    assert cores.map_ranges(lambda lo, hi: (os.getpid(), lo, hi), [1] * 9, workers=2, min_range=10) == [
        (os.getpid(), 0, 9)]


def test_the_caller_is_told_before_a_fork_and_only_then() -> None:
    """The job waits for its own background threads (the batch's upkeep step) before forking workers."""
    told: list[int] = []
    cores.map_ranges(lambda lo, hi: hi, [1] * 9, workers=2, min_range=3, before_fork=lambda: told.append(1))
    assert told == [1]
    cores.map_ranges(lambda lo, hi: hi, [1] * 9, workers=2, min_range=10, before_fork=lambda: told.append(2))
    assert told == [1]  # no fork, no wait


def test_a_dead_worker_s_range_runs_in_the_job() -> None:
    def work(lo: int, hi: int) -> tuple[int, int, int]:
        if lo and os.getpid() != parent:
            os._exit(9)  # killed mid-range, as the kernel's OOM killer would
        return os.getpid(), lo, hi

    parent = os.getpid()
    assert cores.map_ranges(work, [1] * 4, workers=1, min_range=1) == [(parent, 0, 2), (parent, 2, 4)]


def test_a_worker_error_reaches_the_job() -> None:
    def work(lo: int, hi: int) -> int:
        if lo:
            raise ValueError(f"bad key range {lo}..{hi}")
        return hi

    with pytest.raises(ValueError, match="bad key range 2..4"):
        cores.map_ranges(work, [1] * 4, workers=1, min_range=1)


def _count_calls(monkeypatch, owner, name: str, measure) -> list[int]:
    """Wrap ``owner.name``; the returned list gets ``measure(result)`` of every call."""
    seen: list[int] = []
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(measure(out))
        return out

    monkeypatch.setattr(owner, name, counting)
    return seen


def _tables(tables, name: str) -> dict[str, list]:
    out = {}
    for table in ("panes", "current", "windows", "late", "seen_ids", "batches"):
        t = tables.read_arrow(name, table, schema=pa.schema([]))
        t = t.drop([c for c in ("phases", "versions", "engine", "strategy") if c in t.column_names])
        out[table] = sorted(repr(sorted(r.items())) for r in t.to_pylist())
    return out


def test_forked_per_key_step_matches_one_process(settings, tables, pipeline_name, monkeypatch) -> None:
    spec_w = WorkloadSpec(events=12_000, keys=600, batches=3, seed=5)
    events = generate(spec_w)
    store = ObjectStore(settings)
    doc = {**SESSIONS, "allowed_lateness": "1h"}
    forks = _count_calls(monkeypatch, cores, "map_ranges", lambda out: len(out) - 1)
    names, forked = {}, {}
    for workers, min_range in ((0, settings.driver_min_range), (2, 500)):
        name = names[workers] = f"{pipeline_name}_w{workers}"
        land(store, settings.bucket_landing, f"{name}/", spec_w, events)
        spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"}, **doc})
        local = settings.with_overrides(engine="local", driver_workers=workers, driver_min_range=min_range)
        for b in range(spec_w.batches + 1):
            run_batch(local, spec, to_datetime(spec_w.start_us + (b + 1) * spec_w.interval_us))
        forked[workers] = sum(forks)
        forks.clear()
    assert forked[0] == 0 and forked[2] >= 2 * spec_w.batches  # each batch: this process and two forks
    one, split = (_tables(tables, names[w]) for w in (0, 2))
    assert one["panes"] and one["current"] and one["windows"]
    for table in one:
        assert [r.replace(names[0], "P") for r in one[table]] == [r.replace(names[2], "P") for r in split[table]], table


def test_spark_and_element_paths_match_the_driver_path(settings, tables, spark, pipeline_name, monkeypatch) -> None:
    """Three batches and a flush of a Zipf stream with duplicates and late data (keys with and without
    stored windows, late elements) through the driver path, the driver path without windows formed on
    columns (the element path, its reference), Spark's multi-stage plan, and the Spark engine's one task."""
    spec_w = WorkloadSpec(events=6_000, keys=400, batches=3, seed=9)
    events = generate(spec_w)
    store = ObjectStore(settings)
    doc = {**SESSIONS, "allowed_lateness": "10m"}
    formed = _count_calls(monkeypatch, layout, "form_windows", lambda got: 0 if got is None else int(got[1].sum()))
    partitions = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "3")
    names, formed_by = {}, {}
    try:
        for path in ("driver", "element", "spark", "one_task"):
            name = names[path] = f"{pipeline_name}_{path}"
            land(store, settings.bucket_landing, f"{name}/", spec_w, events)
            spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"}, **doc})
            on_spark = path in ("spark", "one_task")
            chosen = settings.with_overrides(engine="spark" if on_spark else "local", engine_local_below=0,
                                             columnar_windows=path != "element", driver_workers=0,
                                             engine_one_task_below=10**6 if path == "one_task" else 0)
            for b in range(spec_w.batches + 1):
                result = run_batch(chosen, spec, to_datetime(spec_w.start_us + (b + 1) * spec_w.interval_us),
                                   spark=spark if on_spark else None)
                assert ("spark_task" in result.phases) == (path == "one_task")
            formed_by[path], formed[:] = sum(formed), []
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", partitions)
    assert formed_by["driver"] > 0 and formed_by["element"] == 0  # the columnar path ran, and only there
    driver = _tables(tables, names["driver"])
    assert driver["panes"] and driver["current"] and driver["late"]
    for path in ("element", "spark", "one_task"):
        other = _tables(tables, names[path])
        for table in driver:
            assert ([r.replace(names["driver"], "P") for r in driver[table]]
                    == [r.replace(names[path], "P") for r in other[table]]), (path, table)


def test_engines_taking_turns_on_one_pipeline_match_the_driver_path(settings, tables, spark, pipeline_name) -> None:
    """A pipeline whose batches alternate engines (local, Spark's plan, local, Spark's plan for the flush): each
    engine reads and replaces the other's ``windows`` files (the local engine's MERGE writes files of every key
    range, the Spark engine's file-by-file rewrite keeps and grows them, ``lake.spark_ranged``), and the tables
    equal a pipeline run on the driver path throughout."""
    spec_w = WorkloadSpec(events=6_000, keys=400, batches=3, seed=21)
    events = generate(spec_w)
    store = ObjectStore(settings)
    doc = {**SESSIONS, "allowed_lateness": "10m"}
    names = {}
    for path in ("driver", "turns"):
        name = names[path] = f"{pipeline_name}_{path}"
        land(store, settings.bucket_landing, f"{name}/", spec_w, events)
        spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"}, **doc})
        for b in range(spec_w.batches + 1):
            on_spark = path == "turns" and b % 2 == 1
            chosen = settings.with_overrides(engine="spark" if on_spark else "local", engine_local_below=0,
                                             engine_one_task_below=0, driver_workers=0)
            result = run_batch(chosen, spec, to_datetime(spec_w.start_us + (b + 1) * spec_w.interval_us),
                               spark=spark if on_spark else None)
            assert (result.engine or "").startswith("spark") == on_spark, result.engine
    driver, turns = _tables(tables, names["driver"]), _tables(tables, names["turns"])
    assert driver["windows"] and driver["panes"] and driver["late"]
    for table in driver:
        assert ([r.replace(names["driver"], "P") for r in driver[table]]
                == [r.replace(names["turns"], "P") for r in turns[table]]), table


T0 = to_us("2026-03-02T00:00:00Z")
MINUTE = 60 * US
#: batches of SESSIONS (every 5m, watermark 2m behind processing time; allowed lateness 10m: ids are kept for
#: 15m behind the input watermark). Record ``a`` comes first; five batches accept ids (seen_ids then has
#: SEEN_FOLD_OVER_FILES + 1 files, none folded yet; a quiet batch in between); then a quiet batch (no files, its
#: input watermark 13m past ``a``), a batch whose one file holds only a re-delivery (it reads a file and accepts
#: nothing), and ``a`` delivered again after them, with fresh records.
FRESH = (1, 2, 4, 5, 6, 9)
EXTRA = {1: [("a", "k0", T0 + MINUTE)],
         5: [("late5", "k1", T0 + 30 * US)],  # its session closed for good at T0 + 15m30s
         8: [("e6_0", "k0", T0 + 26 * MINUTE)],  # accepted by batch 6
         9: [("a", "k0", T0 + MINUTE)]}


def _landed(batch: int) -> list[tuple[str, str, int]]:
    """(id, key, event time) of the records of the batch's file (none: no file)."""
    at = T0 + batch * 5 * MINUTE
    fresh = [(f"e{batch}_{i}", f"k{i % 3}", at - 4 * MINUTE + i * 30 * US) for i in range(6)] if batch in FRESH else []
    return EXTRA.get(batch, []) + fresh


def _seen_history(tables, name: str) -> list[tuple[int, int | None, bool, list[str]]]:
    """seen_ids as each batch's marker names it: (batch, its version counted from the first batch's, whether
    the batch committed to it, its rows). (Counted: a table the Spark engine creates starts with an empty
    version 0, the local engine's first write is its version 0.)"""
    marks = sorted(tables.read_arrow(name, "batches", columns=["batch", "versions"]).to_pylist(),
                   key=lambda r: r["batch"])
    out, before, first = [], None, None
    for m in marks:
        version = json.loads(m["versions"])["seen_ids"]
        first = version if first is None else first
        rows = [] if version is None else tables.read_arrow(name, "seen_ids", version=version).to_pylist()
        out.append((m["batch"], None if version is None else version - first, version != before,
                    sorted(repr(sorted(r.items())) for r in rows)))
        before = version
    return out


PROBE_BELOW = spark_batch.SEEN_PROBE_BELOW


def test_quiet_batches_leave_seen_ids_alone_on_every_engine(settings, tables, spark, pipeline_name,
                                                            monkeypatch) -> None:
    """Issue 36: a batch that accepts nothing (no files, or only duplicates) writes nothing to seen_ids, so it
    folds nothing either, on the local engine, the Spark plan and the one task alike. The plan folded
    (expired ids) on such batches, so that ``a``, re-delivered after them, was a late row there and a
    duplicate on the local engine. The plan runs twice: its small batches' ids probing ``seen_ids``
    (``spark_batch.marked_firsts``), and, as a batch of SEEN_PROBE_BELOW rows or more does, the stored ids
    shuffled to the rows."""
    store = ObjectStore(settings)
    doc = {**SESSIONS, "allowed_lateness": "10m"}
    names, results = {}, {}

    def run(path: str) -> None:
        name = names[path] = f"{pipeline_name}_{path}"
        spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"}, **doc})
        monkeypatch.setattr(spark_batch, "SEEN_PROBE_BELOW", 0 if path == "shuffled" else PROBE_BELOW)
        chosen = settings.with_overrides(engine="local" if path == "local" else "spark", engine_local_below=0,
                                         driver_workers=0, engine_one_task_below=10**6 if path == "one_task" else 0)
        for b in range(1, 11):
            processing_time = T0 + b * 5 * MINUTE
            rows = _landed(b)
            if rows:
                body = "".join(json.dumps({"id": i, "key": k, "value": 1, "event_time": iso(t)}) + "\n"
                               for i, k, t in rows)
                store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(processing_time - 30 * US)}-{b}.jsonl",
                                body.encode())
            result = run_batch(chosen, spec, to_datetime(processing_time), spark=None if path == "local" else spark)
            assert ("spark_task" in result.phases) == (path == "one_task")
            results[path, b] = result.counts

    run("local")
    local = _tables(tables, names["local"])
    assert local["panes"] and local["current"] and local["late"]
    assert results["local", 8]["accepted"] == 0 and results["local", 8]["duplicates"] == 1
    # a's id, accepted by batch 1, is still remembered when it comes again: a duplicate, not a late row
    assert (results["local", 9]["duplicates"], results["local", 9]["late"]) == (1, 0)
    history = _seen_history(tables, names["local"])
    # nothing accepted, nothing written; batch 9 found SEEN_FOLD_OVER_FILES + 1 files and folded them
    assert [b for b, _, wrote, _ in history if wrote] == [1, 2, 4, 5, 6, 9]
    assert len([b for b, _, wrote, _ in history if wrote and b < 7]) == SEEN_FOLD_OVER_FILES + 1
    has_a = [any("('id', 'a')" in r for r in rows) for _, _, _, rows in history]
    assert has_a == [True] * 8 + [False] * 2  # expired by batch 9's fold, not before
    classes = ("input", "accepted", "duplicates", "late", "quarantined", "panes", "retractions")
    for path in ("spark", "shuffled", "one_task"):
        run(path)
        for b in range(1, 11):
            assert ({c: results[path, b][c] for c in classes}
                    == {c: results["local", b][c] for c in classes}), (path, b)
        assert [(b, v, wrote, [r.replace(names[path], "P") for r in rows]) for b, v, wrote, rows
                in _seen_history(tables, names[path])] == [
            (b, v, wrote, [r.replace(names["local"], "P") for r in rows]) for b, v, wrote, rows in history], path
        other = _tables(tables, names[path])
        for table in local:
            assert ([r.replace(names["local"], "P") for r in local[table]]
                    == [r.replace(names[path], "P") for r in other[table]]), (path, table)


def test_random_operations_on_the_spark_engine(settings, tables, spark, pipeline_name) -> None:
    """The randomised operations test (``tests/test_operations_random.py``), shorter, with the upstream's
    batches on the Spark engine's multi-stage plan: failures after each commit, retries at other times,
    reprocesses, stages (on the local engine) behind it; the same invariants, and the end equals a fresh run."""
    from test_operations_random import run_world

    chosen = settings.with_overrides(engine="spark", engine_local_below=0, engine_one_task_below=0)
    run_world(settings, tables, pipeline_name, seed=5, steps=int(os.environ.get("MILLPOND_OPS_SPARK_STEPS", "30")),
              spark=spark, up_settings=chosen)
