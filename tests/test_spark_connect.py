"""The stack's warm Spark: a Connect server from pyspark's jars on loopback, tasks as clients; a stopped
server is one line that names `make up`; only clients with the stack's token run code on it; the commands
(`millpond batch`, `millpond replay`) are its clients when the deployment's engine is spark. Clients run in
their own process, as Airflow tasks do. The module starts one server (``connect_server``): the commands' test
uses it, then the server's life test ends it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.lake.tables import Tables
from millpond.orchestration.processes import free_port, read_pid
from millpond.orchestration.spark_server import SparkConnectServer

pytestmark = pytest.mark.slow
SCENARIOS = Path(__file__).parent / "scenarios"

CLIENT = """
import json, sys
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.runtime.engines.spark_client import connect
s = load_settings().with_overrides(spark_connect=sys.argv[1])
try:
    spark = connect(s)
except MillpondError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
print(json.dumps({"sum": spark.range(100).selectExpr("sum(id) AS s").collect()[0]["s"], "same": connect(s) is spark}))
"""


#: where a client finds a token besides its settings: none of them leaks from this run's environment
TOKEN_VARS = ("MILLPOND_SPARK_CONNECT_TOKEN", "SPARK_CONNECT_AUTHENTICATE_TOKEN")


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in TOKEN_VARS} | extra


def _client(url: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, url], capture_output=True, text=True, timeout=300,
                         env=_env(**env))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


REFUSED = """
import json, sys
from pyspark.sql import SparkSession
out = {}
for name, url in json.loads(sys.argv[1]).items():  # plain pyspark clients, each its own session
    try:
        out[name] = SparkSession.builder.remote(url).create().range(10).selectExpr("sum(id) AS s").collect()[0]["s"]
    except Exception as exc:
        out[name] = " ".join(str(exc).split())[:400]
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.runtime.engines.spark_client import connect
try:  # Millpond's own client, its token (MILLPOND_SPARK_CONNECT_TOKEN) wrong
    out["millpond"] = connect(load_settings().with_overrides(spark_connect=sys.argv[2])).range(10).count()
except MillpondError as exc:
    out["millpond"] = str(exc)
print(json.dumps(out))
"""


def _refused(urls: dict[str, str], millpond_url: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", REFUSED, json.dumps(urls), millpond_url], capture_output=True,
                         text=True, timeout=300, env=_env(**env))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


FROZEN_CLIENT = """
import sys
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.model.spec import pipeline_from_dict
from millpond.runtime.engines.spark_client import connect
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
    if sys.stdin.readline().strip() != "rerun":
        raise SystemExit(3)
# thawed: the same process reruns (as `millpond run` goes on), on the new session connect makes, in one task a batch
s = s.with_overrides(engine_one_task_below=1_000_000)
replay(s, pipeline_from_dict(doc), read_events(sys.argv[3]), spark=connect(s))
print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def connect_server(settings, tmp_path_factory):
    """The module's one Connect server (a JVM start costs seconds of both cores), started once: what a client
    got before it started, and whether ``start`` started it, for the life test (which stops it; so does the
    teardown, if a test left it running)."""
    home = tmp_path_factory.mktemp("connect-home")
    # no configured token: the server takes the one `make up` generates (the session's, if any, is not used)
    local = settings.with_overrides(home=home, spark_connect_port=free_port(), spark_ui_port=free_port(),
                                    spark_master="local[2]", spark_connect_token="")
    server = SparkConnectServer(local)
    down = _client(local.spark_connect_url)
    # started from a process that is a Connect client itself (as this test run is, or a shell set up for a remote
    # Spark): the driver must not take those variables for its own and exit at start
    client_vars = {"SPARK_CONNECT_MODE_ENABLED": "1", "SPARK_REMOTE": "sc://127.0.0.1:1"}
    saved = {k: os.environ.get(k) for k in client_vars}
    os.environ.update(client_vars)
    try:
        started = server.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield SimpleNamespace(settings=local, server=server, down=down, started=started)
    finally:
        pid = read_pid(server.pidfile)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGCONT)
            server.stop()


def _completed_jobs(ui_url: str) -> int:
    """The Spark jobs the server's application has completed, from its UI's REST API (a Connect client has
    no ``sparkContext`` to ask)."""
    def get(path: str, attempts: int = 3):
        try:  # the UI's first answers can take long on a busy machine (two cores, the JVM still warming up)
            with urllib.request.urlopen(f"{ui_url}/api/v1/{path}", timeout=60) as resp:
                return json.loads(resp.read())
        except OSError:
            if attempts == 1:
                raise
            return get(path, attempts - 1)

    app = get("applications")[0]["id"]
    return sum(job["status"] == "SUCCEEDED" for job in get(f"applications/{app}/jobs"))


def _jobs_settled(ui_url: str, at_least: int | None = None, wait: float = 15.0) -> int:
    """The completed-job count once the UI has caught up (its listener lags the jobs a little): at least
    ``at_least`` if that comes within ``wait``; without one, once two reads a second apart agree."""
    deadline, n = time.monotonic() + wait, _completed_jobs(ui_url)
    while time.monotonic() < deadline:
        if at_least is not None and n >= at_least:
            return n
        time.sleep(1.0)
        n, last = _completed_jobs(ui_url), n
        if at_least is None and n == last:
            return n
    return n


def _millpond(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The console script's code (``python -m millpond``) in its own process, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "millpond", *args], capture_output=True, text=True, timeout=600,
                          env=_env(**env))


def test_commands_run_on_the_deployments_connect_server_unless_told_local(connect_server, tmp_path,
                                                                         pipeline_name) -> None:
    """With engine spark (from the environment), `millpond batch` and `millpond replay` are clients of the
    deployment's Connect server: their batches are Spark jobs there, and the summary names spark; with
    `--engine local` the same commands run in-process (no job on the server) and give the same panes."""
    from millpond.lake.landing import arrival_tag
    from millpond.lake.objectstore import ObjectStore
    from millpond.model.timeutil import to_us

    local, server = connect_server.settings, connect_server.server
    env = {"MILLPOND_ENGINE": "spark", "MILLPOND_SPARK_CONNECT": local.spark_connect_url,
           "MILLPOND_SPARK_CONNECT_TOKEN": server.token_file.read_text().strip()}
    store = ObjectStore(local)
    for name, engine, forced in ((pipeline_name, "spark", ()), (f"{pipeline_name}_l", "local", ("--engine", "local"))):
        conf = tmp_path / f"{name}.yaml"
        conf.write_text(json.dumps({"name": name, "window": {"type": "sessions", "gap": "1m"}, "batch_interval": "1m"}))
        body = "".join(json.dumps({"id": f"e{i}", "key": f"k{i % 3}", "value": i,
                                   "event_time": f"2026-01-01T12:0{i % 4}:10Z"}) + "\n" for i in range(12))
        store.put_bytes(local.bucket_landing, f"{name}/{arrival_tag(to_us('2026-01-01T12:04:00Z'))}-a.jsonl",
                        body.encode())
        before = _jobs_settled(server.ui_url)
        out = _millpond("batch", str(conf), "--at", "2026-01-01T12:05:00Z", "--watermark", "2026-01-01T12:05:00Z",
                        *forced, **env)
        assert out.returncode == 0, out.stderr[-2000:]
        summary = out.stdout.strip().splitlines()[-1]
        assert "input 12, accepted 12" in summary and f"; engine {engine}/" in summary, summary
        marker = Tables(local).read_arrow(name, "batches", schema=BATCHES_SCHEMA).select(["engine", "strategy"])
        assert marker.to_pylist() == [{"engine": engine, "strategy": "one-task" if engine == "spark" else "in-process"}]
        after = _jobs_settled(server.ui_url, at_least=before + 1 if engine == "spark" else None)
        # on spark, the batch was Spark jobs on this server; told local, it ran none there
        assert after > before if engine == "spark" else after == before, (engine, before, after)
    # replay: --engine spark and --engine local, the same panes
    panes = {}
    for engine in ("spark", "local"):
        before = _jobs_settled(server.ui_url)
        out = _millpond("replay", "--pipeline", str(SCENARIOS / "fig14_sessions_retracting.yaml"),
                        "--events", str(SCENARIOS / "fig14_sessions_retracting.jsonl"),
                        "--name", f"{pipeline_name}_r{engine[0]}", "--engine", engine,
                        **env | {"MILLPOND_ENGINE": "local" if engine == "spark" else "spark"})
        assert out.returncode == 0, out.stderr[-2000:]
        summaries = [line for line in out.stderr.splitlines() if " batch " in line and " @ " in line]
        assert summaries and all(f"; engine {engine}/" in line for line in summaries), out.stderr[-2000:]
        panes[engine] = out.stdout.replace(f"{pipeline_name}_r{engine[0]}", "P")
        after = _jobs_settled(server.ui_url, at_least=before + 1 if engine == "spark" else None)
        assert after > before if engine == "spark" else after == before, (engine, before, after)
    assert panes["spark"] == panes["local"] and panes["local"].count("\n") > 0


def test_connect_server_starts_answers_clients_fails_a_frozen_batch_in_time_and_stops(connect_server,
                                                                                      pipeline_name) -> None:
    """One server's life: a client before it starts gets one line naming `make up`; started (idempotently), it
    refuses clients without its token or with a wrong one, and answers those with it: the stack's own (the
    token `make up` generated into the home, owner-only) and a deployment's (the token from the environment);
    paused (SIGSTOP: it still accepts connections), it fails the running batch in about ``spark.timeout`` with
    one line naming it, instead of hanging until the task's timeout; thawed, the same process reruns and exits;
    stopped, nothing of it is left."""
    from millpond.orchestration.processes import group_members

    local, server = connect_server.settings, connect_server.server
    port = local.spark_connect_port
    assert "is not answering: start it with `make up`" in connect_server.down["error"]
    assert connect_server.started is True
    group = os.getpgid(read_pid(server.pidfile))
    client = None
    try:
        wrong = "w" * 43  # a token's shape, not the token
        refused = _refused({"plain": f"sc://127.0.0.1:{port}", "wrong": f"sc://localhost:{port}/;token={wrong}"},
                           local.spark_connect_url, MILLPOND_SPARK_CONNECT_TOKEN=wrong)
        assert "UNAUTHENTICATED" in str(refused["plain"]), refused
        assert "No authentication token provided" in str(refused["plain"]), refused
        assert "Invalid authentication token" in str(refused["wrong"]), refused
        assert "refused this client" in str(refused["millpond"]) and wrong not in str(refused["millpond"]), refused
        token_file = server.token_file
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert server.start() is False  # idempotent
        assert token_file.read_text().strip() == token  # generated once
        assert "running (pid" in server.status() and local.spark_connect_url in server.status()
        # the stack's own clients (Airflow tasks: the same MILLPOND_HOME) read the token from the home
        assert _client("", MILLPOND_HOME=str(local.home), MILLPOND_SPARK_CONNECT_PORT=str(port)) == \
            {"sum": 4950, "same": True}
        events = Path(__file__).parent / "scenarios" / "fig14_sessions_retracting.jsonl"
        # a deployment's endpoint (spark.connect) with its token from the environment
        client = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, local.spark_connect_url, pipeline_name,
                                   str(events)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_env(MILLPOND_SPARK_CONNECT_TOKEN=token))
        lines: queue.Queue[str] = queue.Queue()
        errors: list[str] = []  # read as it comes: a full pipe would stop the client
        threading.Thread(target=lambda: [lines.put(line) for line in client.stdout], daemon=True).start()
        threading.Thread(target=lambda: errors.extend(client.stderr), daemon=True).start()
        assert lines.get(timeout=120).strip() == "connected"
        time.sleep(4)  # inside the replay's first Spark batch (its first data-source read alone takes seconds)
        os.killpg(group, signal.SIGSTOP)
        frozen_at = time.monotonic()
        said = lines.get(timeout=120)
        waited = time.monotonic() - frozen_at
        assert said.startswith("error: Spark Connect server at " + local.spark_connect_url +
                               " did not answer within 8s"), said
        assert waited < 8 + 5 + 30, waited  # the timeout, a probe interval, and closing the channel
        # thawed, the same process reruns and exits: pyspark closed its new session only in the interpreter's
        # finalization, where that close waited for good on gRPC's stopped threads
        os.killpg(group, signal.SIGCONT)
        client.stdin.write("rerun\n")
        client.stdin.flush()
        client.wait(timeout=240)
        assert client.returncode == 0 and lines.get(timeout=5).strip() == "finished", "".join(errors)[-3000:]
    finally:
        os.killpg(group, signal.SIGCONT)
        if client is not None and client.poll() is None:
            client.kill()
        assert server.stop() is True
    assert server.status() == "spark: stopped"
    assert group_members(group) == []  # the driver program too, though its JVM left first


def test_every_shipped_pipeline_runs_as_spark_jobs(connect_server) -> None:
    """`millpond run --direct` (what `make run` runs when Airflow is not up; a DAG task runs the same batch) with
    engine spark: the batches of all five shipped pipelines (two windowed landing pipelines, a stage over
    video_sessions' panes, Zeitgeist's counter and its MillWheel model computation over the counter's panes) are
    Spark jobs on the deployment's Connect server: every marker names the Spark engine and its strategy."""
    from millpond.config.pipelines import load_pipelines
    from millpond.lake.objectstore import ObjectStore

    local, server = connect_server.settings, connect_server.server
    server.start()  # idempotent: the module's life test stops the server it shares
    buckets = {"bucket_landing": "shipped-landing", "bucket_lake": "shipped-lake"}  # the shipped names, alone here
    ObjectStore(local.with_overrides(**buckets)).ensure_buckets()
    env = {"MILLPOND_ENGINE": "spark", "MILLPOND_SPARK_CONNECT": local.spark_connect_url,
           "MILLPOND_SPARK_CONNECT_TOKEN": server.token_file.read_text().strip(),
           "MILLPOND_BUCKET_LANDING": buckets["bucket_landing"], "MILLPOND_BUCKET_LAKE": buckets["bucket_lake"]}
    before = _jobs_settled(server.ui_url)
    out = _millpond("run", "--direct", "--batches", "1", **env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    tables = Tables(local.with_overrides(**buckets))
    shipped = sorted(load_pipelines())
    assert len(shipped) == 5, shipped
    ran = {name: tables.read_arrow(name, "batches", schema=BATCHES_SCHEMA).select(["engine", "strategy"]).to_pylist()
           for name in shipped}
    assert all(len(markers) == 1 and all(m["engine"] == "spark" and m["strategy"] in ("plan", "one-task")
                                         for m in markers) for markers in ran.values()), ran
    # each batch is one Spark job at least (a small validated batch is one task: one job; Zeitgeist's model, a plan)
    assert _jobs_settled(server.ui_url, at_least=before + len(shipped)) >= before + len(shipped)
    # the stage consumed every pane its upstream's batch emitted (whether an hour's pane fires in one batch depends
    # on the wall clock: the early trigger is aligned to the epoch)
    upstream_panes = tables.read_arrow("video_sessions", "panes", schema=pa.schema([])).num_rows
    stage = tables.read_arrow("video_watch_hourly", "batches", schema=BATCHES_SCHEMA).to_pylist()[0]
    assert stage["input"] == upstream_panes, (stage, upstream_panes)
    assert tables.read_arrow("zeitgeist", "batches").num_rows
