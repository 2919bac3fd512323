"""The stack's warm Spark: a Connect server from pyspark's jars on loopback, tasks as clients; a stopped
server is one line that names `make up`. Clients run in their own process, as Airflow tasks do (a process
with a classic Spark session, like this test run's, cannot open a Connect session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from millpond.orchestration.processes import free_port, read_pid
from millpond.orchestration.spark_server import SparkConnectServer

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


FROZEN_CLIENT = """
import sys
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.model.spec import pipeline_from_dict
from millpond.runtime.spark_client import connect
from millpond.surface.replay import read_events, replay
# the multi-stage plan: several seconds per batch, so that the freeze lands inside one
s = load_settings().with_overrides(spark_connect=sys.argv[1], engine="spark", engine_local_below=0, spark_timeout_s=8.0,
                                   engine_one_task_below=0)
spark = connect(s)
print("connected", flush=True)
doc = {"name": sys.argv[2], "source": {"prefix": "replay/" + sys.argv[2] + "/"}, "window": {"type": "sessions",
       "gap": "1m"}, "accumulation": "accumulating_and_retracting", "allowed_lateness": "10m", "batch_interval": "1m"}
try:
    replay(s, pipeline_from_dict(doc), read_events(sys.argv[3]), spark=spark)
except MillpondError as exc:
    print("error: " + str(exc), flush=True)
    raise SystemExit(3)
print("finished", flush=True)
"""


def test_connect_server_starts_answers_clients_fails_a_frozen_batch_in_time_and_stops(settings, tmp_path,
                                                                                      pipeline_name) -> None:
    """One server's life: a client before it starts gets one line naming `make up`; started (idempotently), it
    answers clients; paused (SIGSTOP: it still accepts connections), it fails the running batch in about
    ``spark.timeout`` with one line naming it, instead of hanging until the task's timeout; stopped, nothing of
    it is left."""
    from millpond.orchestration.processes import group_members

    local = settings.with_overrides(home=tmp_path, spark_connect_port=free_port(), spark_ui_port=free_port(),
                                    spark_master="local[2]")
    server = SparkConnectServer(local)
    down = _client(local.spark_connect_url)
    assert "is not answering: start it with `make up`" in down["error"]
    assert server.start() is True
    group = os.getpgid(read_pid(server.pidfile))
    client = None
    try:
        assert server.start() is False  # idempotent
        assert "running (pid" in server.status() and local.spark_connect_url in server.status()
        assert _client(local.spark_connect_url) == {"sum": 4950, "same": True}
        events = Path(__file__).parent / "scenarios" / "fig14_sessions_retracting.jsonl"
        client = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, local.spark_connect_url, pipeline_name,
                                   str(events)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ))
        assert client.stdout.readline().strip() == "connected"
        time.sleep(4)  # inside the replay's first Spark batch (its first data-source read alone takes seconds)
        os.killpg(group, signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, err = client.communicate(timeout=120)
        waited = time.monotonic() - frozen_at
        assert client.returncode == 3, (out, err[-2000:])
        assert "Spark Connect server at " + local.spark_connect_url + " did not answer within 8s" in out
        assert waited < 8 + 5 + 30, waited  # the timeout, a probe interval, and closing the channel
    finally:
        os.killpg(group, signal.SIGCONT)
        if client is not None and client.poll() is None:
            client.kill()
        assert server.stop() is True
    assert server.status() == "spark: stopped"
    assert group_members(group) == []  # the driver program too, though its JVM left first
