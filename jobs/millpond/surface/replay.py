"""Replay: the engine's test bench. A scenario (events JSONL + pipeline config) through the real job.

Batches are cut by arrival time; each batch's events are written to the landing bucket as one file
tagged with its arrival, then the real micro-batch job ingests and processes them against real
Delta tables. The panes are read back from the ``panes`` table and written as JSONL in emission
order. See the README ("Replay format") for the input and output formats.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from millpond.config import Settings, load_settings
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables
from millpond.model.spec import PipelineSpec, pipeline_from_dict
from millpond.model.timeutil import MAX_TS, iso, to_datetime, to_us
from millpond.runtime.engines import choose
from millpond.runtime.job import run_batch
from millpond.surface.cli import LOCAL_HINT, command, engine_option


def read_events(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
    return out


def batch_schedule(spec: PipelineSpec, events: list[dict[str, Any]], start: int | None = None,
                   end: int | None = None) -> list[tuple[int, int]]:
    """[(batch start, processing time)] covering every arrival; explicit watermarks fix the count."""
    interval = spec.batch_interval
    arrivals = [to_us(e["arrival_time"]) for e in events if e.get("arrival_time") is not None]
    if start is None:
        first = min(arrivals) if arrivals else 0
        start = first - first % interval
    explicit = spec.watermark_policy.values if spec.watermark_policy.kind == "explicit" else ()
    if explicit:
        n = len(explicit)
    else:
        stop = end if end is not None else (max(arrivals) + 1 if arrivals else start + interval)
        n = max(1, -(-(stop - start) // interval))
    return [(start + i * interval, start + (i + 1) * interval) for i in range(n)]


def replay(settings: Settings, spec: PipelineSpec, events: list[dict[str, Any]], *, start: int | None = None,
           end: int | None = None, flush: bool = True, spark=None, log=None) -> list[dict[str, Any]]:
    """Run the scenario; return the panes (as JSON objects) in emission order."""
    for processing_time, wm in land_events(settings, spec, events, start=start, end=end, flush=flush):
        result = run_batch(settings, spec, to_datetime(processing_time),
                           watermark=None if wm is None else to_datetime(wm), spark=spark)
        if log:
            log(result.summary())
    return read_panes(settings, spec.name)


def land_events(settings: Settings, spec: PipelineSpec, events: list[dict[str, Any]], *, start: int | None = None,
                end: int | None = None, flush: bool = True) -> list[tuple[int, int | None]]:
    """The scenario's events landed as one file per batch interval (by arrival time); the batches to run,
    as (processing time, explicit watermark or None), the last one at watermark +inf when ``flush``. Apart
    from ``replay`` so that another process (a Connect client, a benchmark) can run the same batches."""
    store = ObjectStore(settings)
    schedule = batch_schedule(spec, events, start, end)
    if flush:
        last_p = schedule[-1][1]
        schedule.append((last_p, last_p + spec.batch_interval))
    steps: list[tuple[int, int | None]] = []
    for i, (lo, hi) in enumerate(schedule):
        batch_events = [e for e in events if e.get("arrival_time") is not None and lo <= to_us(e["arrival_time"]) < hi]
        if i == 0:
            batch_events += [e for e in events if e.get("arrival_time") is None]
        if batch_events:
            body = "".join(json.dumps(e, sort_keys=True) + "\n" for e in batch_events).encode()
            store.put_bytes(settings.bucket_landing,
                            f"{spec.source_prefix}{arrival_tag(lo)}-batch-{i + 1:05d}.jsonl", body)
        steps.append((hi, MAX_TS if flush and i == len(schedule) - 1 else None))
    return steps


def read_panes(settings: Settings, pipeline: str) -> list[dict[str, Any]]:
    table = Tables(settings).read_arrow(pipeline, "panes", schema=pa.schema([("batch", pa.int64())]))
    if not table.num_rows:
        return []
    table = table.sort_by([("batch", "ascending"), ("seq", "ascending")])
    out = []
    for row in table.to_pylist():
        for f in ("window_start", "window_end", "processing_time", "watermark"):
            row[f] = iso(to_us(row[f]))
        out.append(row)
    return out


def load_scenario_pipeline(path: str | Path, name: str | None) -> PipelineSpec:
    doc = yaml.safe_load(Path(path).read_text()) or {}
    doc["name"] = name or f"replay_{doc.get('name', 'scenario')}_{uuid.uuid4().hex[:8]}"
    doc.setdefault("source", {})
    doc["source"] = {**doc["source"], "prefix": f"replay/{doc['name']}/"}
    return pipeline_from_dict(doc)


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", required=True, help="pipeline config YAML (window, trigger, accumulation, ...)")
    p.add_argument("--events", required=True, help="events JSONL: id, key, value, event_time, arrival_time")
    p.add_argument("--out", default="-", help="panes JSONL (default: stdout)")
    p.add_argument("--name", help="table namespace (default: replay_<name>_<random>)")
    p.add_argument("--start", help="first batch start (default: first arrival, floored to the interval)")
    p.add_argument("--end", help="process batches until this processing time")
    p.add_argument("--no-flush", action="store_true", help="do not finish with the watermark at +infinity")
    engine_option(p)
    p.add_argument("--spark", action="store_true", help="deprecated: --engine spark")


@command("replay", "replay a scenario (events JSONL + pipeline YAML) through the real job; panes as JSONL",
         _configure)
def _replay_cmd(args: argparse.Namespace) -> int:
    settings = load_settings()
    try:
        spec = load_scenario_pipeline(args.pipeline, args.name)
        events = read_events(args.events)
    except (ValueError, OSError) as exc:
        from millpond.errors import MillpondError

        raise MillpondError(str(exc)) from exc
    forced = args.engine
    if args.spark:
        print("millpond: replay --spark is deprecated: use --engine spark", file=sys.stderr)
        if forced == "local":
            from millpond.errors import MillpondError

            raise MillpondError("--spark and --engine local contradict each other: give one --engine")
        forced = "spark"
    if forced == "spark":  # asked for Spark: every batch runs there, however small (engine.local_below)
        settings = settings.with_overrides(engine_local_below=0)
    settings, spark = choose(settings, forced, hint=LOCAL_HINT)
    panes = replay(settings, spec, events, start=to_us(args.start) if args.start else None,
                   end=to_us(args.end) if args.end else None, flush=not args.no_flush, spark=spark,
                   log=lambda s: print(s, file=sys.stderr))
    text = "".join(json.dumps(p, sort_keys=True) + "\n" for p in panes)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"{len(panes)} panes -> {args.out} (tables: {spec.name})", file=sys.stderr)
    return 0
