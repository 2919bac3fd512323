"""MillWheel's exactly-once on Delta: crashes at every commit boundary and at random moments, a vanishing store,
two concurrent runs. After recovery every table equals the one an uninterrupted run produced, on either engine:
the local engine's and the Spark engine's tables are the same (``tests/engines.py``). On Spark, a command is a
Spark Connect client of the session's server (``spark_connect``), as an Airflow task is, and what is killed is
that client; the in-process tests use the session's ``spark`` (a Connect client of that server in this
process)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from engines import ENGINES, ONE_TASK, assert_same, command_env, on, snapshot
from millpond.errors import LeaseLost, MillpondError, StoreUnreachable
from millpond.lake.tables import Tables
from millpond.orchestration.store import EmbeddedStore
from millpond.runtime import commits
from millpond.runtime.microbatch import committed_versions
from millpond.surface.replay import load_scenario_pipeline, read_events, replay

SCENARIO = Path(__file__).parent / "scenarios"
PIPELINE = SCENARIO / "exactly_once.yaml"
EVENTS = SCENARIO / "exactly_once.jsonl"
STEPS = ["ingest_log", "quarantine", "seen_ids", "late", "panes", "current", "windows", "batches"]


def _connect(request, engine: str):
    """The session's Connect server for a command on the Spark engine (started on first use); None on local."""
    return request.getfixturevalue("spark_connect") if engine == "spark" else None


def replay_cli(name: str, env_extra: dict[str, str], engine: str = "local",
               connect=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **command_env(engine, connect), "MILLPOND_RUN_ID": f"retry-of-{name}", **env_extra}
    return subprocess.run([sys.executable, "-m", "millpond", "replay", "--pipeline", str(PIPELINE), "--events",
                           str(EVENTS), "--name", name, "--out", os.devnull], capture_output=True, text=True,
                          env=env, timeout=300)


def ran_on(out: subprocess.CompletedProcess, engine: str) -> list[str]:
    """The batches' summary lines of a command that ran batches, each naming ``engine``."""
    lines = [line for line in out.stderr.splitlines() if " batch " in line and " @ " in line]
    assert lines and all(f"; engine {engine}" in line for line in lines), out.stderr[-2000:]
    return lines


@pytest.fixture(scope="module")
def reference(settings, tables) -> dict[str, list]:
    """The scenario's tables after an uninterrupted run on the local engine."""
    name = "eo_reference"
    spec = load_scenario_pipeline(PIPELINE, name)
    replay(on(settings, "local"), spec, read_events(EVENTS))
    snap = snapshot(tables, name)
    # The scenario exercises every kind of write in batch 3.
    assert snap["quarantine"] and snap["late"] and any("retraction" in r for r in snap["panes"])
    return snap


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_after_each_commit_then_rerun_converges(settings, tables, reference, step, engine, request) -> None:
    """SIGKILL right after each commit of batch 3 (no cleanup), then a rerun: the local engine's uninterrupted
    tables. On Spark each batch is one Spark task (``test_sigkill_at_random_points_then_retry_converges`` kills
    the multi-stage plan)."""
    connect = _connect(request, engine)
    name = f"eo_kill_{engine}_{step}"
    crashed = replay_cli(name, {"MILLPOND_CRASH_AFTER": step, "MILLPOND_CRASH_BATCH": "3"}, engine, connect)
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # killed mid-batch, no cleanup
    done = tables.read_arrow(name, "batches", schema=pa.schema([("batch", pa.int64())]))
    assert max(done.column("batch").to_pylist()) == (3 if step == "batches" else 2)
    rerun = replay_cli(name, {}, engine, connect)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    ran_on(rerun, engine)
    assert_same(reference, snapshot(tables, name), f"{engine}, killed after {step}")


#: a batch's client that logs its progress, line by line, on stdout (where the test kills it); on Spark, its
#: batch ``argv[4]`` runs as the multi-stage plan and the others as one task each
PROGRESS_CLIENT = """
import logging, sys
from millpond.config import load_settings
from millpond.runtime.engines import choose
from millpond.surface import replay as r
name, pipeline, events, plan_batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
log = logging.getLogger("millpond.batch")
log.setLevel(logging.INFO)
log.addHandler(logging.StreamHandler(sys.stdout))
settings, spark = choose(load_settings())
real, calls = r.run_batch, []
def run_batch(s, spec, *args, **kwargs):  # replay runs the batches in order, one call each
    calls.append(1)
    return real(s.with_overrides(engine_one_task_below=0 if len(calls) == plan_batch else 10**9), spec, *args,
                **kwargs)
r.run_batch = run_batch
r.replay(settings, r.load_scenario_pipeline(pipeline, name), r.read_events(events), spark=spark,
         log=lambda line: print(line, flush=True))
print("finished", flush=True)
import os  # exit as the CLI does (millpond/__main__.py): native runtimes can abort in their destructors at teardown
os._exit(0)
"""
#: where in batch 3 a kill comes: a seeded delay after its progress log says one of these (its reads and dedup;
#: its per-key step and writes: on Spark both are Spark jobs; its Delta commits)
KILL_AFTER = ("ingest started", "watermark done", "commit started")
SEED = int(os.environ.get("MILLPOND_KILL_SEED", "36"))


@pytest.mark.parametrize("engine", ENGINES)
def test_sigkill_at_random_points_then_retry_converges(settings, tables, reference, engine, request,
                                                       tmp_path) -> None:
    """The client of batch 3 SIGKILLed at random moments, three times over (in its reads, in its per-key step
    and writes, in its commits), each retry redoing the batch from its committed plan; the last one finishes
    with the local engine's uninterrupted tables. On Spark, batch 3 runs as the multi-stage plan (the others as
    one task each), and the first two kills come while a Spark job of it runs on the server: the client dies
    mid-job, the job's files are never committed. ``MILLPOND_KILL_SEED`` picks the moments."""
    connect = _connect(request, engine)
    rng = random.Random(f"{SEED}-{engine}")
    name = f"eo_random_{engine}"
    env = {**os.environ, **command_env(engine, connect), "MILLPOND_RUN_ID": f"retry-of-{name}",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", PROGRESS_CLIENT, name, str(PIPELINE), str(EVENTS), "3"]
    killed = []
    for n, trigger in enumerate(KILL_AFTER):
        # a Spark job's first moments are slower than the local engine's; the commits are as quick on both (a
        # kill 0.2 s after 'commit started' came once after batch 3 had committed whole)
        delay = rng.uniform(0.0, 0.2 if engine == "spark" and trigger != "commit started" else 0.05)
        errors = tmp_path / f"client-{n}.err"  # a file: a pipe nobody reads could stall the client
        if connect is not None:
            connect.last_job()  # the one listing of the server's jobs, while none of this client's runs
        with errors.open("w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            seen, last = [], None
            on_server = connect is not None and trigger != "commit started"
            for line in proc.stdout:
                seen.append(line.rstrip())
                if on_server and line.startswith(f"{name} batch 3: plan done"):
                    last = connect.last_job()  # before any job of batch 3 starts
                if line.startswith(f"{name} batch 3: {trigger}"):
                    break
            else:
                pytest.fail(f"no '{trigger}' in batch 3's progress: {seen[-20:]} {errors.read_text()[-2000:]}")
            time.sleep(delay)
            # on Spark, before the commits: at the first moment after that a job of the batch runs on the server
            in_job = connect.wait_for_a_job(last, 60.0) if on_server else None
            proc.kill()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            proc.stdout.close()
        assert proc.returncode == -9, f"the client ended before the kill ({trigger} + {delay:.3f}s): {seen[-5:]}"
        killed.append((trigger, round(delay, 3), in_job))
    if engine == "spark":  # the plan's jobs were running when their client died
        assert [j for _, _, j in killed] == [True, True, None], killed
    finished = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert finished.returncode == 0 and finished.stdout.rstrip().endswith("finished"), finished.stderr[-2000:]
    summaries = [line for line in finished.stdout.splitlines() if " batch " in line and " @ " in line]
    assert summaries and all(f"; engine {engine}" in line for line in summaries), summaries
    if engine == "spark":  # batch 3 (redone here) as the plan's Spark jobs, batch 4 as one task
        progress = {b: [line.split(": ", 1)[1] for line in finished.stdout.splitlines()
                        if line.startswith(f"{name} batch {b}: ")] for b in (3, 4)}
        if progress[3]:  # unless the last kill came after batch 3's commits (then the retry starts at batch 4)
            assert any(line.startswith("ingest started") and "spark" in line for line in progress[3]), progress
        assert [any(line.startswith("spark_task done") for line in progress[b]) for b in (3, 4)] == [False, True]
    assert_same(reference, snapshot(tables, name), f"{engine}, killed at {killed}")


@pytest.mark.parametrize("engine", ENGINES)
def test_store_stopped_mid_batch(tmp_path, monkeypatch, reference, engine, request) -> None:
    """The store vanishes between two commits: a clear error, readers see whole batches only, and the
    rerun after it returns converges to the same tables, the local engine's. On Spark: one task a batch."""
    from conftest import free_store_env
    from millpond.config import load_settings

    spark = request.getfixturevalue("spark") if engine == "spark" else None
    s = on(load_settings(env={**os.environ, **free_store_env(tmp_path)}), engine, ONE_TASK)
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
            replay(s, spec, events, spark=spark)
        store.start()
        monkeypatch.setattr(commits, "crash_point", real)
        # A reader pinned to the last committed batch sees batch 2 only, though batch 3's panes landed.
        versions = committed_versions(tables, "eo_store")
        pinned = tables.read_arrow("eo_store", "panes", version=versions["panes"])
        latest = tables.read_arrow("eo_store", "panes")
        assert set(pinned.column("batch").to_pylist()) == {1, 2}
        assert 3 in set(latest.column("batch").to_pylist())
        replay(s, spec, events, spark=spark)
        assert_same(reference, snapshot(tables, "eo_store"), engine)
    finally:
        store.stop()


def test_a_raw_store_error_at_the_batchs_boundary_says_unreachable(tmp_path, monkeypatch) -> None:
    """A delta-rs call outside ``Tables`` (a commit's worker thread, the Spark engine's client) can raise the
    store's own OSError unwrapped: with the store stopped, the batch still fails in the one line that says
    unreachable and what to do (CI saw "failed: OSError: Kernel error -> Generic S3 error" once, under load)."""
    from conftest import free_store_env
    from millpond.config import load_settings

    s = on(load_settings(env={**os.environ, **free_store_env(tmp_path)}), "local")
    store = EmbeddedStore(s)
    store.start()
    try:
        def stop_store(step: str, batch: int) -> None:
            if step == "panes" and batch == 2:
                store.stop()
                raise OSError("Kernel error -> Generic S3 error: Error performing GET "
                              f"{s.s3_endpoint}/lake/x in 1ms - HTTP error: error sending request")

        monkeypatch.setattr(commits, "crash_point", stop_store)
        with pytest.raises(StoreUnreachable, match="unreachable.*make up"):
            replay(s, load_scenario_pipeline(PIPELINE, "eo_raw"), read_events(EVENTS))
    finally:
        store.stop()


def _one_batch(settings, tmp_path: Path, name: str) -> Path:
    """A pipeline of the scenario's, its first event landed: its file, for `millpond batch`."""
    import yaml
    from millpond.lake.objectstore import ObjectStore

    conf = tmp_path / f"{name}.yaml"
    doc = yaml.safe_load(PIPELINE.read_text())
    conf.write_text(yaml.safe_dump({**doc, "name": name, "source": {"prefix": f"{name}/"}}))
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{name}/arrival=20260101T120000Z-a.jsonl",
                                    EVENTS.read_bytes().splitlines(keepends=True)[0])
    return conf


ONE_BATCH_AT = "2026-01-01T12:01:00Z"


@pytest.fixture(scope="module")
def one_batch_reference(settings, tables, tmp_path_factory) -> dict[str, list]:
    """That batch's tables, run once on the local engine."""
    from millpond.config.pipelines import pipeline_named
    from millpond.runtime.job import run_batch

    conf = _one_batch(settings, tmp_path_factory.mktemp("once"), "eo_once_reference")
    run_batch(on(settings, "local"), pipeline_named(settings.conf_dir, str(conf)), ONE_BATCH_AT)
    return snapshot(tables, "eo_once_reference")


@pytest.mark.parametrize("engine", ENGINES)
def test_two_runs_at_once_exactly_one_commits(settings, tables, pipeline_name, tmp_path, one_batch_reference,
                                              engine, request) -> None:
    """Two processes run the same batch: one holds the lease and commits, the other stops clearly; the tables
    are one run's, the local engine's. On Spark both are Connect clients, the batch one Spark task."""
    connect = _connect(request, engine)
    conf = _one_batch(settings, tmp_path, pipeline_name)
    cmd = [sys.executable, "-m", "millpond", "batch", str(conf), "--at", ONE_BATCH_AT]
    env = {k: v for k, v in os.environ.items() if k != "MILLPOND_RUN_ID"} | command_env(engine, connect, ONE_TASK)
    slow = subprocess.Popen(cmd, env={**env, "MILLPOND_PAUSE_AFTER": "ingest_log", "MILLPOND_PAUSE_S": "8"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and tables.read_arrow(
            pipeline_name, "ingest_log", schema=pa.schema([("batch", pa.int64())])).num_rows == 0:
        time.sleep(0.2)  # the first run holds the lease and has written its plan
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out, err = slow.communicate(timeout=120)
    assert slow.returncode == 0, err[-2000:]
    assert f"; engine {engine}" in out, out
    assert second.returncode == 1
    message = second.stderr.strip()
    assert "\n" not in message and "is being run by" in message and "stops without writing" in message
    assert tables.read_arrow(pipeline_name, "batches").num_rows == 1
    assert tables.read_arrow(pipeline_name, "ingest_log").num_rows == 1
    assert tables.read_arrow(pipeline_name, "panes").num_rows == 1  # applied once
    assert_same(one_batch_reference, snapshot(tables, pipeline_name), engine)


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
