"""The warm Spark's driver program: a Spark session whose Connect service serves the stack's Airflow tasks.

Why not Spark's own ``SparkConnectServer`` class: it forces ``spark.sql.artifact.isolation.enabled`` on, which
gives every Connect session its own job-artifact id, and Spark keys its Python worker pool by that id. So each
client (each Airflow task) started a fresh Python daemon and fresh workers on the server, each importing
pyarrow and millpond again: about a second per batch on a calm box, many at load. Here the Connect sessions
share one artifact space (all clients are this deployment's own tasks; none uploads artifacts), so they share
the workers, and the daemon they fork from (``runtime.engines.spark_daemon``) has those modules imported already.

Run by ``spark-submit`` (``orchestration.spark_server``): ``spark-submit [--conf …] connect_driver.py``, with
the stack's token in ``SPARK_CONNECT_AUTHENTICATE_TOKEN``: the service then refuses every call without it
(UNAUTHENTICATED). Without a token it does not start: a client can run any Python on the executors.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def main() -> int:
    from pyspark.sql import SparkSession

    # the session's settings come from spark-submit's --conf; this one must hold before the session exists
    spark = (SparkSession.builder.appName("millpond-connect")
             .config("spark.sql.artifact.isolation.enabled", "false").getOrCreate())
    # Spark reads the token from its conf, else from the environment (``Connect.getAuthenticateToken``)
    if not (spark.sparkContext.getConf().get("spark.connect.authenticate.token")
            or os.environ.get("SPARK_CONNECT_AUTHENTICATE_TOKEN")):
        print("millpond: no Spark Connect token (SPARK_CONNECT_AUTHENTICATE_TOKEN): not serving clients "
              "without one; start the server with `make up`", file=sys.stderr, flush=True)
        spark.stop()
        return 2
    jvm = spark.sparkContext._jvm
    service = jvm.org.apache.spark.sql.connect.service.SparkConnectService
    service.start(spark.sparkContext._jsc.sc())  # new Connect sessions are this default session's children
    print("millpond: Spark Connect service started", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
