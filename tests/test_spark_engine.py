"""The product's main path, scaled out: batches as Spark jobs submitted by a Spark Connect client (as an
Airflow task is) to a Connect server whose master is a standalone cluster of two worker JVMs, against the
local engine's tables. (The same path on ``local[*]`` is tests/test_ingest.py's and tests/test_cores.py's.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from millpond.config.settings import PROJECT_ROOT
from millpond.model.spec import pipeline_from_dict
from millpond.orchestration import executor_env
from millpond.orchestration.processes import free_port
from millpond.orchestration.spark_server import SparkConnectServer, StandaloneCluster
from millpond.surface.replay import read_events, replay

pytestmark = pytest.mark.slow

SCENARIOS = Path(__file__).parent / "scenarios"
DOC = {"window": {"type": "sessions", "gap": "1m"},
       "trigger": "SequenceOf(RepeatUntil(AtPeriod('1m'), AtWatermark()), Repeat(AtWatermark()))",
       "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "10m",
       "batch_interval": "1m"}
CLIENT = """
import json, sys
from millpond.config import load_settings
from millpond.model.spec import pipeline_from_dict
from millpond.runtime.engines.spark_client import connect
from millpond.surface.replay import read_events, replay
doc, events, url, one_task_below = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
settings = load_settings().with_overrides(engine="spark", spark_connect=url, engine_one_task_below=one_task_below)
replay(settings, pipeline_from_dict(doc), read_events(events), spark=connect(settings))
print("ok")
"""
#: where each executor's Python workers run: their interpreter and the modules they import (as a client's
#: function, pickled by value, sees them on the executor)
PROBE = """
import json, sys
from millpond.config import load_settings
from millpond.runtime.engines.spark_client import connect
def where(batches):
    import os, sys, pyarrow as pa, millpond, pyspark
    for _ in batches:
        yield pa.RecordBatch.from_pylist([{"python": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd(),
                                           "millpond": millpond.__file__, "pyarrow": pa.__file__,
                                           "pyspark": pyspark.__file__}])
spark = connect(load_settings().with_overrides(engine="spark", spark_connect=sys.argv[1]))
rows = spark.range(0, 4, 1, 4).mapInArrow(where, ", ".join(f"{c} string" for c in
                                          ("python", "prefix", "cwd", "millpond", "pyarrow", "pyspark"))).collect()
print(json.dumps([r.asDict() for r in rows]))
"""
#: the executors' environment archive, kept across runs like the other test environments under var/
EXECUTOR_CACHE = PROJECT_ROOT / "var" / "spark" / "executor-env"


def _doc(name: str) -> dict:
    return {"name": name, "source": {"prefix": f"replay/{name}/"}, **DOC,
            "watermark": {"policy": "bounded_out_of_orderness", "bound": "30s"}}


def _table(tables, name: str, table: str) -> list[str]:
    t = tables.read_arrow(name, table, schema=pa.schema([]))
    drop = [c for c in ("phases", "versions", "engine", "strategy") if c in t.column_names]
    return sorted(repr(sorted(r.items())).replace(name, "P") for r in t.drop(drop).to_pylist())


def _compare(tables, local: str, other: str) -> None:
    for table in ("panes", "current", "windows", "late", "seen_ids", "batches"):
        assert _table(tables, local, table) == _table(tables, other, table), table


def _run_client(url: str, name: str, one_task_below: int) -> None:
    out = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(_doc(name)),
                          str(SCENARIOS / "fig14_sessions_retracting.jsonl"), url, str(one_task_below)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _local_run(settings, name: str) -> str:
    replay(settings.with_overrides(engine="local"), pipeline_from_dict(_doc(name)),
           read_events(SCENARIOS / "fig14_sessions_retracting.jsonl"))
    return name


@contextlib.contextmanager
def _cluster(settings, home: Path) -> Iterator[tuple[StandaloneCluster, str]]:
    """A standalone master with two one-core workers, and a Connect server on it: (cluster, Connect URL)."""
    local = settings.with_overrides(home=home)
    cluster = StandaloneCluster(local, workers=2, cores=1, memory="1g")
    master = cluster.start()
    server_settings = local.with_overrides(spark_connect_port=free_port(), spark_ui_port=free_port(),
                                           spark_master=master)
    server = SparkConnectServer(server_settings, executor_cache=EXECUTOR_CACHE)
    try:
        server.start()
        yield cluster, server_settings.spark_connect_url
    finally:
        server.stop()
        cluster.stop()


def _assert_shipped_python(url: str, home: Path) -> None:
    """Every probed Python worker ran the interpreter and packages its executor unpacked from the archive into
    its work directory (``<home>/spark/work/<app>/<executor>/environment``), not this checkout's ``.venv``."""
    out = subprocess.run([sys.executable, "-c", PROBE, url], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    work, here = (home / "spark" / "work").resolve(), Path(sys.prefix).resolve()
    for row in rows:
        env = Path(row["cwd"]).resolve() / executor_env.ALIAS
        assert Path(row["cwd"]).resolve().is_relative_to(work), row
        assert Path(row["python"]).resolve() == env / "bin" / executor_env.VERSION, row
        assert Path(row["prefix"]).resolve() == env, row
        for module in ("millpond", "pyarrow"):
            assert Path(row[module]).resolve().is_relative_to(env / "lib"), row
            assert not Path(row[module]).resolve().is_relative_to(here), row
        assert "pyspark.zip" in row["pyspark"], row  # the worker's Spark's own, not a copy in the archive


def test_a_cluster_of_two_workers_matches_the_local_engine_even_when_one_is_killed(settings, tables, pipeline_name,
                                                                                    tmp_path) -> None:
    """Two streams on one cluster (its JVMs cost more than either stream), each against the local engine's
    tables: the first with both workers up, each batch one task on a worker (a small batch's default); the second
    as the multi-stage plan, whose stages spread over both workers, with one of the two worker JVMs SIGKILLed
    once its first batch has committed, so that Spark retries the lost tasks on the other worker (or a batch
    reruns under its application transaction)."""
    import time

    local = _local_run(settings, f"{pipeline_name}_local")
    name = f"{pipeline_name}_killed"
    with _cluster(settings, tmp_path) as (cluster, url):
        _assert_shipped_python(url, tmp_path)
        _run_client(url, f"{pipeline_name}_cluster", settings.engine_one_task_below)
        _compare(tables, local, f"{pipeline_name}_cluster")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(_doc(name)),
                                   str(SCENARIOS / "fig14_sessions_retracting.jsonl"), url, "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        deadline = time.monotonic() + 300
        while tables.version(name, "batches") is None and time.monotonic() < deadline and client.poll() is None:
            time.sleep(0.5)
        assert client.poll() is None, "the stream ended before a worker could be killed"
        assert cluster.kill_worker(0)
        out, err = client.communicate(timeout=600)
        assert client.returncode == 0 and out.strip().endswith("ok"), err[-3000:]
        # the archive each executor fetched went to the cluster's home, not to /tmp (where the killed worker's
        # executor would have left its 200 MB copy)
        assert list((tmp_path / "spark" / "tmp").glob("spark-*/millpond-executor-*.tar.gz"))
    _compare(tables, local, name)
