"""The Spark session factory: local mode by default, any master by configuration.

Workers must run the project interpreter (it has pyarrow); Ivy, warehouse and scratch dirs stay
inside ``var/`` so a run leaves nothing in the user's home.
"""

from __future__ import annotations

import logging
import os
import sys

from millpond.config import Settings
from millpond.prerequisites import require_java


def get_spark(settings: Settings, app_name: str = "millpond", shuffle_partitions: int | None = None):
    """A SparkSession configured for Millpond (reused if one is already active in the process)."""
    require_java()
    logging.getLogger("py4j").setLevel(logging.WARNING)  # its connection-closing chatter at exit is noise
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    home = settings.home
    for sub in ("spark/ivy", "spark/warehouse", "spark/local"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    partitions = shuffle_partitions or settings.spark_shuffle_partitions
    builder = (
        SparkSession.builder.appName(app_name)
        .master(settings.spark_master)
        .config("spark.jars.ivy", str(home / "spark/ivy"))
        .config("spark.sql.warehouse.dir", str(home / "spark/warehouse"))
        .config("spark.local.dir", str(home / "spark/local"))
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.default.parallelism", str(partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.pythonUDF.arrow.enabled", "true")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.driver.memory", settings.spark_driver_memory)
    )
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    spark.sparkContext.setLogLevel("ERROR")
    return spark
