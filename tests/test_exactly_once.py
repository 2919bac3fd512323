"""MillWheel's exactly-once on Delta: crashes at every commit boundary, a vanishing store, two
concurrent runs. After recovery every table equals the one an uninterrupted run produced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from millpond.errors import LeaseLost, MillpondError
from millpond.lake.schemas import OUTPUT_TABLES
from millpond.lake.tables import Tables
from millpond.orchestration.store import EmbeddedStore
from millpond.runtime import commits
from millpond.runtime.microbatch import committed_versions
from millpond.surface.replay import load_scenario_pipeline, read_events, replay

SCENARIO = Path(__file__).parent / "scenarios"
PIPELINE = SCENARIO / "exactly_once.yaml"
EVENTS = SCENARIO / "exactly_once.jsonl"
TABLES = (*OUTPUT_TABLES, "batches")
STEPS = ["ingest_log", "quarantine", "seen_ids", "late", "panes", "current", "windows", "batches"]


def snapshot(tables: Tables, pipeline: str) -> dict[str, list]:
    """Every table's rows, order-free, without timings (the only non-deterministic column)."""
    out = {}
    for name in TABLES:
        t = tables.read_arrow(pipeline, name, schema=pa.schema([]))
        if "phases" in t.column_names:
            t = t.drop(["phases"])
        out[name] = sorted(repr(sorted(r.items())).replace(pipeline, "<pipeline>") for r in t.to_pylist())
    return out


def replay_cli(name: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "MILLPOND_RUN_ID": f"retry-of-{name}", **env_extra}
    return subprocess.run([sys.executable, "-m", "millpond", "replay", "--pipeline", str(PIPELINE), "--events",
                           str(EVENTS), "--name", name, "--out", os.devnull], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def reference(settings, tables) -> dict[str, list]:
    name = "eo_reference"
    spec = load_scenario_pipeline(PIPELINE, name)
    replay(settings, spec, read_events(EVENTS))
    snap = snapshot(tables, name)
    # The scenario exercises every kind of write in batch 3.
    assert snap["quarantine"] and snap["late"] and any("retraction" in r for r in snap["panes"])
    return snap


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_after_each_commit_then_rerun_converges(settings, tables, reference, step) -> None:
    name = f"eo_kill_{step}"
    crashed = replay_cli(name, {"MILLPOND_CRASH_AFTER": step, "MILLPOND_CRASH_BATCH": "3"})
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # killed mid-batch, no cleanup
    done = tables.read_arrow(name, "batches", schema=pa.schema([("batch", pa.int64())]))
    assert max(done.column("batch").to_pylist()) == (3 if step == "batches" else 2)
    rerun = replay_cli(name, {})
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert snapshot(tables, name) == reference


def test_store_stopped_mid_batch(tmp_path, monkeypatch, reference) -> None:
    """The store vanishes between two commits: a clear error, readers see whole batches only, and the
    rerun after it returns converges to the same tables."""
    from conftest import free_store_env
    from millpond.config import load_settings

    s = load_settings(env={**os.environ, **free_store_env(tmp_path)})
    store = EmbeddedStore(s)
    store.start()
    try:
        tables = Tables(s)
        spec = load_scenario_pipeline(PIPELINE, "eo_store")
        events = read_events(EVENTS)
        real = commits.crash_point

        def stop_store(step: str, batch: int) -> None:
            if step == "panes" and batch == 3:
                store.stop()

        monkeypatch.setattr(commits, "crash_point", stop_store)
        with pytest.raises(MillpondError, match="unreachable"):
            replay(s, spec, events)
        store.start()
        monkeypatch.setattr(commits, "crash_point", real)
        # A reader pinned to the last committed batch sees batch 2 only, though batch 3's panes landed.
        versions = committed_versions(tables, "eo_store")
        pinned = tables.read_arrow("eo_store", "panes", version=versions["panes"])
        latest = tables.read_arrow("eo_store", "panes")
        assert set(pinned.column("batch").to_pylist()) == {1, 2}
        assert 3 in set(latest.column("batch").to_pylist())
        replay(s, spec, events)
        assert snapshot(tables, "eo_store") == reference
    finally:
        store.stop()


def test_two_runs_at_once_exactly_one_commits(settings, tables, pipeline_name, tmp_path) -> None:
    """Two processes run the same batch: one holds the lease and commits, the other stops clearly."""
    import time

    import yaml

    conf = tmp_path / "p.yaml"
    doc = yaml.safe_load(PIPELINE.read_text())
    conf.write_text(yaml.safe_dump({**doc, "name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"}}))
    from millpond.lake.objectstore import ObjectStore

    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{pipeline_name}/arrival=20260101T120000Z-a.jsonl",
                                    EVENTS.read_bytes().splitlines(keepends=True)[0])
    cmd = [sys.executable, "-m", "millpond", "batch", str(conf), "--at", "2026-01-01T12:01:00Z"]
    env = {k: v for k, v in os.environ.items() if k != "MILLPOND_RUN_ID"}
    slow = subprocess.Popen(cmd, env={**env, "MILLPOND_PAUSE_AFTER": "ingest_log", "MILLPOND_PAUSE_S": "8"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and tables.read_arrow(
            pipeline_name, "ingest_log", schema=pa.schema([("batch", pa.int64())])).num_rows == 0:
        time.sleep(0.2)  # the first run holds the lease and has written its plan
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out, err = slow.communicate(timeout=120)
    assert slow.returncode == 0, err[-2000:]
    assert second.returncode == 1
    message = second.stderr.strip()
    assert "\n" not in message and "is being run by" in message and "stops without writing" in message
    assert tables.read_arrow(pipeline_name, "batches").num_rows == 1
    assert tables.read_arrow(pipeline_name, "ingest_log").num_rows == 1
    assert tables.read_arrow(pipeline_name, "panes").num_rows == 1  # applied once


def test_zombie_loses_its_lease(settings, pipeline_name) -> None:
    """A run whose lease was taken over (it paused too long) cannot commit: the token fences it."""
    from millpond.lake.lease import Lease

    old = Lease.acquire(settings, pipeline_name, owner="zombie", ttl_s=0.0)
    new = Lease.acquire(settings, pipeline_name, owner="successor")
    assert new.token == old.token + 1
    new.check()
    with pytest.raises(LeaseLost, match="lease lost to successor"):
        old.check()


def test_a_renewed_lease_outlives_its_ttl_and_fences_a_takeover(settings, pipeline_name) -> None:
    """A batch that renews its lease is never taken over, however long it runs; a plain rerun waits for
    a lapsed owner's lease at most one TTL; the token fences the older holder."""
    import time

    from millpond.errors import LeaseLost as Lost
    from millpond.lake.lease import Lease

    held = Lease.acquire(settings, pipeline_name, owner="long-batch", ttl_s=1.5)
    with held.keep() as keeper:
        time.sleep(3.5)  # more than two TTLs: only renewals keep it
        with pytest.raises(Lost, match="is being run by long-batch"):
            Lease.acquire(settings, pipeline_name, owner="intruder", ttl_s=1.5)
        keeper.check()
    start = time.monotonic()
    taken = Lease.acquire(settings, pipeline_name, owner="next-run", ttl_s=1.5, wait=True)
    assert time.monotonic() - start <= 2.5  # waited for the lapse, not longer
    assert taken.token == held.token + 1
    with pytest.raises(Lost):
        held.check()
    with pytest.raises(Lost):
        held.renew()
    taken.release()
