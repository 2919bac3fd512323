"""The stack's warm Spark: a Connect server from pyspark's jars on loopback, tasks as clients; a stopped
server is one line that names `make up`."""

from __future__ import annotations

import pytest
from millpond.errors import MillpondError
from millpond.orchestration.spark_server import SparkConnectServer, _free_port
from millpond.runtime.spark_client import connect, disconnect

pytestmark = pytest.mark.slow


def test_connect_server_starts_answers_clients_and_stops(settings, tmp_path) -> None:
    local = settings.with_overrides(home=tmp_path, spark_connect_port=_free_port(), spark_ui_port=_free_port(),
                                    spark_master="local[2]")
    server = SparkConnectServer(local)
    with pytest.raises(MillpondError, match=r"is not answering: start it with `make up`"):
        connect(local)
    assert server.start() is True
    try:
        assert server.start() is False  # idempotent
        assert "running (pid" in server.status() and local.spark_connect_url in server.status()
        spark = connect(local)
        assert spark.range(100).selectExpr("sum(id) AS s").collect()[0]["s"] == 4950
        assert connect(local) is spark  # one session per process
        disconnect(local)
    finally:
        assert server.stop() is True
    assert server.status() == "spark: stopped"
