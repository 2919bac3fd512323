"""A frozen object store fails the batch within ``object_store.timeout``, in one line naming the store, and
leaves no thread behind; once the store answers again, the rerun converges to an uninterrupted run's tables.

The store is a SeaweedFS server of the test's own, paused with SIGSTOP (it keeps accepting connections and
answers nothing: the case a timeout on connecting does not catch) at the moment the batch's progress log
says a step started. Also: the progress log names each step of a batch as it starts and ends. On either engine
(``tests/engines.py``): on Spark (the session's ``spark``, a Connect client), frozen in its reads the batch is the
multi-stage plan (the other batches one task each), whose executors wait on the store; frozen in its commits,
one Spark task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import free_store_env
from engines import ENGINES, ONE_TASK, assert_same, on, plan_only_for, snapshot
from millpond.config import load_settings
from millpond.errors import StoreUnreachable
from millpond.lake.tables import Tables
from millpond.orchestration.processes import read_pid
from millpond.orchestration.store import EmbeddedStore
from millpond.surface.replay import load_scenario_pipeline, read_events, replay

pytestmark = pytest.mark.slow

SCENARIO = Path(__file__).parent / "scenarios"
PIPELINE, EVENTS = SCENARIO / "exactly_once.yaml", SCENARIO / "exactly_once.jsonl"
TIMEOUT_S = 5.0
#: a frozen store's batch fails in about one store wait, plus the lease's brief release and a noisy machine
BOUND_S = 4 * TIMEOUT_S + 20


def wait_stopped(pgid: int, timeout: float = 10.0) -> None:
    """Return once every thread of every process in the group is stopped. A SIGSTOP takes effect when the
    thread that takes it is next scheduled: on a busy machine the store's other threads can answer a request
    or two meanwhile, and the batch would get past the step the test meant to freeze."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a thread that just ended
            if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
                states.append(fields[0])
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"the store (process group {pgid}) did not stop within {timeout:.0f}s")


class Freezer(logging.Handler):
    """Pauses the store (SIGSTOP to its process group) when the batch logs ``trigger``, and returns once it
    is stopped; keeps every line."""

    def __init__(self, pid: int, trigger: str) -> None:
        super().__init__(logging.INFO)
        self.pid, self.trigger = pid, trigger
        self.frozen_at: float | None = None
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.frozen_at is None and self.trigger in line:
            os.killpg(self.pid, signal.SIGSTOP)
            self.frozen_at = time.monotonic()
            wait_stopped(self.pid)

    def thaw(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def frozen_env(tmp_path_factory):
    """Settings with a short store wait, on a store of the module's own (the suite's must not freeze)."""
    home = tmp_path_factory.mktemp("bounded")
    s = load_settings(env={**os.environ, **free_store_env(home), "MILLPOND_S3_TIMEOUT": f"{TIMEOUT_S:.0f}s",
                           "MILLPOND_ENGINE": "local", "MILLPOND_DRIVER_WORKERS": "0"})
    store = EmbeddedStore(s)
    store.start()
    try:
        yield s, store
    finally:
        pid = read_pid(store.pidfile)
        if pid is not None:
            os.killpg(pid, signal.SIGCONT)  # never stop a paused server: it could not exit
        store.stop()


@pytest.fixture(scope="module")
def reference(frozen_env) -> dict[str, list]:
    """The local engine's tables, the store answering throughout."""
    s, _ = frozen_env
    replay(on(s, "local"), load_scenario_pipeline(PIPELINE, "bw_reference"), read_events(EVENTS))
    return snapshot(Tables(s), "bw_reference")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("step", ["ingest", "commit"])
def test_a_frozen_store_fails_the_batch_in_time_and_the_rerun_converges(frozen_env, reference, step, engine,
                                                                        request) -> None:
    spark = request.getfixturevalue("spark") if engine == "spark" else None
    s, store = frozen_env
    s = on(s, engine, ONE_TASK)
    strategy = plan_only_for(3) if engine == "spark" and step == "ingest" else contextlib.nullcontext()
    name = f"bw_{step}_{engine}"
    spec, events = load_scenario_pipeline(PIPELINE, name), read_events(EVENTS)
    freezer = Freezer(read_pid(store.pidfile), f"{name} batch 3: {step} started")
    logger = logging.getLogger("millpond.batch")
    level, threads = logger.level, {t.ident for t in threading.enumerate()}
    logger.setLevel(logging.INFO)
    logger.addHandler(freezer)
    try:
        with pytest.raises(StoreUnreachable) as failed, strategy:
            replay(s, spec, events, spark=spark)
        took = time.monotonic() - freezer.frozen_at
        # Every thread the batch started has ended (they wait on the store no longer than it does).
        deadline = time.monotonic() + TIMEOUT_S
        while {t.ident for t in threading.enumerate()} - threads and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [t.name for t in threading.enumerate() if t.ident not in threads]
    finally:
        freezer.thaw()
        logger.removeHandler(freezer)
        logger.setLevel(level)
    message = str(failed.value)
    assert took < BOUND_S, f"the batch failed {took:.1f}s after the store froze: {message}"
    assert "\n" not in message and s.s3_endpoint in message and f"within {TIMEOUT_S:.0f}s" in message, message
    assert "make status" in message and "object_store.timeout" in message, message
    assert not left, f"threads still running after the batch failed: {left}"
    # The task log said where the batch was: each step's start and end, up to the one the store froze in.
    batch3 = [line.split(": ", 1)[1] for line in freezer.lines if line.startswith(f"{name} batch 3: ")]
    read = ("ingest done", "spark_task done")  # one Spark task's reads are its task's
    assert batch3[0].startswith("plan done") and any(line.startswith(read) for line in batch3) == (
        step != "ingest"), batch3
    assert batch3[-1].startswith(f"{step} "), batch3  # started, or how far it got
    if engine == "spark":  # frozen in its reads: the plan's Spark jobs; in its commits: after its one task
        assert any(line.startswith("ingest started") and "spark" in line for line in batch3), batch3
        assert any(line.startswith("spark_task done") for line in batch3) == (step != "ingest"), batch3

    with plan_only_for(3) if engine == "spark" and step == "ingest" else contextlib.nullcontext():
        replay(s, spec, events, spark=spark)  # the store answers again: the same batch, from its committed plan or anew
    assert_same(reference, snapshot(Tables(s), name), engine)
