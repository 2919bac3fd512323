"""The pipeline DAGs run real micro-batches: in-process ``dag.test()`` and a backfill on a running Airflow.

A backfill of three intervals must leave the same tables as three live runs of those intervals
(the engine is deterministic and idempotent, and demo events depend only on pipeline and interval).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import airflow_env
import pyarrow as pa
import pytest
from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.tables import Tables
from millpond.orchestration.backfill import Backfill

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
STEP = timedelta(minutes=5)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def conf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return airflow_env.write_conf_dir(tmp_path_factory.mktemp("conf"))


def get_dag(conf_dir: Path, monkeypatch: pytest.MonkeyPatch, table_root: str):
    """The pipeline's DAG parsed from the real dags/ folder, its tasks writing under ``table_root``."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("MILLPOND_CONF_DIR", str(conf_dir))
    monkeypatch.setenv("MILLPOND_TABLE_ROOT", table_root)
    monkeypatch.setenv("MILLPOND_ENGINE", "local")  # in-process: the Spark engine's DAG runs are test_lineage's
    airflow_env.reset_db()
    bag = DagBag(dag_folder=str(airflow_env.DAGS))
    assert bag.import_errors == {}
    return bag.dags[f"millpond_{airflow_env.PIPELINE}"]


def task_log_lines(settings: Settings) -> list[str]:
    """The millpond lines of the stack's task logs (named in a failed assertion: what each run did)."""
    from millpond.orchestration.airflow_stack import airflow_home

    found = []
    for log in sorted((airflow_home(settings) / "logs").rglob("*.log")):
        found += [f"{log.parent.parent.name}/{log.name}: {line[:300]}" for line in log.read_text().splitlines()
                  if "millpond" in line and ("rewound" in line or "batch" in line or "skipp" in line)]
    return found


def run_interval(dag, start: datetime, **conf) -> dict:
    """One live run of the interval [start, start + 5m) in-process; the task states by id.

    ``dag.test`` makes a manual run, whose data interval is the one *ending* at its logical date.
    """
    dr = dag.test(logical_date=start + STEP, run_conf={"demo": True, **conf})
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert str(dr.state) == "success", states
    return states


def sorted_rows(table: pa.Table, drop: tuple[str, ...] = ()) -> list[dict]:
    cols = [c for c in table.column_names if c not in drop]
    rows = table.select(cols).to_pylist()
    return sorted(rows, key=lambda r: tuple(str(r[c]) for c in cols))


def test_dag_test_runs_one_full_microbatch(settings: Settings, conf_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dag = get_dag(conf_dir, monkeypatch, "tables_dagtest")
    states = run_interval(dag, T0)
    assert set(states.values()) == {"success"}
    tables = Tables(settings.with_overrides(table_root="tables_dagtest"))
    batches = tables.read_arrow(airflow_env.PIPELINE, "batches").to_pylist()
    assert len(batches) == 1
    assert batches[0]["processing_time"] == T0 + STEP  # processing time = data_interval_end
    assert batches[0]["input"] > 0
    assert tables.read_arrow(airflow_env.PIPELINE, "panes").num_rows > 0
    # Re-running the same interval is a no-op (idempotent batch), and the run still succeeds.
    run_interval(dag, T0)
    assert tables.read_arrow(airflow_env.PIPELINE, "batches").num_rows == 1


def test_a_reprocess_run_done_again_keeps_the_batches_after_it(settings: Settings, conf_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs triggered with ``reprocess: true`` (from the UI: no reprocess name in their conf). The first rewinds
    to before its interval and redoes its batch; the next finds nothing later to rewind and redoes its own, and
    live runs still wait for the rest. The first done again with its run id (an Airflow retry after its batch
    committed, or the run cleared) finds its rewind recorded, rewinds nothing and skips: the next run's batch
    stays. (It used to rewind again, taking that batch away while live runs waited for the reprocess.)"""
    from millpond.runtime import catchup

    dag = get_dag(conf_dir, monkeypatch, "tables_rerun")
    tables = Tables(settings.with_overrides(table_root="tables_rerun"))
    p = airflow_env.PIPELINE
    for i in range(4):
        run_interval(dag, T0 + i * STEP)
    first_run_after = datetime.now(UTC)

    def reprocess_run(start: datetime, run_after: datetime) -> None:
        # ``dag.test`` with the same logical date and run_after: the same run id, as a retry or a clear keeps it
        dr = dag.test(logical_date=start + STEP, run_after=run_after, run_conf={"demo": True, "reprocess": True})
        assert str(dr.state) == "success"

    reprocess_run(T0 + STEP, first_run_after)
    reprocess_run(T0 + 2 * STEP, datetime.now(UTC))
    # the second found nothing to rewind: live runs still wait for the reprocess to redo the fourth interval
    assert "catching up" in catchup.catching_up(tables, p)
    names = ("batches", "panes", "current", "windows", "seen_ids")
    before = {t: sorted_rows(tables.read_arrow(p, t)) for t in names}
    assert len(before["batches"]) == 3
    reprocess_run(T0 + STEP, first_run_after)  # the first, done again
    assert {t: sorted_rows(tables.read_arrow(p, t)) for t in names} == before
    ops = [json.loads(o["detail"]) for o in tables.read_arrow(p, "operations").sort_by("at").to_pylist()
           if o["operation"] == "reprocess"]
    assert [bool(o.get("noop")) for o in ops] == [False, True] and all(o["id"].startswith(dag.dag_id) for o in ops)


def test_a_data_docs_upload_failure_keeps_the_committed_batch(settings: Settings, conf_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The one task uploads the Data Docs after the batch committed: a reports bucket that refuses the upload
    is a warning, and the run still succeeds with the batch committed and its Assets' events sent (with the
    batch's processing time, what a stage downstream runs at)."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from millpond.orchestration.dagfactory import TASK_ID

    dag = get_dag(conf_dir, monkeypatch, "tables_docsfail")
    monkeypatch.setenv("MILLPOND_BUCKET_REPORTS", "no-such-reports-bucket")
    dr = dag.test(logical_date=T0 + STEP, run_conf={"demo": True})
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert str(dr.state) == "success" and states == {TASK_ID: "success"}, states
    batches = Tables(settings.with_overrides(table_root="tables_docsfail")).read_arrow(airflow_env.PIPELINE, "batches")
    assert batches.num_rows == 1 and batches.column("input").to_pylist()[0] > 0
    with create_session() as session:
        events = [(e.asset.uri.rsplit("/", 1)[1], dict(e.extra or {}))
                  for e in session.query(AssetEvent).filter(AssetEvent.source_run_id == dr.run_id)]
    assert sorted(table for table, _ in events) == ["batches", "current", "panes"], events
    assert all(extra == {"processing_time": "2026-01-05T12:05:00Z", "batch": 1} for _, extra in events), events


def test_dry_run_param_writes_nothing(settings: Settings, conf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dag = get_dag(conf_dir, monkeypatch, "tables_dryrun")
    run_interval(dag, T0, dry_run=True)
    assert not Tables(settings.with_overrides(table_root="tables_dryrun")).exists(airflow_env.PIPELINE, "batches")


def test_backfill_equals_live_runs(settings: Settings, conf_dir: Path, airflow_stack,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from millpond.orchestration.backfill import Backfill

    stack, stack_settings = airflow_stack
    # Three live runs, in-process.
    dag = get_dag(conf_dir, monkeypatch, "tables_live")
    for i in range(3):
        run_interval(dag, T0 + i * STEP)
    # The same three intervals as one backfill on the running Airflow (its own landing bucket and tables).
    lines: list[str] = []
    states = Backfill(stack_settings, airflow_env.PIPELINE, T0, T0 + 3 * STEP, stack=stack,
                      conf={"demo": True}).run(timeout=400, echo=lines.append)
    assert sorted(states.values()) == ["success"] * 3, lines
    assert any("3/3 batches done" in line for line in lines), lines
    assert sum("events in" in line for line in lines) == 3, lines

    live = Tables(settings.with_overrides(table_root="tables_live"))
    backfilled = Tables(stack_settings)
    p = airflow_env.PIPELINE
    for name in ("panes", "current", "windows", "late"):
        assert live.exists(p, name) == backfilled.exists(p, name), name
        if live.exists(p, name):
            a, b = sorted_rows(live.read_arrow(p, name)), sorted_rows(backfilled.read_arrow(p, name))
            assert a == b, (name, len(a), len(b), [r for r in a if r not in b][:3], [r for r in b if r not in a][:3])
    timing_free = ("phases", "engine", "strategy")
    a = sorted_rows(live.read_arrow(p, "batches"), drop=timing_free)
    b = sorted_rows(backfilled.read_arrow(p, "batches"), drop=timing_free)
    assert [r["processing_time"] for r in a] == [T0 + (i + 1) * STEP for i in range(3)]
    assert a == b, (a, b)

    # A reprocess from the second interval's start, TO before the last batch: the tables are rewound to
    # batch 1 (new commits), Airflow redoes the completed runs on to batch 3, and the result is the same.
    lines.clear()
    states = Backfill(stack_settings, p, T0 + STEP, T0 + 2 * STEP, reprocess="completed", stack=stack).run(
        timeout=400, echo=lines.append)
    assert sorted(states.values()) == ["success"] * 2, lines
    assert any("rewound to batch 1" in line for line in lines), lines
    done = [(r["batch"], r["processing_time"], r["files"], r["input"], r["panes"])
            for r in backfilled.read_arrow(p, "batches").to_pylist()]
    for name in ("panes", "current", "windows", "late"):
        if live.exists(p, name):
            a, b = sorted_rows(live.read_arrow(p, name)), sorted_rows(backfilled.read_arrow(p, name))
            assert a == b, (name, len(a), len(b), done, lines, task_log_lines(stack_settings))
    versionless = timing_free + ("versions",)  # table versions moved on: the rewind's restores are commits too
    assert sorted_rows(backfilled.read_arrow(p, "batches"), drop=versionless) == \
        sorted_rows(live.read_arrow(p, "batches"), drop=versionless)
    ops = backfilled.read_arrow(p, "operations").sort_by("at").to_pylist()
    assert [o["operation"] for o in ops] == ["backfill", "backfill ended", "reprocess", "backfill ended"]
    assert json.loads(ops[2]["detail"])["last_batch"] == 3
    assert any(h.get("operation") == "RESTORE" for h in backfilled.history(p, "windows"))

    # Airflow can accept a reprocess's backfill without queueing its runs again (on SQLite, a create it refused
    # half-way): the old runs' success is not the reprocess's. The backfill is made again and redoes them ...
    lines.clear()
    states = Unqueued(stack_settings, p, T0 + STEP, T0 + 2 * STEP, reprocess="completed", stack=stack,
                      unqueued=1).run(timeout=400, echo=lines.append)
    assert sorted(states.values()) == ["success"] * 2, lines
    assert any("ended without running 2 of its runs again" in line for line in lines), lines
    for name in ("panes", "current", "windows", "late"):
        if live.exists(p, name):
            assert sorted_rows(live.read_arrow(p, name)) == sorted_rows(backfilled.read_arrow(p, name)), (name, lines)
    # ... and when Airflow never runs them, the reprocess fails in one line naming the batches not redone.
    with pytest.raises(MillpondError, match=r"did not redo 2 of its 2 batches \(2026-01-05T12:10:00Z to "
                                            r"2026-01-05T12:15:00Z\).*run the same reprocess again"):
        Unqueued(stack_settings, p, T0 + STEP, T0 + 2 * STEP, reprocess="completed", stack=stack,
                 unqueued=3).run(timeout=400, echo=lines.append)
    # A run that had failed (marked so here) is left alone by a plain backfill, which says so and how to redo it
    # (not "see the task logs" of a failure older than it); a backfill with reprocess "failed" redoes it.
    plain = Backfill(stack_settings, p, T0 + STEP, T0 + 2 * STEP, stack=stack)
    (run,) = plain.runs()
    plain.api("PATCH", f"/dags/{plain.dag_id}/dagRuns/{quote(run['dag_run_id'], safe='')}", {"state": "failed"})
    with pytest.raises(MillpondError, match=r"1 of the range's runs of millpond_afpipe had failed before this "
                                            r"backfill.*backfill with --reprocess failed"):
        plain.run(timeout=400, echo=lines.append)
    states = Backfill(stack_settings, p, T0 + STEP, T0 + 2 * STEP, reprocess="failed", stack=stack).run(
        timeout=400, echo=lines.append)
    assert states == {run["dag_run_id"]: "success"}, lines
    assert T0 + 2 * STEP in backfilled.read_arrow(p, "batches").column("processing_time").to_pylist()


class Unqueued(Backfill):
    """A backfill Airflow makes without queueing its existing runs again for its first ``unqueued`` creates
    (they are asked with ``reprocess_behavior: none``): what a create it refused half-way can leave."""

    def __init__(self, *args, unqueued: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.left, self.unqueue = unqueued, False

    def create(self, attempts: int = 6) -> dict:
        self.unqueue, self.left = self.left > 0, self.left - 1
        return super().create(attempts)

    def body(self) -> dict:
        body = super().body()
        return {**body, "reprocess_behavior": "none"} if self.unqueue else body


def test_a_backfill_airflow_removed_is_named_as_gone(airflow_stack) -> None:
    """A backfill id Airflow no longer knows (on SQLite it cleans up a create it refused half-way, after the id
    was handed out) ends the wait with ``BackfillGone``, on which the backfill is created again."""
    from millpond.orchestration.backfill import Backfill, BackfillGone

    stack, s = airflow_stack
    backfill = Backfill(s, airflow_env.PIPELINE, T0, T0 + STEP, stack=stack)
    with pytest.raises(BackfillGone, match="backfill 999999 .* is gone from Airflow"):
        backfill.wait(999999, timeout=60, echo=lambda _: None)


def test_millpond_run_catches_up_through_one_backfill(airflow_stack, capsys: pytest.CaptureFixture) -> None:
    """`make run`'s catch-up on a running stack (`millpond run`): a pipeline's recent intervals are one Backfill,
    with the steps of `millpond backfill` (made again when Airflow leaves it unrun, the runs that had failed
    before named, its batches checked committed), and its DAG, paused, is unpaused once the backfill is made."""
    from millpond.config.pipelines import load_pipelines
    from millpond.model.timeutil import to_us
    from millpond.surface.run import recent_intervals, run_via_airflow

    stack, s = airflow_stack
    name = "afrun"
    airflow_env.write_conf_dir(s.conf_dir, names=(airflow_env.PIPELINE, name))
    spec = load_pipelines(s.conf_dir)[name]
    dag = Backfill(s, name, T0, T0 + STEP, stack=stack)  # its API client
    dag.wait_for_dag()
    # as the shipped settings make a new DAG: paused, no run yet (this stack's DAGs start unpaused, and make a
    # scheduled run, which does nothing here: see the test below)
    dag.api("PATCH", f"/dags/{dag.dag_id}", {"is_paused": True})
    deadline = time.monotonic() + 180
    while (runs := dag.api("GET", f"/dags/{dag.dag_id}/dagRuns?limit=50")["dag_runs"]) and any(
            r["state"] in ("queued", "running") for r in runs) and time.monotonic() < deadline:
        time.sleep(1.0)  # a run is deleted once it has ended
    for run in runs:
        path = f"/dags/{dag.dag_id}/dagRuns/{quote(run['dag_run_id'])}"
        if run["state"] in ("queued", "running"):  # still not ended on a loaded box (CI): ended here, as failed
            dag.api("PATCH", path, {"state": "failed"})
        dag.api("DELETE", path)
    before = [to_us(end) for _, end in recent_intervals(spec, 2)]
    try:
        run_via_airflow(s, [spec], 2)
    except MillpondError as exc:
        raise AssertionError(f"{exc}; task logs: {[line for line in task_log_lines(s) if name in line]}") from exc
    after = [to_us(end) for _, end in recent_intervals(spec, 2)]
    done = sorted(to_us(t) for t in Tables(s).read_arrow(name, "batches").column("processing_time").to_pylist())
    assert done in (before, after), (done, before, after)
    assert dag.api("GET", f"/dags/{dag.dag_id}")["is_paused"] is False
    runs = dag.api("GET", f"/dags/{dag.dag_id}/dagRuns?limit=20")["dag_runs"]  # the schedule has carried on too
    assert sorted(r["state"] for r in runs if r["run_type"] == "backfill") == ["success"] * 2, runs
    assert "2/2 batches done" in capsys.readouterr().out


def test_a_plain_backfill_redoes_a_run_that_succeeded_without_its_batch(airflow_stack) -> None:
    """A scheduled run while ``airflow.scheduled_runs`` is off succeeds and commits nothing. A plain backfill
    leaves the range's ended runs as they are, so its interval stayed uncommitted whatever backfill ran: now the
    backfill has Airflow redo the range's ended runs (reprocess "completed"; a committed batch skips) and says so,
    whether it finds such a run as it is made or once its runs ended (a live run held while it ran)."""
    from millpond.model.timeutil import to_us

    stack, s = airflow_stack
    names = ("afidle", "aflate")
    airflow_env.write_conf_dir(s.conf_dir, names=(airflow_env.PIPELINE, *names))
    ends = {}
    for name in names:
        probe = Backfill(s, name, T0, T0 + STEP, stack=stack)  # its API client
        probe.wait_for_dag()
        deadline = time.monotonic() + 180  # unpaused at creation: the scheduler makes the newest interval's run
        while not (idle := [r for r in probe.api("GET", f"/dags/{probe.dag_id}/dagRuns?limit=50")["dag_runs"]
                            if r["run_type"] == "scheduled" and r["state"] == "success"]):
            assert time.monotonic() < deadline, f"the scheduler made no scheduled run of {probe.dag_id}"
            time.sleep(2.0)
        ends[name] = datetime.fromisoformat(idle[0]["data_interval_end"].replace("Z", "+00:00"))
        assert not Tables(s).exists(name, "batches")  # it did nothing
    for name, kind in zip(names, (Backfill, SeesIdleLate), strict=True):
        lines: list[str] = []
        try:
            states = kind(s, name, ends[name] - 2 * STEP, ends[name], stack=stack, conf={"demo": True}).run(
                timeout=400, echo=lines.append)
        except MillpondError as exc:
            raise AssertionError(f"{name}: {exc}; {lines}") from exc
        assert sorted(states.values()) == ["success"] * 2, (name, lines)
        assert sum(f"1 of the range's runs of millpond_{name} had succeeded without committing a batch" in line
                   for line in lines) == 1, (name, lines)
        done = sorted(to_us(t) for t in Tables(s).read_arrow(name, "batches").column("processing_time").to_pylist())
        assert done == [to_us(ends[name] - STEP), to_us(ends[name])], (name, lines)


class SeesIdleLate(Backfill):
    """A backfill made before the range's idle run had ended: it finds that run only once its own runs ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0

    def redo_idle_runs(self, echo=print) -> bool:
        self.checks += 1
        return self.checks > 1 and super().redo_idle_runs(echo)


def test_an_upstream_batch_triggers_its_stage_through_its_asset(airflow_stack) -> None:
    """Data-aware scheduling: a stage's DAG is scheduled by its upstream's panes Asset; each upstream batch
    that committed publishes the Asset with its processing time, and the stage runs at that time."""
    import yaml
    from millpond.model.timeutil import to_us
    from millpond.orchestration.backfill import Backfill

    stack, s = airflow_stack
    up, stage = "afup", "afstage"
    airflow_env.write_conf_dir(s.conf_dir, names=(airflow_env.PIPELINE, up))
    (s.conf_dir / "pipelines" / f"{stage}.yaml").write_text(yaml.safe_dump({
        "name": stage, "source": {"pipeline": up, "stream": "panes", "key": "all", "event_time": "window_start"},
        "value_type": "int", "window": {"type": "fixed", "size": "1h"},
        "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))", "accumulation": "accumulating",
        "aggregation": "sum", "allowed_lateness": "1d", "batch_interval": "5m"}))
    waiter = Backfill(s, stage, T0, T0 + STEP, stack=stack)
    waiter.wait_for_dag()
    Backfill(s, up, T0, T0 + STEP, stack=stack).wait_for_dag()
    time.sleep(12)  # the scheduler's asset clean-up pass (every 5 s here) activates the new Assets
    assert Backfill(s, up, T0, T0 + 2 * STEP, stack=stack, conf={"demo": True}).run(timeout=400)
    tables, last = Tables(s), to_us(T0 + 2 * STEP)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        done = tables.read_arrow(stage, "batches").column("processing_time").to_pylist() \
            if tables.exists(stage, "batches") else []
        if last in {to_us(t) for t in done}:
            break
        time.sleep(3)
    else:
        runs = waiter.api("GET", f"/dags/millpond_{stage}/dagRuns?limit=50")["dag_runs"]
        events = waiter.api("GET", "/assets/events?limit=50")
        raise AssertionError(f"no stage batch at the upstream's last processing time: {done}; stage runs {runs}; "
                             f"asset events {events}")
    runs = waiter.api("GET", f"/dags/millpond_{stage}/dagRuns?limit=50")["dag_runs"]
    triggered = [r for r in runs if "asset" in r["run_type"]]
    assert triggered and all(r["state"] in ("success", "running", "queued") for r in triggered), runs
    assert {to_us(t) for t in done} <= {to_us(T0 + STEP), last}  # the upstream's processing times
    total = sum(r["value"] for r in tables.read_arrow(up, "current").to_pylist())
    assert total and sum(r["value"] for r in tables.read_arrow(stage, "current").to_pylist()) == total


def test_a_task_killed_mid_batch_is_retried_and_commits(airflow_stack) -> None:
    """Issue 22: SIGKILL the task's process in the middle of a batch (its plan committed, its outputs not):
    Airflow's first retry takes the lease back at once (the lease's owner is the DAG run) and commits, and
    the tables equal an uninterrupted run's."""
    import yaml
    from millpond.model.spec import pipeline_from_dict
    from millpond.runtime.job import run_batch

    stack, s = airflow_stack
    name = "afkill"
    airflow_env.write_conf_dir(s.conf_dir, names=(airflow_env.PIPELINE, name))
    path = s.conf_dir / "pipelines" / f"{name}.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["demo"]["events_per_batch"] = 150_000  # a batch of a few seconds: long enough to be killed in
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    backfill, killed, outcome = airflow_env.kill_mid_batch(stack, s, name, T0, T0 + STEP)
    tables = Tables(s)
    # an uninterrupted run of the same files into another table root
    reference = s.with_overrides(table_root="tables_killref")
    run_batch(reference, pipeline_from_dict(doc), T0 + STEP)
    ref = Tables(reference)
    for table in ("panes", "current", "windows", "late", "quarantine", "seen_ids"):
        if ref.exists(name, table) or tables.exists(name, table):
            assert sorted_rows(tables.read_arrow(name, table)) == sorted_rows(ref.read_arrow(name, table)), table
    drop = ("phases", "versions", "engine", "strategy")
    assert sorted_rows(tables.read_arrow(name, "batches"), drop) == sorted_rows(ref.read_arrow(name, "batches"), drop)
