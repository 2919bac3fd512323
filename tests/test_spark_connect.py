"""The stack's warm Spark: a Connect server from pyspark's jars on loopback, tasks as clients; a stopped
server is one line that names `make up`. Clients run in their own process, as Airflow tasks do (a process
with a classic Spark session, like this test run's, cannot open a Connect session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from millpond.orchestration.spark_server import SparkConnectServer, _free_port

pytestmark = pytest.mark.slow

CLIENT = """
import json, sys
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.runtime.spark_client import connect
s = load_settings().with_overrides(spark_connect=sys.argv[1])
try:
    spark = connect(s)
except MillpondError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
print(json.dumps({"sum": spark.range(100).selectExpr("sum(id) AS s").collect()[0]["s"], "same": connect(s) is spark}))
"""


def _client(url: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, url], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_connect_server_starts_answers_clients_and_stops(settings, tmp_path) -> None:
    local = settings.with_overrides(home=tmp_path, spark_connect_port=_free_port(), spark_ui_port=_free_port(),
                                    spark_master="local[2]")
    server = SparkConnectServer(local)
    down = _client(local.spark_connect_url)
    assert "is not answering: start it with `make up`" in down["error"]
    assert server.start() is True
    try:
        assert server.start() is False  # idempotent
        assert "running (pid" in server.status() and local.spark_connect_url in server.status()
        assert _client(local.spark_connect_url) == {"sum": 4950, "same": True}
    finally:
        assert server.stop() is True
    assert server.status() == "spark: stopped"
