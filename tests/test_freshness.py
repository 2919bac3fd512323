"""Freshness (issue 38, item 4): ``freshness: {watermark_lag, last_batch}`` in a pipeline file. A batch beyond a
threshold commits with a failed warning in its Data Docs and a marker in ``millpond history``; Airflow's deadline
alert (a run not done by its interval's start + last_batch) calls the deployment's hook; ``make report`` draws the
threshold. Airflow runs in-process (its metadata DB, no server); hooks are this module's function or a loopback
webhook."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import airflow_env  # noqa: F401  (configures Airflow before it is imported)
import pytest
import yaml
from millpond.config import DEFAULT_CONF_DIR, load_settings
from millpond.config.pipelines import load_pipeline
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import MIN_TS, US, to_datetime, to_us
from millpond.orchestration import dagfactory
from millpond.quality import suites as qs
from millpond.quality.context import gx_root
from millpond.quality.freshness import BatchFreshness, alert
from millpond.runtime.job import run_batch
from millpond.surface import report
from millpond.surface.inputs import history

MINUTE = 60 * US
T0 = to_us("2026-05-04T10:00:00Z")
BASE = {"name": "fresh", "batch_interval": "5m", "window": {"type": "fixed", "size": "5m"}}
#: what the hook named by quality.freshness_hook received (``record``)
ALERTS: list[dict] = []


def record(**received) -> None:
    """A deployment's hook (``quality.freshness_hook: test_freshness:record``)."""
    ALERTS.append(received)


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    ALERTS.clear()
    monkeypatch.setenv("MILLPOND_FRESHNESS_HOOK", f"{__name__}:record")
    return ALERTS


# -- the pipeline file --------------------------------------------------------------------------------
def test_freshness_is_optional_and_both_keys_are() -> None:
    assert pipeline_from_dict(BASE).freshness == {}
    both = pipeline_from_dict({**BASE, "freshness": {"watermark_lag": "30m", "last_batch": "15m"}})
    assert both.freshness == {"watermark_lag": 30 * MINUTE, "last_batch": 15 * MINUTE}
    assert pipeline_from_dict({**BASE, "freshness": {"watermark_lag": 90}}).freshness == {"watermark_lag": 90 * US}
    assert pipeline_from_dict({**BASE, "freshness": {"last_batch": "1h"}}).freshness == {"last_batch": 60 * MINUTE}


@pytest.mark.parametrize(("block", "said"), [
    ({"watermark_lg": "30m"}, "unknown key freshness.'watermark_lg': did you mean 'watermark_lag'?"),
    ({"stale_after": "30m"}, "unknown key freshness.'stale_after': use one of watermark_lag, last_batch"),
    ("30m", "freshness: expected a mapping such as {watermark_lag: ...}, got '30m'"),
    ({"last_batch": "soon"}, "freshness.last_batch: expected a positive duration such as 30m, got 'soon'"),
    ({"watermark_lag": True}, "freshness.watermark_lag: expected a positive duration such as 30m, got True"),
    ({"watermark_lag": 0}, "freshness.watermark_lag: expected a positive duration such as 30m, got 0"),
    ({"watermark_lag": {"minutes": 30}}, "freshness.watermark_lag: expected a positive duration"),
    ({"last_batch": "5m"}, "freshness.last_batch 5m must be longer than batch_interval 5m"),
])
def test_a_wrong_freshness_is_one_line_saying_what_was_meant(tmp_path: Path, block, said: str) -> None:
    path = tmp_path / "fresh.yaml"
    path.write_text(yaml.safe_dump({**BASE, "freshness": block}))
    with pytest.raises(ValueError) as refused:
        load_pipeline(path)
    text = str(refused.value)
    assert text.startswith("fresh.yaml: ") and said in text and "\n" not in text


def test_breaches_are_judged_at_the_batch_processing_time() -> None:
    limits = {"watermark_lag": 30 * MINUTE, "last_batch": 3 * MINUTE}
    fresh = BatchFreshness("p", 2, T0, T0 - 10 * MINUTE, T0 - MINUTE, limits)
    assert fresh.breaches() == [] and fresh.marker() == ""
    late = BatchFreshness("p", 3, T0, T0 - 45 * MINUTE, T0 - 8 * MINUTE, limits)
    assert [b["check"] for b in late.breaches()] == ["watermark_lag", "last_batch"]
    assert late.marker() == "watermark lag 45m > 30m; 8m since last batch > 3m"
    assert late.breaches()[1]["message"] == ("p batch 3 at 2026-05-04T10:00:00Z: 8m since the previous batch "
                                             "(at 2026-05-04T09:52:00Z) exceeds freshness.last_batch 3m")
    first = BatchFreshness("p", 1, T0, MIN_TS, None, limits)  # no previous batch; a watermark not started yet
    assert first.marker() == "watermark lag unbounded > 30m" and "has not started" in first.breaches()[0]["message"]
    only_lag = BatchFreshness("p", 3, T0, T0, T0 - 60 * MINUTE, {"watermark_lag": MINUTE})
    assert only_lag.breaches() == [] and only_lag.frame()["since_last_batch_s"].isna().all()


# -- a lagging pipeline: warned, committed, in history and in the report -------------------------------
def lagging(name: str) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "value_type": "int", "aggregation": "sum",
            "window": {"type": "fixed", "size": "1m"}, "accumulation": "discarding", "allowed_lateness": "2h",
            "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "45m"},
            "freshness": {"watermark_lag": "30m", "last_batch": "3m"}}


def test_a_lagging_watermark_warns_in_data_docs_and_history_and_the_batches_commit(
        settings, pipeline_name: str, tmp_path: Path) -> None:
    name, doc = pipeline_name, lagging(pipeline_name)
    spec = pipeline_from_dict(doc)
    store = ObjectStore(settings)
    minutes = (1, 2, 10)  # batches one minute apart, then 8 minutes after the previous one
    for m in minutes:
        rows = [{"id": f"{m}-{i}", "key": f"k{i % 2}", "value": i, "event_time": to_datetime(
            T0 + (m - 1) * MINUTE + i * US).isoformat()} for i in range(4)]
        store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(T0 + (m - 1) * MINUTE + 30 * US)}-a.jsonl",
                        "".join(json.dumps(r) + "\n" for r in rows).encode())
    results = [run_batch(settings, spec, to_datetime(T0 + m * MINUTE), validate=True) for m in minutes]

    assert [r.batch for r in results] == [1, 2, 3] and not any(r.skipped for r in results)
    for r in results:  # a warning: the batch went on and committed
        assert r.quality.ok and r.quality.suites[qs.FRESHNESS] is False
        assert any(w.startswith("millpond_freshness: expect_column_values_to_be_between(watermark_lag_s)")
                   for w in r.quality.warnings)
    assert [[b["check"] for b in r.quality.freshness] for r in results] == [
        ["watermark_lag"], ["watermark_lag"], ["watermark_lag", "last_batch"]]
    assert "watermark lag 45m exceeds freshness.watermark_lag 30m" in results[0].quality.freshness[0]["message"]

    # the validation result: failed expectations of warning severity, with the batch's numbers
    stored = [json.loads(p.read_text()) for p in (gx_root(settings) / "validations" / qs.FRESHNESS).rglob("*.json")
              if f"{name}-3" in str(p)]
    assert len(stored) == 1 and stored[0]["success"] is False
    failed = {r["expectation_config"]["kwargs"]["column"]: r for r in stored[0]["results"] if not r["success"]}
    assert set(failed) == {"watermark_lag_s", "since_last_batch_s"}
    assert all(r["expectation_config"]["meta"]["severity"] == qs.WARNING for r in failed.values())
    assert failed["watermark_lag_s"]["result"]["partial_unexpected_list"] == [2700.0]
    assert failed["since_last_batch_s"]["result"]["partial_unexpected_list"] == [480.0]
    page = next(Path(u) for u in results[2].quality.result_urls if qs.FRESHNESS in u)  # its Data Docs page
    assert "since_last_batch_s" in page.read_text()

    # millpond history: the pipeline file in the conf dir declares the thresholds
    conf = tmp_path / "conf"
    (conf / "pipelines").mkdir(parents=True)
    shutil.copy(DEFAULT_CONF_DIR / "millpond.yaml", conf / "millpond.yaml")
    (conf / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    with_file = settings.with_overrides(conf_dir=conf)
    batches, _ = history(with_file, name)
    assert batches.column("batch").to_pylist() == [1, 2, 3]
    assert batches.column("freshness").to_pylist() == [
        "watermark lag 45m > 30m", "watermark lag 45m > 30m", "watermark lag 45m > 30m; 8m since last batch > 3m"]
    plain, _ = history(settings, name)  # no pipeline file with that name: no column
    assert "freshness" not in plain.column_names

    # make report: the threshold on the lag plot, and in the numbers
    built = report.build(with_file, name, out_dir=tmp_path / "report", upload=False)
    summary = json.loads((built.folder / "summary.json").read_text())
    assert summary["freshness_watermark_lag_s"] == 1800.0 and summary["lag_breaches"] == 3
    assert "freshness.watermark_lag (s)" in built.index.read_text()
    assert _red_line(built.folder / "watermark_lag.png")
    report.build(with_file, name, out_dir=tmp_path / "without", upload=False, freshness={})
    assert not _red_line(tmp_path / "without" / "watermark_lag.png")


def _red_line(png: Path) -> bool:
    """Whether the plot holds a horizontal line in the threshold's colour across most of its axes."""
    import matplotlib.image as mpimg
    import numpy as np
    from millpond.surface.report_plots import THRESHOLD_COLOR

    pixels = mpimg.imread(png)[..., :3]
    target = np.array([int(THRESHOLD_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    red = (np.abs(pixels - target) < 0.06).all(axis=-1)
    return bool(red.sum(axis=1).max() > pixels.shape[1] * 0.3)


# -- Airflow: the deadline, its callback, the task's alerts ---------------------------------------------
@pytest.fixture
def conf_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conf dir: one pipeline declaring freshness, one not."""
    (tmp_path / "pipelines").mkdir()
    shutil.copy(DEFAULT_CONF_DIR / "millpond.yaml", tmp_path / "millpond.yaml")
    (tmp_path / "pipelines" / "fresh.yaml").write_text(yaml.safe_dump(
        {**BASE, "freshness": {"watermark_lag": "30m", "last_batch": "15m"}}))
    (tmp_path / "pipelines" / "plain.yaml").write_text(yaml.safe_dump({**BASE, "name": "plain"}))
    monkeypatch.setenv("MILLPOND_CONF_DIR", str(tmp_path))
    return tmp_path


def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(airflow_env.DAGS))
    assert bag.import_errors == {}
    return bag


def test_the_dag_of_a_pipeline_with_freshness_carries_a_deadline_alert(conf_dir: Path) -> None:
    from airflow.sdk import DeadlineReference, SyncCallback
    from airflow.serialization.serialized_objects import DagSerialization

    bag = dagbag()
    dag = bag.dags["millpond_fresh"]
    alerts = dag.deadline if isinstance(dag.deadline, list) else [dag.deadline]
    assert len(alerts) == 1
    deadline = alerts[0]
    assert deadline.reference == DeadlineReference.DAGRUN_LOGICAL_DATE  # the interval's start: the previous batch
    assert deadline.interval == timedelta(minutes=15)
    assert isinstance(deadline.callback, SyncCallback)
    assert deadline.callback.path == "millpond.orchestration.dagfactory.freshness_missed"
    assert deadline.callback.kwargs == {"pipeline": "fresh", "last_batch": "15m"}
    assert DagSerialization.from_dict(DagSerialization.to_dict(dag)).deadline  # the dag-processor can store it
    assert not bag.dags["millpond_plain"].deadline


def test_a_missed_deadline_reaches_the_hook_through_airflow(conf_dir: Path, hooked: list[dict]) -> None:
    """What the scheduler does, in-process: the run's deadline is its logical date + last_batch; once missed, the
    executor's callback (Airflow's own ``execute_callback``) logs and calls the hook."""
    import pendulum
    import structlog
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import sync_bag_to_db
    from airflow.models.deadline import Deadline
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.sdk.execution_time.callback_supervisor import execute_callback
    from airflow.settings import Session
    from airflow.timetables.base import DataInterval
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    from sqlalchemy import select

    airflow_env.reset_db()
    session = Session()
    try:
        DagBundlesManager().sync_bundles_to_db(session=session)
        session.commit()
        sync_bag_to_db(dagbag(), "dags-folder", None, session=session)
        session.commit()
        dag = SerializedDagModel.get_dag("millpond_fresh", session=session)
        start = pendulum.datetime(2026, 5, 4, 10, 0, tz="UTC")
        run = dag.create_dagrun(run_id=f"scheduled__{start.isoformat()}", logical_date=start,
                                data_interval=DataInterval(start, start.add(minutes=5)), run_after=start.add(minutes=5),
                                run_type=DagRunType.SCHEDULED, triggered_by=DagRunTriggeredByType.TIMETABLE,
                                state=DagRunState.QUEUED, session=session)
        session.flush()
        (deadline,) = session.scalars(select(Deadline).where(Deadline.dagrun_id == run.id)).all()
        assert deadline.deadline_time == start.add(minutes=15)
        deadline.handle_miss(session)
        data = deadline.callback.data
        ok, error = execute_callback(data["path"], data["kwargs"], "", None, structlog.get_logger())
    finally:
        session.rollback()
        session.close()
    assert ok, error
    assert len(hooked) == 1
    assert hooked[0]["pipeline"] == "fresh" and hooked[0]["check"] == "last_batch"
    assert hooked[0]["message"].startswith("fresh: no batch since 2026-05-04T10:00:00Z: the batch at "
                                           "2026-05-04T10:05:00Z has not committed within freshness.last_batch 15m")
    assert hooked[0]["detail"]["dag_run"]["run_type"] == "scheduled"
    # a backfill's runs are all past their deadlines: history, no alert
    dagfactory.freshness_missed("fresh", "15m", {"dag_run": {"run_type": "backfill", "dag_run_id": "b1"}})
    assert len(hooked) == 1


def test_the_task_sends_its_batch_breaches_unless_it_is_a_backfill(conf_dir: Path, hooked: list[dict]) -> None:
    breach = {"check": "watermark_lag", "message": "fresh batch 7 at ...: watermark lag 45m exceeds ..."}
    summary = {"batch": 7, "processing_time": "2026-05-04T10:05:00Z", "quality": {"validated": True,
                                                                                  "freshness": [breach]}}
    live = SimpleNamespace(run_type="scheduled", run_id="scheduled__x")
    assert dagfactory.alert_freshness("fresh", summary, live, load_settings()) == 1
    assert hooked == [{"pipeline": "fresh", "check": "watermark_lag", "message": breach["message"],
                       "detail": {"batch": 7, "processing_time": "2026-05-04T10:05:00Z", "watermark": None,
                                  "run_id": "scheduled__x"}}]
    backfill = SimpleNamespace(run_type="backfill", run_id="backfill__x")
    assert dagfactory.alert_freshness("fresh", summary, backfill, load_settings()) == 0
    assert dagfactory.alert_freshness("fresh", {"quality": {"validated": True, "freshness": []}}, live,
                                      load_settings()) == 0
    assert len(hooked) == 1


def test_a_webhook_gets_the_alert_as_json(conf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("MILLPOND_FRESHNESS_HOOK", f"http://127.0.0.1:{server.server_address[1]}/alerts")
        assert alert(load_settings(), "fresh", "last_batch", "fresh: no batch since ...", {"run": "r"})
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert got == [{"pipeline": "fresh", "check": "last_batch", "message": "fresh: no batch since ...",
                    "detail": {"run": "r"}}]
    monkeypatch.setenv("MILLPOND_FRESHNESS_HOOK", "no_such_module_here:fn")
    assert not alert(load_settings(), "fresh", "last_batch", "m")  # logged, never raised into a committed batch
    with pytest.raises(ModuleNotFoundError):
        alert(load_settings(), "fresh", "last_batch", "m", strict=True)  # the deadline callback: marked failed
