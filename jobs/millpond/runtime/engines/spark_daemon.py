"""The Python daemon Spark forks its executors' Python workers from, with the engine's modules imported once.

Spark starts one daemon per worker pool and forks a worker from it for each task slot; a worker idle for a
minute is stopped. With the stock daemon every new worker imports pyarrow, pandas and millpond again (half a
second of CPU each here), so a batch arriving more than a minute after the last paid that at its first tasks.
Forked from this daemon, a worker starts with them loaded. Arrow and jemalloc register fork handlers for the
threads their import starts, which is what makes importing before the fork safe.

Set as ``spark.python.daemon.module`` by ``orchestration.spark_server``.
"""

from __future__ import annotations


def preload() -> None:
    """What the engine's tasks import: the Arrow serializers, pyarrow's Parquet, our executor code (which brings the
    object store's filesystem: the lake layer owns that import)."""
    import pandas  # noqa: F401
    import pyarrow.compute  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import pyspark.sql.pandas.serializers  # noqa: F401
    import pyspark.worker  # noqa: F401

    import millpond.lake.landing  # noqa: F401
    import millpond.lake.spark_io  # noqa: F401
    import millpond.runtime.engines.spark_computation  # noqa: F401
    import millpond.runtime.engines.spark_keys  # noqa: F401
    import millpond.runtime.engines.spark_upstream  # noqa: F401


if __name__ == "__main__":
    preload()
    from pyspark.daemon import manager

    manager()
