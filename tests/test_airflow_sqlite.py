"""The embedded default's Airflow: its metadata in SQLite under the home (``make up`` without ``airflow.db_url``).

The session's Airflow runs on PostgreSQL (``tests/conftest.py``); this module's stack is SQLite's, with its own
home, landing and reports buckets and table root. SQLite's scheduler exits on some lock races and Airflow expects
a supervisor: the stack restarts what died (and only that), and a backfill runs through to its batches.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import airflow_env
import pytest
from millpond.lake.tables import Tables
from millpond.orchestration.backfill import Backfill
from test_airflow_dagtest import STEP, T0

pytestmark = pytest.mark.slow

NAME = "afsqlite"


@pytest.fixture(scope="module")
def airflow_stack(settings) -> Iterator[tuple]:
    """This module's stack on SQLite (named as the session's fixture, which it stands in for here)."""
    home = Path(tempfile.mkdtemp(prefix="millpond-airflow-sqlite-"))
    conf = airflow_env.write_conf_dir(home / "conf", names=(airflow_env.PIPELINE, NAME))
    stack, stack_settings = airflow_env.start_test_stack(
        conf, MILLPOND_HOME=str(home), MILLPOND_TABLE_ROOT="tables_airflow_sqlite",
        MILLPOND_BUCKET_LANDING="landing-airflow-sqlite", MILLPOND_BUCKET_REPORTS="reports-airflow-sqlite")
    try:
        yield stack, stack_settings
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_the_stack_keeps_its_metadata_in_sqlite_and_backfills(airflow_stack) -> None:
    """The embedded default: one SQLite file under the home; a two-interval backfill commits both batches."""
    stack, s = airflow_stack
    assert stack.database == f"SQLite {stack.home / 'airflow.db'}" and (stack.home / "airflow.db").exists()
    lines: list[str] = []
    states = Backfill(s, NAME, T0, T0 + 2 * STEP, stack=stack, conf={"demo": True}).run(timeout=400,
                                                                                        echo=lines.append)
    assert sorted(states.values()) == ["success"] * 2, lines
    done = sorted(Tables(s).read_arrow(NAME, "batches").column("processing_time").to_pylist())
    assert done == [T0 + STEP, T0 + 2 * STEP], lines


def test_a_dead_scheduler_is_restarted(airflow_stack) -> None:
    """Airflow's scheduler exits on some SQLite races and expects a supervisor: the embedded stack is its own
    (a backfill revives dead components while it waits; on PostgreSQL it names them instead)."""
    stack, _ = airflow_stack
    pid = stack.pids()["scheduler"]
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stack.pids()["scheduler"] is not None and time.monotonic() < deadline:  # a zombie counts as dead
        time.sleep(0.2)
    assert stack.pids()["scheduler"] is None and not stack.running()
    assert stack.revive() == ["scheduler"]
    assert stack.running() and stack.pids()["scheduler"] != pid
    assert stack.revive() == []  # nothing more to do


def test_a_revive_waits_for_what_it_restarted_and_stops_only_that(airflow_stack) -> None:
    """A revive restarts the dead components and waits for their health, not for a live one's heartbeat: a
    triggerer that lags (here frozen until its heartbeat is stale) while the scheduler is restarted is not the
    revive's to fix, and the stack stays up. Before, the revive waited its whole start timeout for the triggerer,
    then stopped every component, so the tests after it found nothing listening."""
    stack, _ = airflow_stack
    triggerer = stack.pids()["triggerer"]
    assert triggerer is not None
    os.killpg(triggerer, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 120  # the heartbeat is stale after 30 s
        while stack.health()["triggerer"].get("status") == "healthy" and time.monotonic() < deadline:
            time.sleep(1.0)
        assert stack.health()["triggerer"].get("status") != "healthy"
        os.killpg(stack.pids()["scheduler"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while stack.pids()["scheduler"] is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        t = time.monotonic()
        assert stack.revive() == ["scheduler"]
        assert time.monotonic() - t < 120 and stack.running()
    finally:
        os.killpg(triggerer, signal.SIGCONT)
    stack.wait_healthy(120)  # the triggerer's next heartbeat: the stack whole again for the tests after
