"""`millpond run`: the main job on the embedded defaults (what `make run` ends with).

Lands demo data and runs the shipped pipelines over the most recent intervals, in order, then prints
where the results are. With Airflow up (`make up`), the same batches run as Airflow DAG runs.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

from .cli import command
from .config import Settings, load_settings
from .demo import land_demo_events
from .microbatch import run_batch
from .pipeline import PipelineSpec, load_pipelines
from .timeutil import to_datetime, to_us


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


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipelines", help="comma-separated pipeline names (default: all in conf/pipelines)")
    p.add_argument("--batches", type=int, default=6, help="how many recent intervals to run (default 6)")


@command("run", "run the shipped pipelines over recent intervals on demo data", _configure)
def _run(args: argparse.Namespace) -> int:
    settings = load_settings()
    specs = load_pipelines(settings.conf_dir)
    if args.pipelines:
        wanted = args.pipelines.split(",")
        missing = [w for w in wanted if w not in specs]
        if missing:
            from .errors import MillpondError

            raise MillpondError(f"unknown pipeline(s) {', '.join(missing)}: have {', '.join(specs)}")
        specs = {k: v for k, v in specs.items() if k in wanted}
    run_direct(settings, list(specs.values()), args.batches)
    print()
    print(f"Tables: s3://{settings.bucket_lake}/{settings.table_root}/<pipeline>/"
          "{panes,current,windows,late,quarantine,batches}")
    print("Try:   make query SQL=\"SELECT key, window_start, value, timing FROM video_sessions.current "
          "ORDER BY value DESC LIMIT 10\"")
    return 0


def _configure_batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="a pipeline name from conf/pipelines, or a path to a pipeline YAML")
    p.add_argument("--at", required=True, help="the batch's processing time (ISO-8601)")
    p.add_argument("--watermark", help="an explicit watermark for this batch (default: the pipeline's policy)")
    p.add_argument("--validate", action="store_true", help="run the data-quality suites before committing")


@command("batch", "run one micro-batch of a pipeline at a processing time (idempotent)", _configure_batch)
def _batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .errors import MillpondError
    from .pipeline import load_pipeline

    settings = load_settings()
    if Path(args.pipeline).suffix in (".yaml", ".yml"):
        spec = load_pipeline(args.pipeline)
    else:
        specs = load_pipelines(settings.conf_dir)
        if args.pipeline not in specs:
            raise MillpondError(f"unknown pipeline {args.pipeline}: have {', '.join(specs)}")
        spec = specs[args.pipeline]
    result = run_batch(settings, spec, to_datetime(to_us(args.at)), validate=args.validate,
                       watermark=to_datetime(to_us(args.watermark)) if args.watermark else None)
    print(result.summary())
    return 0
