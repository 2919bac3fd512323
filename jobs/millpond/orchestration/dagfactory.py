"""One Airflow DAG per ``conf/pipelines/*.yaml``: ingest -> process_microbatch -> validate -> publish.

Why a factory: the DAG file stays a two-liner and every pipeline gets the same, tested shape.
Parsing must stay fast (the dag-processor re-parses every few seconds), so this module reads the
pipeline YAML with nothing heavier than PyYAML; Spark, delta-rs and the engine are imported inside
the task functions only.

Each run is one micro-batch whose processing time is the run's ``data_interval_end`` (a manual run
without a logical date uses ``dag_run.run_after``). The batch is idempotent (the engine skips a
processing time already committed), so retries and re-runs are safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from millpond.config import Settings, load_settings
from millpond.model.timeutil import parse_duration, to_us

log = logging.getLogger(__name__)

DAG_PREFIX = "millpond_"
START_DATE = datetime(2020, 1, 1, tzinfo=UTC)  # far back so backfills of old intervals are allowed
TABLE_ASSETS = ("panes", "current", "batches")


@dataclass(frozen=True)
class PipelineInfo:
    """What the DAG shape needs from a pipeline file (the engine validates the rest at run time)."""

    name: str
    path: Path
    batch_interval: timedelta
    description: str
    has_demo: bool
    #: the pipelines whose panes this one reads (``source: {pipeline: ...}``; ``model.stages``)
    upstreams: tuple[str, ...] = ()

    @property
    def dag_id(self) -> str:
        return DAG_PREFIX + self.name


def read_pipeline_info(path: Path) -> PipelineInfo:
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path.name}: not a mapping")
    name = str(doc.get("name") or path.stem)
    if not name.replace("_", "").isalnum():
        raise ValueError(f"{path.name}: pipeline name {name!r}: use letters, digits and underscores")
    interval = timedelta(microseconds=parse_duration(doc.get("batch_interval", "5m")))
    if interval <= timedelta(0):
        raise ValueError(f"{path.name}: batch_interval must be positive")
    source = doc.get("source") if isinstance(doc.get("source"), dict) else {}
    upstreams = source.get("pipelines") or ([source["pipeline"]] if source.get("pipeline") else [])
    return PipelineInfo(name, path, interval, str(doc.get("description") or ""), bool(doc.get("demo")),
                        tuple(str(u) for u in upstreams) if isinstance(upstreams, list) else ())


def pipelines_dir(settings: Settings) -> Path:
    return settings.conf_dir / "pipelines"


def timetable_for(interval: timedelta):
    """Real data intervals [start, end): aligned cron when the interval divides an hour or a day, else a delta."""
    from airflow.sdk import CronDataIntervalTimetable, DeltaDataIntervalTimetable

    seconds = int(interval.total_seconds())
    if seconds == interval.total_seconds():
        if seconds % 60 == 0 and 60 <= seconds < 3600 and 3600 % seconds == 0:
            return CronDataIntervalTimetable(f"*/{seconds // 60} * * * *", timezone="UTC")
        if seconds % 3600 == 0 and 3600 <= seconds < 86400 and 86400 % seconds == 0:
            return CronDataIntervalTimetable(f"0 */{seconds // 3600} * * *", timezone="UTC")
        if seconds == 86400:
            return CronDataIntervalTimetable("0 0 * * *", timezone="UTC")
    return DeltaDataIntervalTimetable(interval)


# ------------------------------------------------------------------------------------------------
# Helpers the task functions use (plain functions so tests can call them without Airflow).
# ------------------------------------------------------------------------------------------------
def batch_window(context: dict[str, Any], interval: timedelta) -> tuple[datetime, datetime]:
    """The run's [start, end): the data interval, or (run_after - interval, run_after) for a manual run."""
    dag_run = context.get("dag_run")
    start, end = context.get("data_interval_start"), context.get("data_interval_end")
    if dag_run is not None and getattr(dag_run, "logical_date", None) is None:
        end = dag_run.run_after
        start = end - interval
    if end is None:
        raise RuntimeError("this run has neither a data interval nor run_after")
    if start is None or start >= end:
        start = end - interval
    return _utc(start), _utc(end)


def triggering_batch_time(context: dict[str, Any]) -> datetime | None:
    """For a run its upstreams' asset events triggered: the latest processing time of the upstream batches
    that published them (None for any other run), so the stage's batch reads up to that batch."""
    run = context.get("dag_run")
    if "asset" not in str(getattr(run, "run_type", "") or "").lower():
        return None
    times = []
    for events in (context.get("triggering_asset_events") or {}).values():
        for event in events:
            text = (getattr(event, "extra", None) or {}).get("processing_time")
            if text:
                times.append(_utc(datetime.fromisoformat(str(text).replace("Z", "+00:00"))))
    return max(times, default=None)


def _utc(value: datetime) -> datetime:
    """A plain ``datetime`` in UTC (Airflow hands out pendulum objects, which the engine's arithmetic rejects)."""
    value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return datetime(value.year, value.month, value.day, value.hour, value.minute, value.second,
                    value.microsecond, tzinfo=UTC)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else _utc(value).isoformat().replace("+00:00", "Z")


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def live_run_skipped(context: dict[str, Any], settings: Settings) -> bool:
    """A scheduled run does nothing while live runs are off (Airflow cannot drop only scheduled runs:
    ``allowed_run_types`` must include them on a scheduled DAG, and an end date also blocks manual runs)."""
    run_type = str(getattr(context.get("dag_run"), "run_type", "") or "")
    return run_type.lower().endswith("scheduled") and not settings.airflow_scheduled_runs


def demo_enabled(settings: Settings, info_has_demo: bool, params: dict[str, Any]) -> bool:
    """Demo events are landed only for a pipeline with ``demo:`` and when asked (setting or trigger param)."""
    return info_has_demo and (settings.demo or _truthy(params.get("demo", False)))


def backfill_progress(conf: dict[str, Any], start: datetime, interval: timedelta) -> tuple[int, int] | None:
    """(this batch's position, total batches) when the run belongs to a `millpond backfill`."""
    try:
        first = _utc(datetime.fromisoformat(str(conf["backfill_from"]).replace("Z", "+00:00")))
        last = _utc(datetime.fromisoformat(str(conf["backfill_to"]).replace("Z", "+00:00")))
    except (KeyError, ValueError, TypeError):
        return None
    total = max(1, int((last - first) / interval))
    position = int((start - first) / interval) + 1
    return position, total


def load_spec(settings: Settings, name: str):
    from millpond.config.pipelines import load_pipelines

    specs = load_pipelines(settings.conf_dir)
    if name not in specs:
        raise RuntimeError(f"pipeline {name!r} is no longer in {pipelines_dir(settings)}")
    return specs[name]


def quality_summary(report: Any, settings: Settings) -> dict[str, Any]:
    """The batch's data-quality report as a JSON-safe XCom value, with links a user can open."""
    if report is None:
        return {"validated": False}
    pages = list(report.result_urls)[:6]
    return {"validated": True, "ok": report.ok, "warnings": list(report.warnings)[:20],
            "summary": report.summary(), "results": pages,
            "published": f"s3://{settings.bucket_reports}/data_docs/index.html"}


def summarize(result: Any) -> dict[str, Any]:
    """A BatchResult as a JSON-safe XCom value."""
    return {
        "batch": getattr(result, "batch", None),
        "processing_time": _iso(getattr(result, "processing_time", None)),
        "watermark": _iso(getattr(result, "watermark", None)),
        "counts": dict(getattr(result, "counts", {}) or {}),
        "phases": {k: round(float(v), 3) for k, v in (getattr(result, "phases", {}) or {}).items()},
        "skipped": bool(getattr(result, "skipped", False)),
    }


# ------------------------------------------------------------------------------------------------
# The DAG
# ------------------------------------------------------------------------------------------------
def build_dag(info: PipelineInfo, settings: Settings):
    """The DAG of one pipeline."""
    from airflow.sdk import DAG, Asset, AssetAny, AssetOrTimeSchedule, Param, task

    assets = [Asset(f"s3://{settings.bucket_lake}/{settings.table_root}/{info.name}/{t}") for t in TABLE_ASSETS]
    # A stage reads its upstreams' panes: an upstream batch that committed (its publish updates the panes
    # Asset) triggers the stage's run at that batch's processing time; the stage's own batch_interval
    # schedule stays for backfills and as a fallback. The UI's asset graph shows the pipelines' graph.
    inlets = [Asset(f"s3://{settings.bucket_lake}/{settings.table_root}/{u}/panes") for u in info.upstreams]
    schedule = (AssetOrTimeSchedule(timetable=timetable_for(info.batch_interval), assets=AssetAny(*inlets))
                if inlets else timetable_for(info.batch_interval))
    doc = (
        f"**{info.name}**: {info.description or 'Millpond pipeline'}\n\n"
        f"One micro-batch per {info.batch_interval} data interval; processing time = `data_interval_end`. "
        f"Config: `{info.path.name}`. Batches are idempotent: re-running a committed interval is a no-op."
    )
    interval = info.batch_interval
    name = info.name

    with DAG(
        dag_id=info.dag_id,
        description=(info.description or f"Millpond pipeline {name}")[:200],
        doc_md=doc,
        schedule=schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        max_active_tasks=4,
        is_paused_upon_creation=settings.airflow_paused_at_creation,
        tags=["millpond"],
        default_args={
            "owner": "millpond",
            "retries": 2,
            "retry_delay": timedelta(seconds=15),
            "retry_exponential_backoff": False,
            "execution_timeout": timedelta(seconds=settings.airflow_task_timeout_s),
        },
        params={
            "dry_run": Param(False, type="boolean", description="Plan only: log the window, write nothing."),
            "demo": Param(False, type="boolean",
                          description="Land deterministic demo events for the interval first (pipelines with "
                          "`demo:`; MILLPOND_DEMO=1 turns it on for every run)."),
            "reprocess": Param(False, type="boolean",
                               description="Recompute: if batches at or after this run's interval are committed, "
                               "rewind the pipeline's tables to before it first (a backfill with 'reprocess "
                               "completed runs' sets this; see docs/operations.md, 'Reprocess')."),
            "watermark_lag_override": Param(
                None, type=["null", "string"],
                description="Watermark = processing time minus this lag (e.g. 2m), instead of the pipeline policy.",
            ),
        },
    ) as dag:

        @task(task_id="ingest")
        def ingest(**context: Any) -> dict[str, Any]:
            """Land demo events for the interval when asked; the engine ingests landing files next."""
            if live_run_skipped(context, load_settings()):
                from airflow.exceptions import AirflowSkipException

                raise AirflowSkipException("live runs are off (MILLPOND_AIRFLOW_SCHEDULED_RUNS=false): "
                                           "only manual runs and backfills process batches")
            start, end = batch_window(context, interval)
            if (upstream_end := triggering_batch_time(context)) is not None:
                start, end = upstream_end - interval, upstream_end
            params = context["params"]
            landed = 0
            if params.get("dry_run"):
                log.info("dry run: would process %s window [%s, %s)", name, _iso(start), _iso(end))
            elif demo_enabled(s := load_settings(), info.has_demo, params):
                from millpond.examples.demo import land_demo_events

                landed = land_demo_events(s, load_spec(s, name), start, end)
                log.info("landed %d demo events for %s arriving in [%s, %s)", landed, name, _iso(start), _iso(end))
            return {"start": _iso(start), "end": _iso(end), "demo_events": landed}

        @task(task_id="process_microbatch", inlets=inlets)
        def process_microbatch(plan: dict[str, Any], **context: Any) -> dict[str, Any]:
            """One micro-batch at processing time = the window end (idempotent)."""
            params = context["params"]
            processing_time = _utc(datetime.fromisoformat(plan["end"].replace("Z", "+00:00")))
            start = _utc(datetime.fromisoformat(plan["start"].replace("Z", "+00:00")))
            conf = dict(getattr(context.get("dag_run"), "conf", None) or {})
            progress = backfill_progress(conf, start, interval)
            if params.get("dry_run"):
                log.info("dry run: %s batch at processing time %s not executed", name, plan["end"])
                return {"dry_run": True, "processing_time": plan["end"], "skipped": True, "counts": {}}
            watermark = None
            if params.get("watermark_lag_override"):
                watermark = processing_time - timedelta(microseconds=parse_duration(params["watermark_lag_override"]))
            from millpond.runtime.job import run_batch

            s = load_settings()
            spark = None
            if s.engine == "spark":  # a Connect client of the stack's warm Spark: no JVM in this process
                from millpond.runtime.spark_client import connect

                spark = connect(s)
            # Great Expectations runs inside the batch, before its commits: a critical failure fails this
            # task with nothing published.
            # The lease's owner is this DAG run: a retry of it (a new process) takes the lease back at once,
            # while a killed attempt that still runs somewhere is fenced by the lease's token.
            run = context.get("dag_run")
            from millpond.lake.tables import Tables
            from millpond.runtime import catchup, rewind

            if _truthy(conf.get("reprocess", params.get("reprocess"))):
                rewound = rewind.run(s, Tables(s), load_spec(s, name), to_us(start), by=f"{info.dag_id} run "
                                     f"{getattr(run, 'run_id', None)}")
                if not rewound.noop:
                    log.info("reprocess: %s rewound to batch %s (its later batches are in the tables' history)",
                             name, rewound.to_batch or 0)
            elif "backfill" not in str(getattr(run, "run_type", "")).lower() and (
                    waits := catchup.catching_up(Tables(s), name)):
                log.info("%s", waits)
                return {"processing_time": plan["end"], "skipped": True, "counts": {}, "reason": waits}
            owner = f"airflow/{info.dag_id}/{getattr(run, 'run_id', None) or plan['end']}"
            result = run_batch(s, load_spec(s, name), processing_time, watermark=watermark, spark=spark, owner=owner,
                               validate=True)
            summary = summarize(result)
            summary["quality"] = quality_summary(result.quality, s)
            counts = summary["counts"]
            where = f"backfill batch {progress[0]}/{progress[1]}: " if progress else ""
            log.info(
                "%s%s batch %s at %s: %s (input %s events, accepted %s, late %s, panes %s; watermark %s) phases %s",
                where, name, summary["batch"], summary["processing_time"],
                "skipped (already committed)" if summary["skipped"] else "committed",
                counts.get("input"), counts.get("accepted"), counts.get("late"), counts.get("panes"),
                summary["watermark"], summary["phases"],
            )
            if progress:
                summary["backfill"] = {"done": progress[0], "total": progress[1]}
            return summary

        @task(task_id="validate")
        def validate(summary: dict[str, Any]) -> dict[str, Any]:
            """Great Expectations on the batch (millpond.quality.validation); a failed critical check fails the run."""
            if summary.get("dry_run") or summary.get("skipped"):
                log.info("nothing new to validate for %s (dry run or already committed)", name)
                return {"validated": False, "reason": "nothing new"}
            quality = summary.get("quality") or {"validated": False}
            log.info("data quality for %s batch %s: %s", name, summary.get("batch"), quality.get("summary"))
            for page in quality.get("results", []):
                log.info("validation result: file://%s", page)
            log.info("Data Docs (after publish): %s, or locally with `make docs`", quality.get("published"))
            for line in quality.get("warnings", []):
                log.warning("quality warning: %s", line)
            return quality

        @task(task_id="publish", outlets=assets)
        def publish(summary: dict[str, Any], validation: dict[str, Any], **context: Any) -> dict[str, Any]:
            """Rebuild and upload the Data Docs, mark the pipeline's Delta tables as updated (Airflow Assets)
            and log the batch summary."""
            if validation.get("validated"):
                from millpond.quality.datadocs import publish_data_docs

                s = load_settings()
                log.info("Data Docs published: %d files to s3://%s/data_docs/", publish_data_docs(s),
                         s.bucket_reports)
            log.info("published %s: batch %s processing_time %s watermark %s counts %s validation %s",
                     name, summary.get("batch"), summary.get("processing_time"), summary.get("watermark"),
                     summary.get("counts"), validation)
            if summary.get("backfill"):
                b = summary["backfill"]
                log.info("backfill progress for %s: %d/%d batches done", name, b["done"], b["total"])
            for asset in assets:  # what a stage downstream needs to run at this batch's processing time
                context["outlet_events"][asset].extra = {"processing_time": summary.get("processing_time"),
                                                         "batch": summary.get("batch")}
            return {"pipeline": name, **summary, "validation": validation}

        plan = ingest()
        summary = process_microbatch(plan)
        publish(summary, validate(summary))

    return dag


def build_dags(settings: Settings | None = None) -> dict[str, Any]:
    """Every pipeline's DAG by dag id; a broken pipeline file is logged and skipped so the others still load."""
    settings = settings or load_settings()
    dags: dict[str, Any] = {}
    for path in sorted(pipelines_dir(settings).glob("*.yaml")):
        try:
            info = read_pipeline_info(path)
        except Exception as exc:  # noqa: BLE001 - one bad file must not hide every other pipeline
            log.error("skipping pipeline file %s: %s", path, exc)
            continue
        if info.dag_id in dags:
            log.error("skipping %s: pipeline name %r is already used by another file", path, info.name)
            continue
        dags[info.dag_id] = build_dag(info, settings)
    return dags
