"""OpenLineage (issue 38, item 3): every DAG run's ``microbatch`` task emits START and COMPLETE (or FAIL) events
naming the datasets its batch read (the landing prefix, or a stage's upstream panes) and wrote (the pipeline's
Delta tables), with the batch's watermark, counts and data-quality outcome as run facets, through the
OpenLineage provider's listener; with lineage not configured, nothing is emitted and nothing fails.

In-process: the pipeline's DAG is parsed from the real dags/ folder and run with ``dag.test()`` (no Airflow
server) against the session's object store; the events go to an HTTP receiver on loopback, the provider's
HTTP transport configured the way ``lineage.url`` configures the stack's Airflow (``lineage.airflow_env``).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import airflow_env
import pytest
from millpond.config import Settings
from millpond.orchestration import lineage

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
STEP = timedelta(minutes=5)
JOB = f"millpond_{airflow_env.PIPELINE}.microbatch"


class Receiver:
    """An OpenLineage endpoint on loopback: collects the JSON events POSTed to it."""

    def __init__(self) -> None:
        events = self.events = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                events.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def task_events(self, types: set[str], timeout: float = 30.0, job: str = JOB) -> dict[str, dict]:
        """The microbatch task's events by type (or ``job``'s), once every type in ``types`` arrived (they are
        sent from a fork)."""
        deadline = time.monotonic() + timeout
        while True:
            found = {e["eventType"]: e for e in list(self.events) if e.get("job", {}).get("name") == job}
            if types <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _clear_provider_conf() -> None:
    """The provider caches its configuration per process: read it again."""
    from airflow.providers.openlineage import conf

    for value in vars(conf).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(scope="module")
def conf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return airflow_env.write_conf_dir(tmp_path_factory.mktemp("conf"))


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def lineage_on(settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch):
    """The provider on, its transport from ``lineage.url``, its listener registered as its plugin does."""
    from airflow.providers.openlineage.plugins.listener import OpenLineageListener
    from airflow.sdk.listener import get_listener_manager

    for key, value in lineage.airflow_env(settings.with_overrides(lineage_url=receiver.url)).items():
        monkeypatch.setenv(key, value)
    # dag.test's task talks to an in-process supervisor that a forked emitter (the provider's default) cannot
    # reach: emit from a thread instead (the same events; a worker's task forks as usual)
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD", "true")
    _clear_provider_conf()
    assert lineage.enabled()
    listener = OpenLineageListener()
    manager = get_listener_manager()
    manager.add_listener(listener)
    yield receiver
    manager.pm.unregister(listener)
    monkeypatch.undo()
    _clear_provider_conf()


def get_dag(conf_dir: Path, monkeypatch: pytest.MonkeyPatch, table_root: str, connect=None):
    """The pipeline's DAG from the real dags/ folder; its batches on the local engine, or with ``connect`` (the
    session's Connect server) on the Spark engine, every batch a Spark job, as a deployment's tasks run."""
    from airflow.dag_processing.dagbag import DagBag
    from engines import command_env
    from millpond.orchestration.dagfactory import TASK_ID

    monkeypatch.setenv("MILLPOND_CONF_DIR", str(conf_dir))
    monkeypatch.setenv("MILLPOND_TABLE_ROOT", table_root)
    for key, value in command_env("spark" if connect else "local", connect).items():
        monkeypatch.setenv(key, value)
    airflow_env.reset_db()
    bag = DagBag(dag_folder=str(airflow_env.DAGS))
    assert bag.import_errors == {}
    dag = bag.dags[f"millpond_{airflow_env.PIPELINE}"]
    dag.get_task(TASK_ID).retries = 0  # a failing batch fails at once (no retry delay)
    return dag


def datasets(event: dict, side: str) -> list[tuple[str, str]]:
    return [(d["namespace"], d["name"]) for d in event.get(side) or []]


def test_transport_from_the_setting(settings: Settings) -> None:
    assert lineage.transport("") is None and lineage.airflow_env(settings) == {}
    assert lineage.transport("http://marquez:5000") == {"type": "http", "url": "http://marquez:5000"}
    assert lineage.transport("file:///var/ol/events.jsonl") == {
        "type": "file", "log_file_path": "/var/ol/events.jsonl", "append": True}
    env = lineage.airflow_env(settings.with_overrides(lineage_url="https://ol.example/"))
    assert json.loads(env["AIRFLOW__OPENLINEAGE__TRANSPORT"]) == {"type": "http", "url": "https://ol.example/"}


def test_a_stage_reads_its_upstreams_panes(settings: Settings, tmp_path: Path) -> None:
    from millpond.orchestration.dagfactory import read_pipeline_info

    path = tmp_path / "stage.yaml"
    path.write_text("name: stage\nsource: {pipelines: [up1, up2], stream: panes}\nbatch_interval: 5m\n")
    found = lineage.datasets(read_pipeline_info(path), settings)
    lake = f"s3://{settings.bucket_lake}"
    assert found["inputs"] == [(lake, f"{settings.table_root}/up1/panes"), (lake, f"{settings.table_root}/up2/panes")]
    assert found["outputs"][0] == (lake, f"{settings.table_root}/stage/panes")


def test_without_lineage_configured_nothing_is_emitted(settings: Settings, conf_dir: Path, receiver: Receiver,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No transport: the provider is off (its plugin registers no listener), and the batch runs as before.
    First of the runs: the process's listeners are made from the plugins at its first task, as a worker's are."""
    for key in ("AIRFLOW__OPENLINEAGE__TRANSPORT", "OPENLINEAGE_URL", "OPENLINEAGE_CONFIG",
                "AIRFLOW__OPENLINEAGE__CONFIG_PATH"):
        monkeypatch.delenv(key, raising=False)
    _clear_provider_conf()
    assert not lineage.enabled()
    from airflow.sdk.listener import get_listener_manager

    assert not any(type(p).__name__ == "OpenLineageListener" for p in get_listener_manager().pm.get_plugins())
    dag = get_dag(conf_dir, monkeypatch, "tables_lineage_off")
    dr = dag.test(logical_date=T0 + STEP, run_conf={"demo": True})
    assert str(dr.state) == "success"
    assert lineage.tag_spark(object(), {}) == {}
    time.sleep(1)
    assert receiver.events == []


def test_a_batch_emits_start_and_complete_with_its_datasets_and_facets(
        settings: Settings, conf_dir: Path, lineage_on: Receiver, spark_connect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch on the Spark engine (a Connect client of the session's server, as a deployment's task): the
    task's START and COMPLETE, and its Spark job's, whose parent is the task's run and whose root the DAG run."""
    import millpond.runtime.engines as engines

    sessions = []
    choose = engines.choose

    def spy(s, forced=None, **kw):  # the real choice; the session kept to read its confs back
        chosen = choose(s, forced, **kw)
        sessions.append(chosen[1])
        return chosen

    monkeypatch.setattr(engines, "choose", spy)
    dag = get_dag(conf_dir, monkeypatch, "tables_lineage", spark_connect)
    dr = dag.test(logical_date=T0 + STEP, run_conf={"demo": True})
    assert str(dr.state) == "success"
    events = lineage_on.task_events({"START", "COMPLETE"})
    assert {"START", "COMPLETE"} <= set(events), [(e["eventType"], e["job"]["name"]) for e in lineage_on.events]
    start, complete = events["START"], events["COMPLETE"]
    assert start["run"]["runId"] == complete["run"]["runId"]
    landing = (f"s3://{settings.bucket_landing}", airflow_env.PIPELINE)
    tables = [(f"s3://{settings.bucket_lake}", f"tables_lineage/{airflow_env.PIPELINE}/{t}")
              for t in ("panes", "current", "batches")]
    for event in (start, complete):
        assert datasets(event, "inputs") == [landing], event["inputs"]
        assert datasets(event, "outputs") == tables, event["outputs"]
        parent = event["run"]["facets"]["parent"]  # the DAG run, set by the provider
        assert parent["job"]["name"] == f"millpond_{airflow_env.PIPELINE}", parent
    facets = complete["run"]["facets"]
    batch, quality = facets["millpond_batch"], facets["millpond_quality"]
    assert batch["pipeline"] == airflow_env.PIPELINE and batch["batch"] == 1
    assert batch["processingTime"] == "2026-01-05T12:05:00Z"
    assert batch["watermark"] == "2026-01-05T12:04:00Z"  # processing time minus the pipeline's 1m lag
    assert batch["counts"]["input"] > 0 and "panes" in batch["counts"], batch
    assert batch["engine"].startswith("spark/"), batch
    assert quality["validated"] is True and quality["ok"] is True, quality
    assert "millpond_batch" not in start["run"]["facets"]
    # the Spark session got the provider's parent properties: this task's run
    (session,) = sessions  # the process's session for that endpoint (``spark_client.connect``): left open
    confs = {k: session.conf.get(k) for k in ("spark.openlineage.parentRunId", "spark.openlineage.parentJobName",
                                              "spark.openlineage.parentJobNamespace")}
    assert confs["spark.openlineage.parentRunId"] == complete["run"]["runId"], confs
    assert confs["spark.openlineage.parentJobName"] == JOB
    assert confs["spark.openlineage.parentJobNamespace"] == complete["job"]["namespace"]
    # the Spark job's own START and COMPLETE: a child of the task's run, under the DAG run as root
    spark_job = lineage_on.task_events({"START", "COMPLETE"}, job=JOB + lineage.SPARK_JOB_SUFFIX)
    assert {"START", "COMPLETE"} <= set(spark_job), [(e["eventType"], e["job"]["name"]) for e in lineage_on.events]
    job_start, job_end = spark_job["START"], spark_job["COMPLETE"]
    assert job_start["run"]["runId"] == job_end["run"]["runId"] != complete["run"]["runId"]
    for event in (job_start, job_end):
        parent = event["run"]["facets"]["parent"]
        assert parent["run"]["runId"] == complete["run"]["runId"] and parent["job"]["name"] == JOB, parent
        assert parent["root"]["job"]["name"] == f"millpond_{airflow_env.PIPELINE}", parent
        assert parent["root"]["run"]["runId"] == complete["run"]["facets"]["parent"]["run"]["runId"], parent
        assert event["job"]["namespace"] == complete["job"]["namespace"]
        assert event["job"]["facets"]["jobType"]["integration"] == "SPARK"
        assert event["run"]["facets"]["processing_engine"]["name"] == "spark"
        assert event["run"]["facets"]["processing_engine"]["version"].startswith("4."), event["run"]["facets"]
        assert datasets(event, "inputs") == [landing] and datasets(event, "outputs") == tables
    assert job_end["run"]["facets"]["millpond_batch"]["counts"] == batch["counts"]
    assert job_start["eventTime"] <= job_end["eventTime"]


def test_a_batch_on_the_local_engine_has_no_spark_job(settings: Settings, conf_dir: Path, lineage_on: Receiver,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No Spark session, no Spark job: the task's events only."""
    dag = get_dag(conf_dir, monkeypatch, "tables_lineage_local")
    dr = dag.test(logical_date=T0 + STEP, run_conf={"demo": True})
    assert str(dr.state) == "success"
    events = lineage_on.task_events({"START", "COMPLETE"})
    assert events["COMPLETE"]["run"]["facets"]["millpond_batch"]["engine"] == "local/in-process"
    time.sleep(0.5)
    assert not [e for e in lineage_on.events if e["job"]["name"].endswith(lineage.SPARK_JOB_SUFFIX)]


def test_a_failing_batch_emits_fail(settings: Settings, conf_dir: Path, lineage_on: Receiver,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch stopped by its critical data-quality checks (the error ``runtime.steps.validate`` raises)."""
    import millpond.runtime.job as job
    from millpond.errors import MillpondError

    def stopped(s, spec, *args, **kwargs):
        raise MillpondError(f"{spec.name} batch 1 failed critical data-quality checks, nothing was published: "
                            "expect_column_values_to_not_be_null(value)")

    monkeypatch.setattr(job, "run_batch", stopped)
    dag = get_dag(conf_dir, monkeypatch, "tables_lineage_fail")
    dr = dag.test(logical_date=T0 + STEP, run_conf={"demo": True})
    assert str(dr.state) == "failed"
    events = lineage_on.task_events({"START", "FAIL"})
    assert {"START", "FAIL"} <= set(events) and "COMPLETE" not in events, list(events)
    fail = events["FAIL"]
    assert datasets(fail, "inputs") == [(f"s3://{settings.bucket_landing}", airflow_env.PIPELINE)]
    assert [name for _, name in datasets(fail, "outputs")] == [
        f"tables_lineage_fail/{airflow_env.PIPELINE}/{t}" for t in ("panes", "current", "batches")]
    facets = fail["run"]["facets"]
    batch, quality = facets["millpond_batch"], facets["millpond_quality"]
    assert "failed critical data-quality checks" in batch["error"] and "batch" not in batch, batch
    assert quality["validated"] is True and quality["ok"] is False, quality
    assert "expect_column_values_to_not_be_null" in quality["summary"]


def test_a_failed_spark_batch_is_a_fail_event_under_the_task() -> None:
    """The Spark job's events for a batch that failed: START then FAIL with the error, under the task's run."""
    from openlineage.client.serde import Serde

    confs = {"spark.openlineage.parentJobNamespace": "ns", "spark.openlineage.parentJobName": JOB,
             "spark.openlineage.parentRunId": "01890000-0000-7000-8000-000000000001",
             "spark.openlineage.rootParentRunId": "01890000-0000-7000-8000-000000000002",
             "spark.openlineage.rootParentJobName": f"millpond_{airflow_env.PIPELINE}",
             "spark.openlineage.rootParentJobNamespace": "ns"}
    io = {"inputs": [("s3://landing", "p")], "outputs": [("s3://lake", "t/p/panes")], "pipeline": "p"}
    events = [Serde.to_dict(e) for e in lineage.spark_job_events(
        confs, io, T0, T0 + STEP, None, RuntimeError("the store stopped answering"), "4.2.0")]
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    assert events[0]["run"]["runId"] == events[1]["run"]["runId"]
    fail = events[1]
    assert fail["job"] == {"namespace": "ns", "name": JOB + lineage.SPARK_JOB_SUFFIX,
                           "facets": fail["job"]["facets"]} and fail["eventTime"].startswith("2026-01-05T12:05")
    assert fail["run"]["facets"]["errorMessage"]["message"] == "the store stopped answering"
    assert fail["run"]["facets"]["millpond_batch"]["error"] == "the store stopped answering"
    assert fail["run"]["facets"]["parent"]["run"]["runId"] == confs["spark.openlineage.parentRunId"]
    assert fail["run"]["facets"]["parent"]["root"]["run"]["runId"] == confs["spark.openlineage.rootParentRunId"]
    assert datasets(fail, "inputs") == [("s3://landing", "p")] and datasets(fail, "outputs") == [("s3://lake",
                                                                                                    "t/p/panes")]
