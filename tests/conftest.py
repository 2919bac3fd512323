"""Shared fixtures: a real SeaweedFS S3 server on free loopback ports, real Delta tables, a real Spark
Connect server and a client session of it. Every process a fixture starts, it stops."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from millpond.config import Settings, load_settings
from millpond.lake.tables import Tables
from millpond.orchestration.store import EmbeddedStore, isolated_store_env

#: fixtures that start or reach a service: a test using none of them, in a module of model or configuration
#: tests, is a unit test (``make test-unit``: no service, well under a minute)
SERVICE_FIXTURES = frozenset({"settings", "tables", "spark", "airflow_stack", "millpond_home", "pipeline_name"})
MODEL_TEST_MODULES = frozenset({"test_custom_strategies", "test_computation", "test_fast_paths", "test_watermark",
                                "test_dags", "test_properties", "test_settings", "test_layers",
                                "test_pipeline_versions", "test_stages", "test_listing", "test_file_stats",
                                "test_docs_commands"})


#: modules that share one worker of a parallel run (``make test``: pytest-xdist): those using the session's
#: Airflow, which another worker would start again
SHARED_WORKER = {"test_airflow_dagtest": "airflow", "test_airflow_ui": "airflow", "test_airflow_postgres": "airflow"}
#: the longest modules, started first so that no worker is left with one of them at the end (from
#: ``--durations``; any module not named here follows, in file order)
LONGEST_FIRST = ("test_spark_engine", "test_airflow_dagtest", "test_airflow_ui", "test_airflow_postgres",
                 "test_airflow_sqlite",
                 "test_differential_beam", "test_bench_smoke", "test_quality_spark", "test_operations_random",
                 "test_cores", "test_exactly_once",
                 "test_conformance_paper", "test_flink_peer", "test_bounded_waits")


def _stem(nodeid: str) -> str:
    """A test's module name, from its node id (``tests/test_x.py::test_y`` -> ``test_x``)."""
    return nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


def pytest_configure(config: pytest.Config) -> None:
    """Millpond's bytecode cached once, before any worker starts: the suite's many CLI, task and client
    processes then import it rather than compile it each (``PYTHONDONTWRITEBYTECODE`` is set on CI machines)."""
    if not hasattr(config, "workerinput"):
        from millpond.orchestration.bytecode import compile_sources

        compile_sources()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = _stem(item.nodeid)
        if module in MODEL_TEST_MODULES and not SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.unit)
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_stem(item.nodeid), len(rank)))  # stable: file order otherwise


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """A parallel run hands out whole modules (their module-scoped servers start once), the Airflow ones as
    one, in collection order (the longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SHARED_WORKER.get(_stem(nodeid), _stem(nodeid))

    config.option.loadscopereorder = False  # keep the longest-first order
    return ByModule(config, log)


def free_store_env(home: Path) -> dict[str, str]:
    """Environment for an isolated embedded store: its own home and free ports."""
    return isolated_store_env(home)


@pytest.fixture(scope="session")
def millpond_home() -> Iterator[Path]:
    """The session's home (store data, logs, Spark scratch), removed after the servers in it have stopped."""
    home = Path(tempfile.mkdtemp(prefix="millpond-test-"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def settings(millpond_home: Path) -> Settings:
    """A running embedded object store; the process environment points at it for the session."""
    env = free_store_env(millpond_home)
    env["MILLPOND_ENGINE"] = "local"  # the shipped default is spark; tests that want it say so
    # the Connect servers tests start and their clients share one token (a server refuses clients without it)
    env["MILLPOND_SPARK_CONNECT_TOKEN"] = secrets.token_urlsafe(32)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s = load_settings()
    store = EmbeddedStore(s)
    store.start()
    try:
        yield s
    finally:
        store.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tables(settings: Settings) -> Tables:
    return Tables(settings)


@pytest.fixture(scope="session")
def spark(settings: Settings, spark_connect):
    """A Spark Connect client of the session's server, in this process: the product's path (a DAG task's
    session), and no second JVM beside the server's."""
    from millpond.runtime.engines.spark_client import connect

    session = connect(settings.with_overrides(spark_connect=spark_connect.url))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def spark_connect(settings: Settings, tmp_path_factory):
    """A Spark Connect server for the session's commands on the Spark engine (their own processes, as Airflow
    tasks are: ``engines.command_env``), started on first use (``tests/engines.py``)."""
    from engines import connect_server

    with connect_server(settings, tmp_path_factory.mktemp("spark-connect")) as server:
        yield server


@pytest.fixture
def pipeline_name() -> str:
    """A fresh pipeline name so tests never share tables. The underscore keeps it from reading as a
    number to GX's Data Docs renderer (see README, Known limits): "t8386925587" got no validation page."""
    return f"t_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def postgres() -> Iterator[object]:
    """The session's PostgreSQL (``tests/postgres_env.py``), or None where it cannot run (no binaries, not root)."""
    from postgres_env import start_if_possible

    server = start_if_possible()
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def airflow_stack(settings: Settings, millpond_home: Path, postgres):
    """A running Airflow (api-server, scheduler, dag-processor, triggerer) for the session, its metadata in the
    session's PostgreSQL as a deployment's is (SQLite where PostgreSQL cannot run: its lock races made backfills
    wait minutes on a loaded CI machine); stopped after. The embedded default's SQLite stack is
    ``tests/test_airflow_sqlite.py``'s."""
    from airflow_env import start_test_stack, write_conf_dir

    database = {} if postgres is None else {"MILLPOND_AIRFLOW_DB_URL": postgres.url()}
    stack, stack_settings = start_test_stack(write_conf_dir(millpond_home / "airflow-conf"), **database)
    try:
        yield stack, stack_settings
    finally:
        stack.stop()
