"""`airflow_dag_run_1k_s` and `airflow_dag_run_1k_spark_engine_s`: one pipeline's DAG runs in a real Airflow, from
run start to the batch's marker, with the in-process engine and with the Spark engine against a Connect server.

Why a measure of its own: the engine commits a 1k-event batch in a fraction of a second (`tiny_batch_s`), but
a user waits for the whole Airflow run — scheduling, each task's process start, the batch, validation, the
Data Docs upload. This starts a private Airflow (the four processes of ``make up``, through the project's own
``start_isolated_stack``) against the bench's object store, triggers runs of consecutive past intervals, each
landing 1k demo events and processing them, and times each run from Airflow's run start to the commit of the
batch's marker (the ``batches`` row: the batch is visible to readers then), with every task's queued, start and
end times from Airflow's REST API.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from millpond.config import DEFAULT_CONF_DIR, Settings
from millpond.errors import ApiRefused, MillpondError
from millpond.lake.tables import Tables

PIPELINE = "bench_dag"
TABLE_ROOT = "tables_airflow_bench"
STEP = timedelta(minutes=5)
TERMINAL = ("success", "failed")


def write_conf(folder: Path, events: int, pipeline: str = PIPELINE) -> Path:
    """The shipped millpond.yaml and one demo pipeline landing ``events`` events per interval."""
    (folder / "pipelines").mkdir(parents=True, exist_ok=True)
    shutil.copy(DEFAULT_CONF_DIR / "millpond.yaml", folder / "millpond.yaml")
    doc = {
        "name": pipeline, "description": "bench: one DAG run per 1k-event batch", "source": {"prefix": f"{pipeline}/"},
        "value_type": "int", "window": {"type": "sessions", "gap": "5m"},
        "trigger": "AtWatermark(early=AfterDelay('1m'), late=AtCount(1))",
        "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "1h",
        "batch_interval": "5m", "watermark": {"policy": "processing_time", "lag": "2m"},
        "demo": {"generator": "uniform", "events_per_batch": events, "keys": max(10, events // 10),
                 "late_fraction": 0.02, "duplicate_fraction": 0.01},
    }
    (folder / "pipelines" / f"{pipeline}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def _time(text: str | None) -> datetime | None:
    return None if not text else datetime.fromisoformat(str(text).replace("Z", "+00:00")).astimezone(UTC)


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else round((b - a).total_seconds(), 3)


def marker_time(tables: Tables, batch_count: int, pipeline: str = PIPELINE) -> datetime:
    """When the ``batches`` row of the pipeline's ``batch_count``-th batch was committed (its Delta commit)."""
    history = [h for h in tables.history(pipeline, "batches") if h.get("operation") in ("WRITE", "CREATE TABLE")]
    done = tables.read_arrow(pipeline, "batches").num_rows
    if done != batch_count or not history:
        raise MillpondError(f"expected {batch_count} committed batches of {pipeline}, found {done}")
    return datetime.fromtimestamp(max(h["timestamp"] for h in history) / 1000, tz=UTC)


def one_run(stack, token: str, tables: Tables, dag_id: str, logical: datetime, batch_count: int,
            timeout: float, pipeline: str = PIPELINE) -> dict[str, Any]:
    """Trigger a demo run of the interval ending at ``logical``, wait for it, and time it."""
    triggered = datetime.now(UTC)
    body = {"logical_date": logical.isoformat().replace("+00:00", "Z"), "conf": {"demo": True}}
    for attempt in range(4):
        try:
            run = stack.api("POST", f"/dags/{dag_id}/dagRuns", body, token=token)
            break
        except ApiRefused as exc:
            # SQLite under a loaded box: the API server answers 500 "Database error" (locked) now and then; the
            # refused trigger left no run, so it is sent again (the clock restarts: that try is not the run's)
            if exc.status != 500 or attempt == 3:
                raise
            time.sleep(1.0)
            triggered = datetime.now(UTC)
    run_id = run["dag_run_id"]
    deadline = time.monotonic() + timeout
    while run["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise MillpondError(f"DAG run {run_id} not finished after {timeout:.0f}s")
        time.sleep(0.2)
        run = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}", token=token)
    tis = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", token=token)["task_instances"]
    if run["state"] != "success":
        raise MillpondError(f"DAG run {run_id} {run['state']}: {[(t['task_id'], t['state']) for t in tis]}")
    start, end = _time(run.get("start_date")), _time(run.get("end_date"))
    marker = marker_time(tables, batch_count, pipeline)
    tasks = {}
    for t in sorted(tis, key=lambda t: t.get("start_date") or ""):
        queued, began, ended = _time(t.get("queued_when")), _time(t.get("start_date")), _time(t.get("end_date"))
        tasks[t["task_id"]] = {"queued_after_run_start_s": _seconds(start, queued),
                               "started_after_run_start_s": _seconds(start, began),
                               "queued_to_start_s": _seconds(queued, began), "duration_s": _seconds(began, ended),
                               "try_number": t.get("try_number"), "state": t.get("state")}
    return {"run_id": run_id, "run_start_to_marker_s": _seconds(start, marker),
            "trigger_to_marker_s": _seconds(triggered, marker), "trigger_to_run_start_s": _seconds(triggered, start),
            "run_start_to_run_end_s": _seconds(start, end), "marker_to_run_end_s": _seconds(marker, end),
            "tasks": tasks}


def engine_env(engine: str, connect_url: str | None = None, token: str | None = None) -> dict[str, str]:
    """The stack's engine settings: ``local`` (the in-process engine, every batch in the task's process) or
    ``spark`` (the product's default as ``make up`` deploys it: every batch a PySpark job on the Connect server at
    ``connect_url``, the task a Connect client; ``engine.local_below`` 0)."""
    if engine == "local":
        return {"MILLPOND_ENGINE": "local"}
    if not connect_url:
        raise MillpondError("the Spark engine's DAG runs need a Connect server's URL")
    env = {"MILLPOND_ENGINE": "spark", "MILLPOND_ENGINE_LOCAL_BELOW": "0", "MILLPOND_SPARK_CONNECT": connect_url}
    if token:
        env["MILLPOND_SPARK_CONNECT_TOKEN"] = token
    return env


def measure(settings: Settings, workdir: Path, events: int, runs: int, log: Callable[[str], None],
            engine: str = "local", connect_url: str | None = None, connect_token: str | None = None) -> dict[str, Any]:
    """``runs`` DAG runs of ``events`` demo events each in a private Airflow whose tasks run ``engine``; the first
    (it creates the tables and pays the first parse) is reported but not in the median. Each engine gets a
    pipeline (and DAG) and table root of its own, so stacks started one after the other in the same home do not
    meet in Airflow's database or the lake."""
    from millpond.orchestration.airflow_stack import start_isolated_stack
    from millpond.orchestration.processes import free_port

    pipeline = PIPELINE if engine == "local" else f"{PIPELINE}_{engine}"
    conf = write_conf(workdir / f"airflow-conf-{engine}", events, pipeline)
    t = time.perf_counter()
    stack, s = start_isolated_stack({
        "MILLPOND_HOME": str(settings.home), "MILLPOND_CONF_DIR": str(conf),
        "MILLPOND_TABLE_ROOT": TABLE_ROOT if engine == "local" else f"{TABLE_ROOT}_{engine}",
        "MILLPOND_AIRFLOW_PORT": str(free_port()), "MILLPOND_AIRFLOW_SCHEDULED_RUNS": "false",
        "MILLPOND_AIRFLOW_PAUSED_AT_CREATION": "false", "MILLPOND_AIRFLOW_PARALLELISM": "2",
        **engine_env(engine, connect_url, connect_token),
    })
    started_s = round(time.perf_counter() - t, 1)
    log(f"  Airflow ({engine} engine) up in {started_s}s at {stack.url}")
    dag_id = f"millpond_{pipeline}"
    try:
        token = stack.token()
        deadline = time.monotonic() + 120
        while True:
            try:
                stack.api("GET", f"/dags/{dag_id}", token=token)
                break
            except MillpondError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        tables = Tables(s)
        epoch = datetime(1970, 1, 1, tzinfo=UTC)
        first = epoch + ((datetime.now(UTC) - timedelta(hours=2) - epoch) // STEP) * STEP
        out = []
        for i in range(runs):
            r = one_run(stack, token, tables, dag_id, first + (i + 1) * STEP, i + 1, timeout=600, pipeline=pipeline)
            log(f"  run {i + 1}/{runs}: run start -> marker {r['run_start_to_marker_s']}s, run "
                f"{r['run_start_to_run_end_s']}s, tasks " + ", ".join(
                    f"{k} {v['duration_s']}s" for k, v in r["tasks"].items()))
            out.append(r)
    finally:
        stack.stop()
    steady = out[1:] if len(out) > 1 else out
    return {"engine": engine, "pipeline": pipeline, "events": events, "runs": out, "airflow_start_s": started_s,
            "median_run_start_to_marker_s": statistics.median(r["run_start_to_marker_s"] for r in steady),
            "median_trigger_to_marker_s": statistics.median(r["trigger_to_marker_s"] for r in steady),
            "median_run_start_to_run_end_s": statistics.median(r["run_start_to_run_end_s"] for r in steady),
            "tasks": sorted({k for r in out for k in r["tasks"]})}
