"""The local stack as one thing: start, stop and report every embedded service (`make up/down/status`)."""

from __future__ import annotations

from millpond.config import Settings
from millpond.orchestration.airflow_stack import AirflowStack, airflow_config
from millpond.orchestration.processes import read_pid
from millpond.orchestration.spark_server import SparkConnectServer
from millpond.orchestration.store import EmbeddedStore


def up(settings: Settings) -> None:
    """Start every embedded service that is not running; print where they are."""
    store = EmbeddedStore(settings)
    started = store.start()
    print(f"object store {'started' if started else 'already running'}: {settings.s3_endpoint} "
          f"(buckets {', '.join(settings.buckets)}; data in {store.data_dir})")
    if not settings.spark_connect:  # an external Connect endpoint needs no server of ours
        spark = SparkConnectServer(settings)
        started = spark.start()
        print(f"spark {'started' if started else 'already running'}: {spark.url} (master {spark.master}; "
              f"Spark UI {spark.ui_url}; clients pass the token in {spark.token_source})")
    if airflow_config(settings).enabled:
        stack = AirflowStack(settings)
        started = stack.start()
        print(f"airflow {'started' if started else 'already running'}: {stack.url} "
              f"(user admin, password {stack.admin_password()}; metadata database {stack.database})")


def down(settings: Settings) -> None:
    print("airflow stopped" if AirflowStack(settings).stop() else "airflow was not running")
    print("spark stopped" if SparkConnectServer(settings).stop() else "spark was not running")
    store = EmbeddedStore(settings)
    print("object store stopped" if store.stop() else "object store was not running")


def status(settings: Settings) -> list[str]:
    store = EmbeddedStore(settings)
    pid = read_pid(store.pidfile)
    state = f"running (pid {pid}) at {settings.s3_endpoint}" if pid else "stopped"
    return [f"object store: {state}", SparkConnectServer(settings).status(), *AirflowStack(settings).status()]
