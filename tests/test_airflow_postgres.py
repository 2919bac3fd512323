"""The Airflow stack on PostgreSQL, the production metadata database (``airflow.db_url``).

The session's Airflow keeps its metadata in a real PostgreSQL (``tests/postgres_env.py``), so every scenario of
``tests/test_airflow_dagtest.py`` and ``tests/test_airflow_ui.py`` (backfills, reprocesses, a task SIGKILLed
mid-batch, the UI) runs on it. Here, what is PostgreSQL's own: the metadata is in it (not in a SQLite file), a
DAG run's Asset events land in its tables, a database URL that is wrong or a server that does not answer is one
line, and a component that dies is reported, not restarted (restarting is a workaround for SQLite's lock races,
``tests/test_airflow_sqlite.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import airflow_env
import pytest
from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.tables import Tables
from postgres_env import PG_USER, Postgres
from test_airflow_dagtest import STEP, T0

pytestmark = pytest.mark.slow

DAG_RUN = "afpgdag"


@pytest.fixture
def pg(postgres: Postgres | None) -> Postgres:
    """The session's PostgreSQL (skipped where it cannot run: no binaries and not root, who would install them)."""
    if postgres is None:
        pytest.skip("PostgreSQL's binaries (initdb, pg_ctl) are missing and this is not root: the session's Airflow "
                    "runs on SQLite (Debian: apt-get install -y postgresql)")
    return postgres


@pytest.fixture
def pg_stack(airflow_stack, pg: Postgres) -> tuple:
    """The session's stack, its metadata in the session's PostgreSQL."""
    return airflow_stack


def trigger_and_wait(stack, dag_id: str, run_id: str, run_after: datetime, conf: dict, timeout: float = 180) -> dict:
    """A manual run without a logical date (its batch is at ``run_after``), to its end; its final state."""
    token = stack.token()
    stack.api("PATCH", f"/dags/{dag_id}", {"is_paused": False}, token)
    stack.api("POST", f"/dags/{dag_id}/dagRuns", {
        "dag_run_id": run_id, "logical_date": None, "run_after": run_after.isoformat(), "conf": conf}, token)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}", token=token)
        if run["state"] in ("success", "failed"):
            return run
        time.sleep(1.0)
    raise AssertionError(f"run {run_id} of {dag_id} did not end in {timeout:.0f}s: {run}")


# -- the scenarios -----------------------------------------------------------------------------------
def test_a_wrong_or_unreachable_database_is_one_line(settings: Settings, pg: Postgres, tmp_path: Path) -> None:
    """Before ``airflow db migrate`` would fail into a log: the URL's form, the driver, the server, the database."""
    from millpond.orchestration.airflow_stack import AirflowStack, airflow_config, check_database
    from millpond.orchestration.processes import free_port

    closed = f"postgresql+psycopg2://{PG_USER}:s3cret@127.0.0.1:{free_port()}/airflow"
    cases = {
        closed: r"did not answer \(connection to server at .*Connection refused\): start it, create the database",
        pg.url("nope"): r"did not answer \(.*database \"nope\" does not exist\)",
        pg.url().replace("postgresql+psycopg2", "postgres"): r"knows no database 'postgres': write it as "
                                                                   r"postgresql\+psycopg2://",
        "localhost:5432": "is not a database URL",
    }
    for url, expected in cases.items():
        with pytest.raises(MillpondError, match=expected) as caught:
            check_database(url, timeout=5)
        assert "\n" not in str(caught.value) and "s3cret" not in str(caught.value)
        assert "airflow.db_url (MILLPOND_AIRFLOW_DB_URL)" in str(caught.value)
    check_database(pg.url())  # the running one
    # `make up`'s path: the stack says so before starting anything
    s = settings.with_overrides(home=tmp_path)
    stack = AirflowStack(s, dataclasses.replace(airflow_config(s), db_url=closed, port=free_port()))
    with pytest.raises(MillpondError, match="did not answer"):
        stack.start(timeout=30)
    assert not any(stack.pids().values())


def test_the_stack_keeps_its_metadata_in_postgresql(pg_stack, pg: Postgres) -> None:
    stack, _ = pg_stack
    assert stack.db_url == pg.url() and stack.database == pg.url()
    assert not (stack.home / "airflow.db").exists()  # no SQLite file next to it
    assert f"metadata database {pg.url()}" in stack.status()[0]
    tables = {r[0] for r in pg.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"dag_run", "task_instance", "backfill", "serialized_dag", "alembic_version"} <= tables
    dags = {r[0] for r in pg.query("SELECT dag_id FROM dag")}
    assert f"millpond_{airflow_env.PIPELINE}" in dags


def test_a_dag_run_runs_one_full_microbatch(pg_stack, pg: Postgres) -> None:
    """A manual run (the scheduler, the LocalExecutor, the task's XCom and Asset events, all on PostgreSQL), then
    the same batch again: a no-op that still succeeds."""
    from millpond.orchestration.backfill import Backfill
    from millpond.orchestration.dagfactory import TASK_ID

    stack, s = pg_stack
    dag_id = f"millpond_{DAG_RUN}"
    airflow_env.write_conf_dir(s.conf_dir, names=(airflow_env.PIPELINE, DAG_RUN))
    Backfill(s, DAG_RUN, T0, T0 + STEP, stack=stack).wait_for_dag()
    run = trigger_and_wait(stack, dag_id, "pg-first", T0 + STEP, {"demo": True})
    assert run["state"] == "success", run
    tables = Tables(s)
    batches = tables.read_arrow(DAG_RUN, "batches").to_pylist()
    assert len(batches) == 1 and batches[0]["processing_time"] == T0 + STEP and batches[0]["input"] > 0
    assert tables.read_arrow(DAG_RUN, "panes").num_rows > 0
    summary = stack.api("GET", f"/dags/{dag_id}/dagRuns/pg-first/taskInstances/{TASK_ID}/xcomEntries/return_value"
                               "?deserialize=true")["value"]
    assert summary["batch"] == 1 and summary["processing_time"] == "2026-01-05T12:05:00Z", summary
    rows = pg.query(f"SELECT a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                          f"WHERE e.source_dag_id = '{dag_id}' AND e.source_run_id = 'pg-first'")
    assert sorted(uri.rsplit("/", 1)[1] for uri, _ in rows) == ["batches", "current", "panes"], rows
    assert all((json.loads(extra) if isinstance(extra, str) else extra) ==
               {"processing_time": "2026-01-05T12:05:00Z", "batch": 1} for _, extra in rows), rows
    again = trigger_and_wait(stack, dag_id, "pg-again", T0 + STEP, {"demo": True})
    assert again["state"] == "success", again
    assert tables.read_arrow(DAG_RUN, "batches").num_rows == 1


def test_a_dead_component_is_reported_not_restarted(pg_stack) -> None:
    """Restarting a component that died is the embedded stack's answer to SQLite's lock races; on PostgreSQL a
    dead one is a fault: one line naming it, its log and `make up` (which starts it again, as here: the stack is
    the session's)."""
    stack, _ = pg_stack
    pid = stack.pids()["triggerer"]
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stack.pids()["triggerer"] is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(MillpondError, match=r"Airflow triggerer stopped .* see .*airflow-triggerer\.log, then run "
                                            r"`make up`"):
        stack.revive()
    assert stack.pids()["triggerer"] is None and stack.pids()["scheduler"] is not None
    assert stack.start() and all(stack.pids().values())  # `make up`'s start: only the triggerer, the rest ran on
