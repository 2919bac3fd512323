"""One Spark Connect client in its own process, as an Airflow task is: ``python -m bench.connect_client REQ OUT``.

Why a process of its own: a task is a fresh interpreter that connects to the warm server and runs a batch, so
its start-up counts; the peak RSS measured here (the kernel's high-water mark of this process) is the
client's own, not the server JVM's; and a process holding a classic SparkSession (the bench's) cannot open
a Connect session.

``REQ`` (JSON): ``url`` (sc://...), ``mode`` ("batches" or "bare"), and for "batches" ``pipelines`` (pipeline
documents) and ``steps`` ([pipeline index, processing time us, watermark us or null], run in order),
``validate``, ``render_docs`` (default true; false as the DAG's task runs a batch: its pages are rendered by
the publish after the commit), ``preload`` (import the libraries Airflow's scheduler preloads for its forked tasks
and load boto3's S3 model, ``orchestration.airflow_preload.preload_task_libraries``, before the clock: a DAG task's
process has them); for "bare" ``kind``,
``prefix``, ``batch`` (null: every landing file) and ``runs``; for "bare_exec" (the executors read a local copy)
``src``, ``out``, ``kind``, ``runs``; for "structured_streaming" ``src``, ``staged``, ``checkpoint``, ``uri``,
``storage_options`` and ``batches`` (the staged file names of each micro-batch); "trivial" runs
``spark.range(1).count()``.
``OUT`` receives the result (JSON): wall-clock marks (``started_at``, ``imported_at``, ``connected_at``), each
batch's seconds, phases, counts and ``ended_at``, and ``peak_rss_bytes``.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before any import: the interpreter's own start-up is the parent's to add

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def run(req: dict[str, Any]) -> dict[str, Any]:
    preload_s = 0.0
    if req.get("preload"):
        from millpond.orchestration.airflow_preload import preload_task_libraries

        t = time.perf_counter()
        preload_task_libraries()
        preload_s = round(time.perf_counter() - t, 4)
    from millpond.config import load_settings

    if req["mode"] == "batches":
        from millpond.model.spec import pipeline_from_dict
        from millpond.model.timeutil import to_datetime
        from millpond.runtime.job import run_batch
    from millpond.runtime.engines.spark_client import connect

    out: dict[str, Any] = {"started_at": STARTED_AT, "imported_at": time.time(), "preload_s": preload_s}
    # the product's default: every batch on the Spark engine (engine.local_below 0), as `make up` deploys it
    settings = load_settings().with_overrides(engine="spark", engine_local_below=0, spark_connect=req["url"],
                                              **req.get("overrides", {}))
    t = time.perf_counter()
    spark = connect(settings)
    out["connect_s"] = round(time.perf_counter() - t, 4)
    out["connected_at"] = time.time()
    if req["mode"] == "batches":
        specs = [pipeline_from_dict(doc) for doc in req["pipelines"]]
        batches = []
        for index, processing_time, watermark in req["steps"]:
            t = time.perf_counter()
            r = run_batch(settings, specs[index], to_datetime(processing_time),
                          watermark=None if watermark is None else to_datetime(watermark), spark=spark,
                          validate=bool(req.get("validate")), render_docs=bool(req.get("render_docs", True)))
            batches.append({"pipeline": index, "batch": r.batch, "seconds": round(time.perf_counter() - t, 4),
                            "ended_at": time.time(), "path": _path(r.phases),
                            "phases": {k: round(v, 4) for k, v in r.phases.items()}, "counts": r.counts})
        out["batches"] = batches
    elif req["mode"] == "trivial":
        t = time.perf_counter()
        rows = spark.range(1).count()
        out["runs"] = [{"seconds": round(time.perf_counter() - t, 4), "rows": rows, "ended_at": time.time()}]
    elif req["mode"] == "bare_exec":
        out["runs"] = [bare_on_executors(spark, req) for _ in range(max(1, int(req.get("runs", 1))))]
    elif req["mode"] == "bare_stage":
        from bench.stage_scale import bare_stage

        out["runs"] = [bare_stage(spark, settings, req)]
    elif req["mode"] == "structured_streaming":
        out.update(structured_streaming(spark, req))
    else:
        from bench.harness import bare_aggregate, landing_table

        runs = []
        for _ in range(max(1, int(req.get("runs", 1)))):
            t0 = time.perf_counter()
            table = landing_table(settings, req["prefix"], req.get("batch"))
            t1 = time.perf_counter()
            windows = bare_aggregate(spark, table, req["kind"]).num_rows
            t2 = time.perf_counter()
            runs.append({"seconds": round(t2 - t0, 4), "read_s": round(t1 - t0, 4), "spark_s": round(t2 - t1, 4),
                         "events": table.num_rows, "windows": windows, "ended_at": time.time()})
            del table
        out["runs"] = runs
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


#: the landing files' schema and timestamp format, for Spark's own JSON reader (the executors parse them)
EVENT_SCHEMA = "id STRING, key STRING, value BIGINT, event_time TIMESTAMP, arrival_time TIMESTAMP"
TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSSSSX"
GAP, WATERMARK_DELAY = "5 minutes", "2 minutes"


def bare_on_executors(spark, req: dict[str, Any]) -> dict[str, Any]:
    """The fair bare-Spark peer: the executors read a local copy of the landing files (``spark.read.json``),
    ``dropDuplicates(id)``, one sum per (key, session or 1-minute window), written as Parquet to local disk."""
    from pyspark.sql import functions as F

    t0 = time.perf_counter()
    df = (spark.read.schema(EVENT_SCHEMA).option("timestampFormat", TIMESTAMP_FORMAT).json(req["src"])
          .dropDuplicates(["id"]))
    win = F.session_window("event_time", GAP) if req.get("kind", "sessions") == "sessions" else F.window(
        "event_time", "1 minute")
    out_path = f"{req['out']}-{time.time_ns()}"
    agg = df.groupBy("key", win.alias("w")).agg(F.sum("value").alias("value")).select(
        "key", F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"), "value")
    agg.write.mode("overwrite").parquet(out_path)
    t1 = time.perf_counter()
    windows = spark.read.parquet(out_path).count()  # not timed: the written result, checked
    return {"seconds": round(t1 - t0, 4), "windows": windows, "ended_at": time.time(), "out": out_path}


def structured_streaming(spark, req: dict[str, Any]) -> dict[str, Any]:
    """Spark Structured Streaming as a scheduler would run it per micro-batch: the batch's files land in the
    source folder (moved in from ``staged``), then one ``availableNow`` run of the query from its checkpoint
    processes them: watermark, ``dropDuplicatesWithinWatermark``, ``session_window``, sum, append mode,
    ``foreachBatch`` appending to a Delta table through delta-rs (in the server's Python worker)."""
    import os
    import shutil

    from pyspark.sql import functions as F

    src, staged, checkpoint = Path(req["src"]), Path(req["staged"]), req["checkpoint"]
    src.mkdir(parents=True, exist_ok=True)
    uri, opts = req["uri"], req["storage_options"]

    def write(batch_df, batch_id: int) -> None:
        from deltalake import write_deltalake

        table = batch_df.toArrow()
        if table.num_rows:
            write_deltalake(uri, table, mode="append", storage_options=opts)

    source = (spark.readStream.schema(EVENT_SCHEMA).option("timestampFormat", TIMESTAMP_FORMAT).json(str(src)))
    agg = (source.withWatermark("event_time", WATERMARK_DELAY).dropDuplicatesWithinWatermark(["id"])
           .groupBy("key", F.session_window("event_time", GAP)).agg(F.sum("value").alias("value"))
           .select("key", F.col("session_window.start").alias("window_start"),
                   F.col("session_window.end").alias("window_end"), "value"))
    batches = []
    started = time.perf_counter()
    for i, names in enumerate(req["batches"]):
        t0 = time.perf_counter()
        for name in names:  # as an injector lands them; mtimes in arrival order (the source's order)
            os.utime(staged / name, (1_700_000_000 + i, 1_700_000_000 + i))
            shutil.move(str(staged / name), str(src / name))
        t1 = time.perf_counter()
        query = (agg.writeStream.outputMode("append").foreachBatch(write).option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        t2 = time.perf_counter()
        progress = query.recentProgress or []
        triggers_s = sum((p.durationMs or {}).get("triggerExecution", 0) for p in progress) / 1000
        batches.append({"batch": i, "seconds": round(t2 - t0, 4), "land_s": round(t1 - t0, 4),
                        "triggers_s": round(triggers_s, 4),
                        # the query's start from its checkpoint and its stop, around the triggers
                        "query_overhead_s": round(t2 - t1 - triggers_s, 4),
                        "micro_batches": len(progress),
                        "input_rows": sum(int(p.numInputRows or 0) for p in progress),
                        "durations_ms": [dict(p.durationMs or {}) for p in progress], "ended_at": time.time()})
    return {"batches": batches, "seconds": round(time.perf_counter() - started, 4)}


def peak_rss_bytes() -> int:
    """This process's own peak RSS since it started: the kernel's ``VmHWM``. Not ``ru_maxrss``: Linux carries a
    spawning parent's peak into its child's ``ru_maxrss`` (a client spawned by a bench holding 10M generated
    events reported 2.2 GiB, its own peak being 0.4 GiB)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # elsewhere (Linux: KiB)


def _path(phases: dict[str, float]) -> str:
    """Which engine ran a batch, by its phases: the Spark engine's one task, its multi-stage plan, or in-process."""
    if "spark_task" in phases:
        return "spark_one_task"
    return "spark_engine" if "dedup" not in phases else "driver"


def main(argv: list[str]) -> int:
    req = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(req), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

