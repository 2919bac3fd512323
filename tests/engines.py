"""The engine battery's shared parts (issue 36, item 4): run a scenario on a given engine, and compare a
pipeline's tables across engines.

A scenario test is parametrised by ``engine`` (``ENGINES``: the local engine, in this process or a command's,
and the Spark engine: a Connect client of the session's ``spark_connect`` server, in this process (the
``spark`` fixture) or in a command's process, as an Airflow task is). Each scenario checks its
tables against an uninterrupted local run with ``same_tables`` / ``snapshot``: whatever the engine, and whatever
happened on the way (a SIGKILL, a second run, a store stopped or frozen), the tables are the local engine's:
every row of panes, current, windows, seen_ids, late, quarantine, ingest_log and the markers, apart from the
markers' timings, engine and strategy; Delta versions are compared counted from each table's first (a table
the Spark engine creates starts with an empty version 0). Both of the Spark engine's strategies appear across
the battery (``PLAN``: the multi-stage plan; ``ONE_TASK``: a small batch's one task; ``engine.one_task_below``
picks); each test says which it takes.

The battery: ``test_exactly_once`` (SIGKILL after each commit and at random points, including mid Spark job;
two runs of one batch at once; the store stopped mid-batch), ``test_bounded_waits`` (the store frozen
mid-batch), ``test_bad_input`` (the bad-input corpus), ``test_conformance_paper`` (Figure 14),
``test_differential_beam`` (the Beam differential scenarios). The ``seen_ids`` drift of issue 36 (a quiet
batch folding the table on one engine only) is ``test_cores.test_quiet_batches_leave_seen_ids_alone_on_every_engine``.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from millpond.config import Settings
from millpond.lake.schemas import OUTPUT_TABLES
from millpond.lake.tables import Tables

#: ``pytest.mark.parametrize("engine", ENGINES)``
ENGINES = ("local", "spark")
#: the Spark engine's strategies: the multi-stage plan, and a small batch's one task
PLAN, ONE_TASK = "plan", "one_task"
#: every table a windowed pipeline's batch writes, and its commit marker
TABLES = (*OUTPUT_TABLES, "batches")
#: marker columns that differ by engine or run: timings, and which engine and strategy ran the batch
NOT_COMPARED = ("phases", "engine", "strategy")
#: JSON columns naming Delta versions (the marker's, and the plan's pinned ones)
VERSIONED = ("versions",)
#: tables whose versions the comparisons leave out (none: the one divergence this battery found, a ``windows``
#: table created empty on one engine only, is fixed and tested, ``test_bad_input.``
#: ``test_a_batch_closing_every_window_it_opened_names_one_windows_version_on_both_engines``)
DIVERGING_VERSIONS: tuple[str, ...] = ()


def on(settings: Settings, engine: str, strategy: str = ONE_TASK, **overrides) -> Settings:
    """``settings`` running every batch on ``engine`` (however small: ``engine.local_below`` 0), on Spark with
    ``strategy``."""
    assert engine in ENGINES and strategy in (PLAN, ONE_TASK), (engine, strategy)
    return settings.with_overrides(engine=engine, engine_local_below=0,
                                   engine_one_task_below=10**9 if strategy == ONE_TASK else 0, **overrides)


def command_env(engine: str, connect: ConnectServer | None = None, strategy: str = ONE_TASK) -> dict[str, str]:
    """The environment of a `millpond` command (its own process) that runs its batches on ``engine``: on
    spark, a client of ``connect`` (the session's server, ``spark_connect``) as an Airflow task is."""
    env = {"MILLPOND_ENGINE": engine, "MILLPOND_ENGINE_LOCAL_BELOW": "0"}
    if engine == "spark":
        assert connect is not None, "the Spark engine's commands need the session's Connect server"
        env |= {"MILLPOND_SPARK_CONNECT": connect.url,
                "MILLPOND_ENGINE_ONE_TASK_BELOW": str(10**9 if strategy == ONE_TASK else 0)}
    return env


@contextlib.contextmanager
def plan_only_for(batch: int) -> Iterator[None]:
    """Within, a ``replay`` runs its ``batch``-th batch (by its place in the schedule) as the Spark engine's
    multi-stage plan and the others as one task each (its settings' ``engine.one_task_below`` per batch): the
    plan, seconds a batch, where a test needs it. The batches are real; only each one's settings differ."""
    from millpond.surface import replay as module

    real, calls = module.run_batch, []

    def run_batch(settings: Settings, spec, *args, **kwargs):
        calls.append(spec.name)
        strategy = PLAN if len(calls) == batch else ONE_TASK
        return real(settings.with_overrides(engine_one_task_below=0 if strategy == PLAN else 10**9), spec, *args,
                    **kwargs)

    module.run_batch = run_batch
    try:
        yield
    finally:
        module.run_batch = real


# -- tables ------------------------------------------------------------------------------------------------
def _relative_versions(rows: dict[str, list[dict]]) -> dict[str, int]:
    """Each table's first version named by any ``versions`` column: versions are compared counted from it.
    (A table the Spark engine creates starts with an empty version 0, the local engine's first write is its
    version 0: the same history is shifted by one.)"""
    first: dict[str, int] = {}
    for table_rows in rows.values():
        for r in table_rows:
            for col in VERSIONED:
                for table, v in json.loads(r.get(col) or "{}").items():
                    if isinstance(v, int):
                        first[table] = min(v, first.get(table, v))
    return first


def snapshot(tables: Tables, pipeline: str, names: tuple[str, ...] = TABLES,
             unversioned: tuple[str, ...] = DIVERGING_VERSIONS) -> dict[str, list[str]]:
    """Every table's rows, order-free, with the pipeline's name as ``<pipeline>``, without the marker's timings,
    engine and strategy, Delta versions counted from each table's first one named (``_relative_versions``);
    the versions of the tables ``unversioned`` left out (a known divergence, tested on its own)."""
    rows = {}
    for name in names:
        t = tables.read_arrow(pipeline, name, schema=pa.schema([]))
        rows[name] = t.drop([c for c in NOT_COMPARED if c in t.column_names]).to_pylist()
    first = _relative_versions(rows)
    out = {}
    for name, table_rows in rows.items():
        for r in table_rows:
            for col in VERSIONED:
                if r.get(col):
                    r[col] = json.dumps({t: v - first[t] if isinstance(v, int) else v
                                         for t, v in sorted(json.loads(r[col]).items()) if t not in unversioned})
        out[name] = sorted(repr(sorted(r.items())).replace(pipeline, "<pipeline>") for r in table_rows)
    return out


def _around_first_difference(a: str, b: str, width: int = 240) -> tuple[str, str]:
    """``a`` and ``b`` cut to the part around where they first differ."""
    i = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    start = a.rfind("), (", 0, i)  # the column's start
    lo = start + 3 if start >= 0 else 0
    return (("..." if lo else "") + a[lo:lo + width], ("..." if lo else "") + b[lo:lo + width])


def differences(want: dict[str, list[str]], got: dict[str, list[str]], limit: int = 6) -> list[str]:
    """Readable differences of two snapshots: per table, the rows only in one of them (a pair of rows in the
    same place shown from the column where they first differ)."""
    out = []
    for table in sorted(set(want) | set(got)):
        a, b = want.get(table, []), got.get(table, [])
        if a == b:
            continue
        only_a, only_b = [r for r in a if r not in b], [r for r in b if r not in a]
        out.append(f"{table}: {len(a)} rows vs {len(b)}; {len(only_a)} only in the first, {len(only_b)} only in "
                   "the second")
        for x, y in list(zip(only_a, only_b, strict=False))[:limit]:
            x, y = _around_first_difference(x, y)
            out += [f"  - {x}", f"  + {y}"]
        rest = min(len(only_a), len(only_b))
        out += [f"  - {r[:400]}" for r in only_a[rest:rest + limit]]
        out += [f"  + {r[:400]}" for r in only_b[rest:rest + limit]]
    return out


def assert_same(want: dict[str, list[str]], got: dict[str, list[str]], what: str = "") -> None:
    """Two snapshots are equal, or an assertion listing where they differ."""
    problems = differences(want, got)
    assert not problems, f"tables differ{' (' + what + ')' if what else ''}:\n" + "\n".join(problems)


def same_tables(tables: Tables, a: str, b: str, names: tuple[str, ...] = TABLES,
                unversioned: tuple[str, ...] = DIVERGING_VERSIONS) -> dict[str, list[str]]:
    """Pipelines ``a`` and ``b`` have identical tables (``snapshot``); returns ``a``'s snapshot."""
    want = snapshot(tables, a, names, unversioned)
    assert_same(want, snapshot(tables, b, names, unversioned), f"{a} vs {b}")
    return want


# -- the session's Connect server ------------------------------------------------------------------------------
@dataclass
class ConnectServer:
    """A running Spark Connect server: its endpoint (its clients pass the session's token, from the
    environment) and its UI's REST API."""

    url: str
    ui_url: str
    #: the server's Spark application, as its UI names it
    app: str | None = None
    #: the latest job id ``last_job`` found
    last: int | None = None
    #: the server's log (Spark's own warnings)
    log: Path | None = None

    def _get(self, path: str):
        with urllib.request.urlopen(f"{self.ui_url}/api/v1/{path}", timeout=30) as resp:
            return json.loads(resp.read())

    def _app(self) -> str:
        if self.app is None:
            self.app = self._get("applications")[0]["id"]
        return self.app

    def _job_exists(self, job: int) -> bool:
        try:
            self._get(f"applications/{self._app()}/jobs/{job}")
            return True
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            return False

    def last_job(self) -> int:
        """The id of the latest Spark job the server has started (-1: none yet): listed once, then found by
        looking ids up upward from the last one known (a listing of every job the UI keeps takes long on a warm
        server, long enough for a small batch's jobs to start and end meanwhile)."""
        if self.last is None:
            self.last = max((j["jobId"] for j in self._get(f"applications/{self._app()}/jobs")), default=-1)
        lo, step = self.last, 1
        while self._job_exists(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._job_exists(mid) else (lo, mid)
        self.last = lo
        return lo

    def wait_for_a_job(self, after: int, timeout: float = 60.0) -> bool:
        """Return as soon as the server has started a job later than job ``after`` (True), or after ``timeout``
        (False): that one job looked up by its id (the UI's listener lags a job's start by milliseconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._job_exists(after + 1):
                return True
            time.sleep(0.005)
        return False


@contextlib.contextmanager
def connect_server(settings: Settings, home: Path) -> Iterator[ConnectServer]:
    """A Connect server of pyspark's jars on loopback (``local[2]``), its data under ``home``, taking the
    session's token (``settings.spark_connect_token``): started, then stopped with every process it started."""
    from millpond.orchestration.processes import free_port
    from millpond.orchestration.spark_server import SparkConnectServer

    local = settings.with_overrides(home=home, spark_connect_port=free_port(), spark_ui_port=free_port(),
                                    spark_master="local[2]", spark_driver_memory="2g")
    assert local.spark_connect_token, "the session's settings give Connect servers and clients a token"
    server = SparkConnectServer(local)
    server.start()
    try:
        yield ConnectServer(url=local.spark_connect_url, ui_url=server.ui_url, log=server.logfile)
    finally:
        server.stop()


def asked_columns(monkeypatch) -> list[str]:
    """The ``mapInArrow`` calls of this process's Connect clients that ask the server for their input's columns
    (an analysis round trip: ``lake.spark_io.map_arrow``), as they happen: the list returned fills."""
    from pyspark.sql.connect.dataframe import DataFrame

    asked: list[str] = []
    real = DataFrame._map_partitions

    def recording(self, func, *args, **kwargs):
        if self._cached_schema is None:
            asked.append(repr(func)[:120])
        return real(self, func, *args, **kwargs)

    monkeypatch.setattr(DataFrame, "_map_partitions", recording)
    return asked



def server_asks(monkeypatch) -> list[str]:
    """The settings and analyses this process's Connect clients ask the server for on the batch's own threads
    (each a round trip: 10-40 ms on a warm server, more under load), as they happen: ``config:<op>`` for a setting
    read or written, ``analyze:<method>`` for a schema, a DDL text parsed or a kept frame released. The watchdog's
    probes (``spark_watchdog``, a thread of their own that no job waits on) are left out. The list returned fills."""
    import threading

    from pyspark.sql.connect.client.core import SparkConnectClient

    asked: list[str] = []
    config, analyze = SparkConnectClient.config, SparkConnectClient._analyze

    def record(what: str) -> None:
        if threading.current_thread().name != "spark-probe":
            asked.append(what)

    def configuring(self, operation):
        record(f"config:{operation.WhichOneof('op_type')}")
        return config(self, operation)

    def analyzing(self, method, **kwargs):
        record(f"analyze:{method}")
        return analyze(self, method, **kwargs)

    monkeypatch.setattr(SparkConnectClient, "config", configuring)
    monkeypatch.setattr(SparkConnectClient, "_analyze", analyzing)
    return asked
