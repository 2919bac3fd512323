"""Airflow configuration for in-process tests: must run before the first ``import airflow``.

A bare import would write ``~/airflow``; every test process gets its own home and SQLite DB instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
_DB_READY = False


def configure() -> Path:
    """Point Airflow at a private home; idempotent."""
    if "AIRFLOW_HOME" in os.environ and os.environ.get("MILLPOND_TEST_AIRFLOW_HOME") == os.environ["AIRFLOW_HOME"]:
        return Path(os.environ["AIRFLOW_HOME"])
    if "airflow" in sys.modules:
        raise RuntimeError("airflow was imported before tests/airflow_env.configure(): import this module first")
    home = Path(tempfile.mkdtemp(prefix="millpond-airflow-inproc-"))
    # removed when the process that made it exits (its subprocesses inherit it through the environment)
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ.update({
        "AIRFLOW_HOME": str(home),
        "MILLPOND_TEST_AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
    })
    return home


def reset_db() -> None:
    """Create the metadata schema once per process (dag.test needs it; DagBag parsing does not)."""
    global _DB_READY
    if not _DB_READY:
        from airflow.utils.db import resetdb

        resetdb()
        _DB_READY = True


configure()


PIPELINE = "afpipe"  # the pipeline the stack tests run (fixed windows, demo data)
STACK_TABLE_ROOT = "tables_airflow"
STACK_LANDING = "landing-airflow"


def write_conf_dir(folder: Path, names: tuple[str, ...] = (PIPELINE,)) -> Path:
    """A conf dir: the shipped millpond.yaml plus small demo pipelines (fast batches, fixed windows)."""
    import yaml

    (folder / "pipelines").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "conf" / "millpond.yaml", folder / "millpond.yaml")
    for name in names:
        doc = {
            "name": name,
            "description": "Airflow test pipeline: 5-minute sums per key, early and late panes",
            "source": {"prefix": f"{name}/"},
            "value_type": "int",
            "window": {"type": "fixed", "size": "5m"},
            "trigger": "AtWatermark(early=AtPeriod('5m'), late=AtCount(1))",
            "accumulation": "accumulating_and_retracting",
            "aggregation": "sum",
            "allowed_lateness": "30m",
            "batch_interval": "5m",
            "watermark": {"policy": "processing_time", "lag": "1m"},
            "demo": {"generator": "uniform", "events_per_batch": 60, "keys": 6, "late_fraction": 0.05,
                     "duplicate_fraction": 0.05},
        }
        (folder / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def start_test_stack(conf_dir: Path, **overrides: str):
    """A real Airflow (four processes) on a free port, sharing the test store; tables under their own root.

    Returns (stack, settings the stack's tasks see). Live schedules are off so nothing but the tests'
    own runs touches the tables. ``overrides``: more environment for the stack (another home, database, ...).
    """
    from millpond.orchestration.airflow_stack import start_isolated_stack
    from millpond.orchestration.processes import free_port

    return start_isolated_stack({
        "MILLPOND_CONF_DIR": str(conf_dir),
        "MILLPOND_TABLE_ROOT": STACK_TABLE_ROOT,
        "MILLPOND_BUCKET_LANDING": STACK_LANDING,
        "MILLPOND_AIRFLOW_PORT": str(free_port()),
        "MILLPOND_AIRFLOW_SCHEDULED_RUNS": "false",
        "MILLPOND_AIRFLOW_PAUSED_AT_CREATION": "false",
        "MILLPOND_AIRFLOW_PARALLELISM": "2",
        # the suite's Airflow runs batches in-process; tests/test_spark_engine.py runs them as Spark jobs
        "MILLPOND_ENGINE": "local",
    } | overrides)


def kill_mid_batch(stack, s, name: str, start: int, end: int) -> tuple[object, dict, dict]:
    """A one-run backfill of ``name`` (demo data) whose task process is SIGKILLed mid-batch, once its plan is
    committed and before its marker; Airflow's first retry must finish it. The backfill, the lease the killed
    task held, and the backfill's outcome (run states)."""
    import json
    import signal
    import threading
    import time

    from millpond.lake.lease import lease_key
    from millpond.lake.objectstore import ObjectStore
    from millpond.lake.tables import Tables
    from millpond.orchestration.backfill import Backfill
    from millpond.orchestration.dagfactory import TASK_ID

    backfill = Backfill(s, name, start, end, stack=stack, conf={"demo": True})
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(states=backfill.run(timeout=600, echo=lambda _: None)))
    runner.start()
    tables, store, killed = Tables(s), ObjectStore(s), None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and runner.is_alive():
        try:
            lease = json.loads(store.get_bytes(s.bucket_lake, lease_key(s, name)))
        except Exception:  # noqa: BLE001 - not written yet
            lease = {}
        if str(lease.get("owner", "")).startswith("airflow/") and tables.exists(name, "ingest_log") \
                and not tables.exists(name, "batches"):
            os.kill(lease["pid"], signal.SIGKILL)  # the task's process, mid-batch: its plan is committed
            killed = lease
        time.sleep(0.1)
    runner.join(timeout=600)
    assert killed is not None, f"the batch was never caught in the middle: {outcome}"
    assert sorted(outcome["states"].values()) == ["success"], outcome
    (run,) = backfill.runs()
    ti = backfill.api("GET", f"/dags/millpond_{name}/dagRuns/{run['dag_run_id']}/taskInstances/{TASK_ID}")
    assert ti["try_number"] == 2, ti  # the first retry committed
    return backfill, killed, outcome
