"""`millpond run`: the main job on the embedded defaults (what `make run` ends with).

Lands demo data and runs the shipped pipelines over the most recent intervals, in order, then prints
where the results are. With Airflow up (`make up`), the same batches run as Airflow DAG runs.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

from millpond.config import Settings, load_settings
from millpond.config.pipelines import load_pipelines
from millpond.examples.demo import land_demo_events
from millpond.model.spec import PipelineSpec
from millpond.model.timeutil import to_datetime, to_us
from millpond.runtime.engines import choose, engine_for
from millpond.runtime.job import run_batch
from millpond.surface.cli import LOCAL_HINT, command, engine_option


def recent_intervals(spec: PipelineSpec, count: int, now: datetime | None = None) -> list[tuple[datetime, datetime]]:
    """The last ``count`` complete batch intervals before ``now``, oldest first."""
    n = to_us(now or datetime.now(UTC))
    end = n - n % spec.batch_interval
    step = spec.batch_interval
    return [(to_datetime(end - (count - i) * step), to_datetime(end - (count - i - 1) * step)) for i in range(count)]


def run_direct(settings: Settings, specs: list[PipelineSpec], batches: int, spark=None) -> None:
    for spec in specs:
        intervals = recent_intervals(spec, batches)
        print(f"{spec.name}: {len(intervals)} batches of {spec.batch_interval // 1_000_000}s "
              f"({intervals[0][0].isoformat()} .. {intervals[-1][1].isoformat()})")
        for i, (start, end) in enumerate(intervals, start=1):
            if spec.demo:
                land_demo_events(settings, spec, start, end)
            t = time.perf_counter()
            result = run_batch(settings, spec, end, spark=spark, validate=True)
            print(f"  [{i}/{len(intervals)}] {result.summary()} ({time.perf_counter() - t:.1f}s)")


def last_committed(settings: Settings, spec: PipelineSpec) -> datetime | None:
    from millpond.lake.schemas import BATCHES_SCHEMA
    from millpond.lake.tables import Tables

    done = Tables(settings).read_arrow(spec.name, "batches", schema=BATCHES_SCHEMA, columns=["processing_time"])
    times = done.column("processing_time").to_pylist()
    return max(times) if times else None


def run_via_airflow(settings: Settings, specs: list[PipelineSpec], batches: int, engine: str | None = None) -> None:
    """Backfill each pipeline's recent intervals as Airflow DAG runs, then let the schedule carry on.

    Each is a ``Backfill``: created while the DAG is still paused (new DAGs are), then the DAG is unpaused and the
    backfill runs in order; meanwhile the pipeline's live runs leave their files to it (``hold_live_runs``), so
    the scheduler cannot commit the newest interval first. Intervals already committed are not asked for again.
    ``engine``: a forced engine (``--engine``), passed in the runs' conf (their tasks choose by it).
    """
    from millpond.orchestration.airflow_stack import AirflowStack
    from millpond.orchestration.backfill import Backfill

    stack = AirflowStack(settings)
    for spec in specs:
        intervals = recent_intervals(spec, batches)
        start, end = intervals[0][0], intervals[-1][1]
        last = last_committed(settings, spec)
        if last is not None and last >= start:
            start = last
        if start >= end:
            print(f"{spec.name}: up to date (last batch at {last.isoformat()}); live runs continue in Airflow")
            continue
        # the Backfill's own steps (remade when Airflow leaves it unrun, runs that failed before named, the
        # batches checked committed), with the DAG unpaused once it is made
        Backfill(settings, spec.name, start, end, conf={"demo": True} | ({"engine": engine} if engine else {}),
                 stack=stack, unpause=True).run(timeout=1800)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipelines", help="comma-separated pipeline names (default: all in conf/pipelines)")
    p.add_argument("--batches", type=int, default=6, help="how many recent intervals to run (default 6)")
    p.add_argument("--direct", action="store_true", help="run the batches in this process, not through Airflow")
    engine_option(p)


@command("run", "run the shipped pipelines over recent intervals on demo data", _configure)
def _run(args: argparse.Namespace) -> int:
    settings = load_settings()
    specs = load_pipelines(settings.conf_dir)
    if args.pipelines:
        wanted = args.pipelines.split(",")
        missing = [w for w in wanted if w not in specs]
        if missing:
            from millpond.errors import MillpondError

            raise MillpondError(f"unknown pipeline(s) {', '.join(missing)}: have {', '.join(specs)}")
        specs = {k: v for k, v in specs.items() if k in wanted}
    from millpond.orchestration.airflow_stack import AirflowStack, admin_password
    from millpond.orchestration.spark_server import SparkConnectServer

    stack = AirflowStack(settings)
    via_airflow = not args.direct and stack.running()
    if via_airflow:  # the runs' tasks choose their engine (``runtime.engines.choose``), by --engine if given
        settings = settings.with_overrides(engine=engine_for(settings, args.engine))
        run_via_airflow(settings, list(specs.values()), args.batches, engine=args.engine)
    else:
        settings, spark = choose(settings, args.engine, hint=LOCAL_HINT)
        run_direct(settings, list(specs.values()), args.batches, spark=spark)
    print()
    print("Millpond is up.")
    if via_airflow:
        print(f"  Airflow UI:  {stack.url}  (user admin, password {admin_password(settings)})")
    spark = SparkConnectServer(settings)
    if settings.spark_connect or spark.running():
        print(f"  Spark:       {settings.spark_connect_url} (engine {settings.engine})"
              + ("" if settings.spark_connect else f"; Spark UI {spark.ui_url}"))
    print(f"  Tables:      s3://{settings.bucket_lake}/{settings.table_root}/<pipeline>/"
          "{panes,current,windows,late,quarantine,batches} at " + settings.s3_endpoint)
    for spec in specs.values():
        last = last_committed(settings, spec)
        print(f"    {spec.name}: last batch at {last.isoformat() if last else '-'}")
    print("  Query:       make query SQL=\"SELECT key, window_start, window_end, value, timing "
          "FROM video_sessions.current ORDER BY value DESC LIMIT 10\"")
    print("  Reports:     make docs (Data Docs on http://127.0.0.1:8765), make report (pane diagrams, "
          f"batch reports; also s3://{settings.bucket_reports}/)")
    print("  Stop:        make down")
    return 0


def _configure_batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="a pipeline name from conf/pipelines, or a path to a pipeline YAML")
    p.add_argument("--at", required=True, help="the batch's processing time (ISO-8601)")
    p.add_argument("--watermark", help="an explicit watermark for this batch (default: the pipeline's policy)")
    p.add_argument("--validate", action="store_true", help="run the data-quality suites before committing")
    engine_option(p, "the batch")


@command("batch", "run one micro-batch of a pipeline at a processing time (idempotent)", _configure_batch)
def _batch(args: argparse.Namespace) -> int:
    from millpond.config.pipelines import pipeline_named

    settings = load_settings()
    spec = pipeline_named(settings.conf_dir, args.pipeline)
    settings, spark = choose(settings, args.engine, hint=LOCAL_HINT)
    result = run_batch(settings, spec, to_datetime(to_us(args.at)), validate=args.validate, spark=spark,
                       watermark=to_datetime(to_us(args.watermark)) if args.watermark else None)
    print(result.summary())
    return 0
