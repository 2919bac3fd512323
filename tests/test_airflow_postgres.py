"""The Airflow stack on PostgreSQL, the production metadata database (``airflow.db_url``).

A real PostgreSQL (Debian's binaries, ``initdb`` into a temporary folder, trust on 127.0.0.1 only, run as a
non-root user) holds the metadata of one four-process Airflow for the module, with its own home, landing and
reports buckets and table root beside the session's SQLite stack. On it run the SQLite stack's scenarios in
their smallest forms: a DAG run's full micro-batch (and its idempotent rerun), a backfill and a reprocess
equal to uninterrupted batches, and a task SIGKILLed mid-batch that Airflow's retry commits. A database URL
that is wrong or a server that does not answer is one line; a component that dies is reported, not restarted
(restarting is a workaround for SQLite's lock races only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import airflow_env
import pytest
import yaml
from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.tables import Tables
from test_airflow_dagtest import STEP, T0, sorted_rows

pytestmark = pytest.mark.slow

PG_USER = "millpond"  # the server's superuser (trust on 127.0.0.1 only)
BACKFILLED, DAG_RUN, KILLED = "afpgback", "afpgdag", "afpgkill"  # one pipeline per scenario
TABLE_ROOT = "tables_airflow_pg"


# -- a real PostgreSQL -------------------------------------------------------------------------------
def postgres_bin() -> Path | None:
    """The newest PostgreSQL's server binaries: Debian's ``/usr/lib/postgresql/<major>/bin``, else ``PATH``."""
    def major(pg_ctl: Path) -> int:
        name = pg_ctl.parent.parent.name
        return int(name) if name.isdigit() else -1

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=major)
    if found:
        return found[-1].parent
    which = shutil.which("pg_ctl")
    return Path(which).parent if which and shutil.which("initdb") else None


def server_account() -> dict:
    """How ``initdb`` and ``postgres`` run: as this user, or as root (which they refuse) as Debian's
    ``postgres`` account, made as a system user when missing; without root's groups."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"],
                       check=True, capture_output=True)
        entry = pwd.getpwnam("postgres")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@dataclasses.dataclass
class Postgres:
    """One PostgreSQL server in a folder of its own: data, unix socket and log."""

    bin: Path
    base: Path
    port: int
    account: dict

    @property
    def data(self) -> Path:
        return self.base / "data"

    def url(self, database: str = "airflow") -> str:
        return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                              cwd=self.base, **self.account)
        if done.returncode != 0:
            log = self.base / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stdout}{done.stderr}{tail}")
        return done

    @classmethod
    def start(cls, bin_dir: Path) -> Postgres:
        from millpond.orchestration.processes import free_port

        account = server_account()
        base = Path(tempfile.mkdtemp(prefix="millpond-pg-"))
        if account:
            os.chown(base, account["user"], account["group"])
        server = cls(bin_dir, base, free_port(), account)
        server.run(str(bin_dir / "initdb"), "-D", str(server.data), "-U", PG_USER, "-E", "UTF8", "--locale=C",
                   "--auth=trust", "--no-sync")
        sockets = base / "sockets"
        server.run("mkdir", "-m", "0700", str(sockets))
        with open(server.data / "postgresql.conf", "a") as conf:  # appended: the file keeps its owner
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {server.port}\n"
                       f"unix_socket_directories = '{sockets}'\nmax_connections = 200\n"
                       # a test's throw-away data: no flushes to wait for
                       "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")
        # trust on loopback TCP only; the socket (in a folder only the server's user can enter) for that user
        (server.data / "pg_hba.conf").write_text("local all all peer\nhost all all 127.0.0.1/32 trust\n")
        server.run(str(bin_dir / "pg_ctl"), "-D", str(server.data), "-l", str(base / "server.log"), "-w", "-t", "60",
                   "start")
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=server.port, user=PG_USER, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("CREATE DATABASE airflow")
        finally:
            conn.close()
        return server

    def query(self, sql: str, database: str = "airflow") -> list[tuple]:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=PG_USER, dbname=database)
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall()
        finally:
            conn.close()

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self.run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        finally:
            pid_file = self.data / "postmaster.pid"
            if pid_file.exists():  # it did not stop in time: the server this fixture started, by its own pid
                try:
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        hint = "install PostgreSQL (Debian: apt-get install -y postgresql; .ci/run and `make test` do as root)"
        if os.geteuid() == 0:
            pytest.fail(f"PostgreSQL's binaries (initdb, pg_ctl) are missing: {hint}")
        pytest.skip(f"PostgreSQL's binaries (initdb, pg_ctl) are missing and this is not root: {hint}")
    server = Postgres.start(bin_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pg_stack(settings: Settings, postgres: Postgres) -> Iterator[tuple]:
    """The module's Airflow on PostgreSQL: its own home (PID files, logs), buckets and table root, so that it
    runs beside the session's SQLite stack; the three scenarios' pipelines known from the start."""
    home = Path(tempfile.mkdtemp(prefix="millpond-airflow-pg-"))
    conf = airflow_env.write_conf_dir(home / "conf", names=(BACKFILLED, DAG_RUN, KILLED))
    killed = conf / "pipelines" / f"{KILLED}.yaml"
    doc = yaml.safe_load(killed.read_text())
    doc["demo"]["events_per_batch"] = 150_000  # a batch of a few seconds: long enough to be killed in
    killed.write_text(yaml.safe_dump(doc, sort_keys=False))
    stack, stack_settings = airflow_env.start_test_stack(
        conf, MILLPOND_HOME=str(home), MILLPOND_AIRFLOW_DB_URL=postgres.url(), MILLPOND_TABLE_ROOT=TABLE_ROOT,
        MILLPOND_BUCKET_LANDING="landing-airflow-pg", MILLPOND_BUCKET_REPORTS="reports-airflow-pg")
    try:
        yield stack, stack_settings
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)


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


def assert_same_tables(tables: Tables, reference: Tables, name: str,
                       drop: tuple[str, ...] = ("phases", "engine", "strategy")) -> None:
    for table in ("panes", "current", "windows", "late", "quarantine", "seen_ids"):
        assert tables.exists(name, table) == reference.exists(name, table), table
        if reference.exists(name, table):
            a, b = sorted_rows(tables.read_arrow(name, table)), sorted_rows(reference.read_arrow(name, table))
            assert a == b, (table, len(a), len(b), [r for r in a if r not in b][:3], [r for r in b if r not in a][:3])
    assert sorted_rows(tables.read_arrow(name, "batches"), drop) == sorted_rows(reference.read_arrow(name, "batches"),
                                                                                drop)


# -- the scenarios -----------------------------------------------------------------------------------
def test_a_wrong_or_unreachable_database_is_one_line(settings: Settings, postgres: Postgres,
                                                     tmp_path: Path) -> None:
    """Before ``airflow db migrate`` would fail into a log: the URL's form, the driver, the server, the database."""
    from millpond.orchestration.airflow_stack import AirflowStack, airflow_config, check_database
    from millpond.orchestration.processes import free_port

    closed = f"postgresql+psycopg2://{PG_USER}:s3cret@127.0.0.1:{free_port()}/airflow"
    cases = {
        closed: r"did not answer \(connection to server at .*Connection refused\): start it, create the database",
        postgres.url("nope"): r"did not answer \(.*database \"nope\" does not exist\)",
        postgres.url().replace("postgresql+psycopg2", "postgres"): r"knows no database 'postgres': write it as "
                                                                   r"postgresql\+psycopg2://",
        "localhost:5432": "is not a database URL",
    }
    for url, expected in cases.items():
        with pytest.raises(MillpondError, match=expected) as caught:
            check_database(url, timeout=5)
        assert "\n" not in str(caught.value) and "s3cret" not in str(caught.value)
        assert "airflow.db_url (MILLPOND_AIRFLOW_DB_URL)" in str(caught.value)
    check_database(postgres.url())  # the running one
    # `make up`'s path: the stack says so before starting anything
    s = settings.with_overrides(home=tmp_path)
    stack = AirflowStack(s, dataclasses.replace(airflow_config(s), db_url=closed, port=free_port()))
    with pytest.raises(MillpondError, match="did not answer"):
        stack.start(timeout=30)
    assert not any(stack.pids().values())


def test_the_stack_keeps_its_metadata_in_postgresql(pg_stack, postgres: Postgres) -> None:
    stack, _ = pg_stack
    assert stack.db_url == postgres.url() and stack.database == postgres.url()
    assert not (stack.home / "airflow.db").exists()  # no SQLite file next to it
    assert f"metadata database {postgres.url()}" in stack.status()[0]
    tables = {r[0] for r in postgres.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"dag_run", "task_instance", "backfill", "serialized_dag", "alembic_version"} <= tables
    dags = {r[0] for r in postgres.query("SELECT dag_id FROM dag")}
    assert {f"millpond_{n}" for n in (BACKFILLED, DAG_RUN, KILLED)} <= dags


def test_a_dag_run_runs_one_full_microbatch(pg_stack, postgres: Postgres) -> None:
    """A manual run (the scheduler, the LocalExecutor, the task's XCom and Asset events, all on PostgreSQL), then
    the same batch again: a no-op that still succeeds."""
    from millpond.orchestration.backfill import Backfill
    from millpond.orchestration.dagfactory import TASK_ID

    stack, s = pg_stack
    dag_id = f"millpond_{DAG_RUN}"
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
    rows = postgres.query(f"SELECT a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                          f"WHERE e.source_dag_id = '{dag_id}' AND e.source_run_id = 'pg-first'")
    assert sorted(uri.rsplit("/", 1)[1] for uri, _ in rows) == ["batches", "current", "panes"], rows
    assert all((json.loads(extra) if isinstance(extra, str) else extra) ==
               {"processing_time": "2026-01-05T12:05:00Z", "batch": 1} for _, extra in rows), rows
    again = trigger_and_wait(stack, dag_id, "pg-again", T0 + STEP, {"demo": True})
    assert again["state"] == "success", again
    assert tables.read_arrow(DAG_RUN, "batches").num_rows == 1


def test_backfill_and_reprocess_equal_uninterrupted_batches(pg_stack) -> None:
    """Two intervals backfilled through Airflow, then the second reprocessed (rewound to batch 1 and redone):
    both times the tables equal the same batches run in-process without Airflow."""
    from millpond.orchestration.backfill import Backfill
    from millpond.orchestration.dagfactory import load_spec
    from millpond.runtime.job import run_batch

    stack, s = pg_stack
    lines: list[str] = []
    states = Backfill(s, BACKFILLED, T0, T0 + 2 * STEP, stack=stack, conf={"demo": True}).run(
        timeout=400, echo=lines.append)
    assert sorted(states.values()) == ["success"] * 2, lines
    assert any("2/2 batches done" in line for line in lines) and sum("events in" in ln for ln in lines) == 2, lines
    reference = s.with_overrides(table_root="tables_airflow_pg_ref")  # the landed files, batch by batch
    for i in (1, 2):
        run_batch(reference, load_spec(s, BACKFILLED), T0 + i * STEP)
    tables, ref = Tables(s), Tables(reference)
    assert [r["processing_time"] for r in sorted_rows(tables.read_arrow(BACKFILLED, "batches"))] == \
        [T0 + STEP, T0 + 2 * STEP]
    assert_same_tables(tables, ref, BACKFILLED)

    lines.clear()
    states = Backfill(s, BACKFILLED, T0 + STEP, T0 + 2 * STEP, reprocess="completed", stack=stack).run(
        timeout=400, echo=lines.append)
    assert sorted(states.values()) == ["success"], lines
    assert any("rewound to batch 1" in line for line in lines), lines
    # the rewind's restores are commits
    assert_same_tables(tables, ref, BACKFILLED, drop=("phases", "versions", "engine", "strategy"))
    ops = tables.read_arrow(BACKFILLED, "operations").sort_by("at").to_pylist()
    assert [o["operation"] for o in ops] == ["backfill", "backfill ended", "reprocess", "backfill ended"]
    assert any(h.get("operation") == "RESTORE" for h in tables.history(BACKFILLED, "windows"))


def test_a_task_killed_mid_batch_is_retried_and_commits(pg_stack) -> None:
    """Issue 22 on PostgreSQL: SIGKILL the task's process mid-batch (its plan committed, its outputs not); Airflow's
    retry takes the lease back and commits, and the tables equal an uninterrupted run's."""
    from millpond.orchestration.dagfactory import load_spec
    from millpond.runtime.job import run_batch

    stack, s = pg_stack
    backfill, killed, outcome = airflow_env.kill_mid_batch(stack, s, KILLED, T0, T0 + STEP)
    tables = Tables(s)
    reference = s.with_overrides(table_root="tables_airflow_pg_killref")
    run_batch(reference, load_spec(s, KILLED), T0 + STEP)
    assert_same_tables(tables, Tables(reference), KILLED, drop=("phases", "versions", "engine", "strategy"))


def test_a_dead_component_is_reported_not_restarted(pg_stack) -> None:
    """Restarting a component that died is the embedded stack's answer to SQLite's lock races; on PostgreSQL a
    dead one is a fault: one line naming it, its log and `make up`. (Last: it leaves the triggerer down.)"""
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
