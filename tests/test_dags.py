"""The DAG folder parses cleanly and gives every pipeline file the same, correct DAG shape."""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import airflow_env  # noqa: F401  (configures Airflow before it is imported)
import pytest
import yaml
from millpond.config import DEFAULT_CONF_DIR, load_settings
from millpond.orchestration import dagfactory
from millpond.orchestration.backfill import align, parse_time

TASKS = [dagfactory.TASK_ID]


def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(airflow_env.DAGS))


def pipeline_names(conf_dir: Path) -> set[str]:
    return {yaml.safe_load(p.read_text())["name"] for p in (conf_dir / "pipelines").glob("*.yaml")}


@pytest.fixture
def conf_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conf dir (the shipped millpond.yaml, our own pipeline files)."""
    (tmp_path / "pipelines").mkdir()
    shutil.copy(DEFAULT_CONF_DIR / "millpond.yaml", tmp_path / "millpond.yaml")
    monkeypatch.setenv("MILLPOND_CONF_DIR", str(tmp_path))
    return tmp_path


def test_dag_folder_imports_one_dag_per_shipped_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MILLPOND_CONF_DIR", raising=False)
    started = time.perf_counter()
    bag = dagbag()
    elapsed = time.perf_counter() - started
    assert bag.import_errors == {}
    expected = {f"millpond_{n}" for n in pipeline_names(DEFAULT_CONF_DIR)}
    assert set(bag.dag_ids) == expected
    assert elapsed < 15, f"DAG parsing took {elapsed:.1f}s: keep heavy imports inside the tasks"


def test_dag_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import CronDataIntervalTimetable, DeltaDataIntervalTimetable

    monkeypatch.delenv("MILLPOND_CONF_DIR", raising=False)
    bag = dagbag()
    settings = load_settings()
    assert bag.dags, "no pipelines shipped in conf/pipelines"
    for dag_id, dag in bag.dags.items():
        name = dag_id.removeprefix("millpond_")
        timetable = getattr(dag.timetable, "timetable", dag.timetable)  # a stage's: assets or time
        assert isinstance(timetable, (CronDataIntervalTimetable, DeltaDataIntervalTimetable))
        if name == "video_watch_hourly":  # the upstream's panes asset triggers the stage
            assert "video_sessions/panes" in repr(dag.timetable.asset_condition)
        assert dag.max_active_runs == 1
        assert dag.catchup is False
        assert [t.task_id for t in dag.topological_sort()] == TASKS  # one task: one process start per run
        assert all(t.retries >= 1 for t in dag.tasks)  # safe: a batch is idempotent
        assert all(t.execution_timeout == timedelta(seconds=settings.airflow_task_timeout_s) for t in dag.tasks)
        assert {"dry_run", "demo", "reprocess", "watermark_lag_override"} <= set(dag.params)
        uris = {a.uri for a in dag.get_task(dagfactory.TASK_ID).outlets}
        assert f"s3://{settings.bucket_lake}/{settings.table_root}/{name}/panes" in uris


def test_timetable_gives_real_aligned_intervals() -> None:
    from airflow.sdk import CronDataIntervalTimetable, DeltaDataIntervalTimetable

    five = dagfactory.timetable_for(timedelta(minutes=5))
    assert isinstance(five, CronDataIntervalTimetable) and five.expression == "*/5 * * * *"
    assert dagfactory.timetable_for(timedelta(hours=2)).expression == "0 */2 * * *"
    assert dagfactory.timetable_for(timedelta(days=1)).expression == "0 0 * * *"
    assert isinstance(dagfactory.timetable_for(timedelta(seconds=90)), DeltaDataIntervalTimetable)
    assert isinstance(dagfactory.timetable_for(timedelta(minutes=7)), DeltaDataIntervalTimetable)


def test_each_pipeline_file_gets_a_dag_and_a_broken_one_is_skipped(conf_dir: Path) -> None:
    base = yaml.safe_load((DEFAULT_CONF_DIR / "pipelines" / "video_sessions.yaml").read_text())
    for name, interval in (("alpha", "5m"), ("beta", "1h")):
        (conf_dir / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump({**base, "name": name,
                                                                           "batch_interval": interval}))
    (conf_dir / "pipelines" / "broken.yaml").write_text("name: [unclosed\n")
    bag = dagbag()
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == {"millpond_alpha", "millpond_beta"}
    assert bag.dags["millpond_beta"].timetable.expression == "0 */1 * * *"


def test_a_stage_reads_its_upstreams_panes_as_inlets(conf_dir: Path) -> None:
    base = yaml.safe_load((DEFAULT_CONF_DIR / "pipelines" / "video_sessions.yaml").read_text())
    (conf_dir / "pipelines" / "sessions.yaml").write_text(yaml.safe_dump({**base, "name": "sessions"}))
    stage = {"name": "per_hour", "source": {"pipeline": "sessions", "key": "all", "event_time": "window_start"},
             "window": {"type": "fixed", "size": "1h"}, "accumulation": "accumulating", "aggregation": "sum"}
    (conf_dir / "pipelines" / "per_hour.yaml").write_text(yaml.safe_dump(stage))
    bag = dagbag()
    assert bag.import_errors == {}
    settings = load_settings()
    inlets = {a.uri for a in bag.dags["millpond_per_hour"].get_task(dagfactory.TASK_ID).inlets}
    assert inlets == {f"s3://{settings.bucket_lake}/{settings.table_root}/sessions/panes"}
    assert not bag.dags["millpond_sessions"].get_task(dagfactory.TASK_ID).inlets


def test_live_runs_can_be_switched_off() -> None:
    scheduled = {"dag_run": SimpleNamespace(run_type="scheduled")}
    off = load_settings(env={"MILLPOND_AIRFLOW_SCHEDULED_RUNS": "false"})
    for run_type in ("manual", "backfill"):
        assert not dagfactory.live_run_skipped({"dag_run": SimpleNamespace(run_type=run_type)}, off)
    assert dagfactory.live_run_skipped(scheduled, off)
    assert not dagfactory.live_run_skipped(scheduled, load_settings(env={"MILLPOND_AIRFLOW_SCHEDULED_RUNS": "true"}))


def test_processing_time_is_interval_end_or_run_after() -> None:
    start = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    end = start + timedelta(minutes=5)
    scheduled = {"dag_run": SimpleNamespace(logical_date=start, run_after=end),
                 "data_interval_start": start, "data_interval_end": end}
    assert dagfactory.batch_window(scheduled, timedelta(minutes=5)) == (start, end)
    run_after = datetime(2026, 1, 1, 12, 7, 30, tzinfo=UTC)
    manual = {"dag_run": SimpleNamespace(logical_date=None, run_after=run_after),
              "data_interval_start": None, "data_interval_end": None}
    assert dagfactory.batch_window(manual, timedelta(minutes=5)) == (run_after - timedelta(minutes=5), run_after)


def test_backfill_bounds_and_progress() -> None:
    interval = timedelta(minutes=5)
    a, b = align(parse_time("2026-01-01T12:02:00Z"), parse_time("2026-01-01T12:13:00"), interval)
    assert (a, b) == (datetime(2026, 1, 1, 12, 0, tzinfo=UTC), datetime(2026, 1, 1, 12, 15, tzinfo=UTC))
    conf = {"backfill_from": "2026-01-01T12:00:00Z", "backfill_to": "2026-01-01T12:15:00Z"}
    assert dagfactory.backfill_progress(conf, datetime(2026, 1, 1, 12, 5, tzinfo=UTC), interval) == (2, 3)
    assert dagfactory.backfill_progress({}, a, interval) is None


def test_demo_needs_pipeline_config_and_a_switch() -> None:
    plain, demo = load_settings(env={}), load_settings(env={"MILLPOND_DEMO": "1"})
    assert not dagfactory.demo_enabled(plain, True, {"demo": False})
    assert dagfactory.demo_enabled(plain, True, {"demo": True})
    assert not dagfactory.demo_enabled(plain, False, {"demo": True})
    assert dagfactory.demo_enabled(demo, True, {})


def test_an_asset_triggered_stage_run_goes_on_to_upstream_batches_committed_meanwhile(settings, tables,
                                                                                       pipeline_name, monkeypatch
                                                                                       ) -> None:
    """An upstream event that arrives while the stage's DAG run is active can wait in Airflow's queue until a
    later event (apache/airflow#56050: CI saw a stage never run at its upstream's last batch). The run the first
    event triggers goes on to every upstream batch committed after it, in order, one stage batch each, as their
    own events would; when those runs come, their batches are committed. The batches are recorded, not run."""
    from millpond.model.spec import pipeline_from_dict
    from millpond.model.timeutil import to_datetime, to_us
    from millpond.runtime.job import run_batch

    up = f"{pipeline_name}_up"
    spec = pipeline_from_dict({"name": up, "source": {"prefix": f"{up}/"}, "window": {"type": "fixed", "size": "5m"},
                               "trigger": "AtWatermark()", "accumulation": "discarding", "aggregation": "sum"})
    t0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
    times = [t0 + timedelta(minutes=5 * i) for i in (1, 2, 3)]
    for t in times:
        run_batch(settings.with_overrides(engine="local"), spec, t)
    ran: list[tuple[datetime, datetime]] = []

    def recorded(info, s, context, start, end, params, conf):
        ran.append((start, end))
        return {"processing_time": end.isoformat(), "batch": len(ran)}

    monkeypatch.setattr(dagfactory, "_batch", recorded)
    monkeypatch.setattr(dagfactory, "load_settings", lambda: settings)
    info = dagfactory.PipelineInfo(f"{pipeline_name}_stage", Path("stage.yaml"), timedelta(minutes=5), "", False,
                                   upstreams=(up,))
    first = SimpleNamespace(extra={"processing_time": times[0].isoformat().replace("+00:00", "Z")})
    context = {"dag_run": SimpleNamespace(run_type="asset_triggered", conf={}, data_interval_start=None,
                                          data_interval_end=None, run_after=datetime.now(UTC)),
               "triggering_asset_events": {"panes": [first]}, "params": {}, "outlet_events": {}}
    summary = dagfactory.run_microbatch(info, context, [])
    assert [to_us(end) for _, end in ran] == [to_us(t) for t in times], ran
    assert all(end - start == timedelta(minutes=5) for start, end in ran)
    assert summary["processing_time"] == times[-1].isoformat() and summary["batch"] == 3
    # a later run that its own (late) event triggers starts where the upstream is: nothing after it
    ran.clear()
    late = SimpleNamespace(extra={"processing_time": to_datetime(to_us(times[-1])).isoformat()})
    dagfactory.run_microbatch(info, {**context, "triggering_asset_events": {"panes": [late]}}, [])
    assert [to_us(end) for _, end in ran] == [to_us(times[-1])]
