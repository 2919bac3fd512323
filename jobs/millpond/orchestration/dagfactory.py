"""One Airflow DAG per ``conf/pipelines/*.yaml``, each run one task: ``microbatch``.

Why a factory: the DAG file stays a two-liner and every pipeline gets the same, tested shape.
Parsing must stay fast (the dag-processor re-parses every few seconds), so this module reads the
pipeline YAML with nothing heavier than PyYAML; Spark, delta-rs and the engine are imported inside
the task function only.

Each run is one micro-batch whose processing time is the run's ``data_interval_end`` (a manual run
without a logical date uses ``dag_run.run_after``). The batch is idempotent (the engine skips a
processing time already committed), so retries and re-runs are safe.

Why one task: a run used to be four (``ingest -> process_microbatch -> validate -> publish``), but only
the batch did work: landing demo events is a put, validation runs inside the batch (before its commits,
so a critical failure publishes nothing), and the Data Docs upload sends only what changed (the batch's
pages are rendered after its commit, with the upload: rendering checks nothing). Each task
cost a process start, its imports and the scheduler's latency, several times what a small batch takes,
and the extra tasks only passed XComs along. Folded into one, the run does the same steps in the same
order in one process. A Data Docs upload that fails after the commit is a warning, not a failed task:
a retry would redo the run's preamble only to upload a few pages, and would hold back the Assets' events
the stages downstream wait for; the upload is by manifest, so the next run's publish (or
``millpond docs --no-serve --publish``) sends what this one missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from millpond.config import Settings, load_settings
from millpond.model.timeutil import parse_duration, to_datetime, to_us

log = logging.getLogger(__name__)

DAG_PREFIX = "millpond_"
START_DATE = datetime(2020, 1, 1, tzinfo=UTC)  # far back so backfills of old intervals are allowed
TABLE_ASSETS = ("panes", "current", "batches")
#: the one task of every pipeline's DAG (its XCom ``return_value`` is the batch summary)
TASK_ID = "microbatch"


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
    #: ``freshness:`` thresholds by check (``watermark_lag``, ``last_batch``; ``quality.freshness``)
    freshness: dict[str, timedelta] = field(default_factory=dict)

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
    freshness = {}
    for check, value in (doc.get("freshness") if isinstance(doc.get("freshness"), dict) else {}).items():
        try:
            freshness[str(check)] = timedelta(microseconds=parse_duration(value))
        except (ValueError, TypeError):
            raise ValueError(f"{path.name}: freshness.{check}: expected a duration such as 30m, got {value!r}"
                             ) from None
    return PipelineInfo(name, path, interval, str(doc.get("description") or ""), bool(doc.get("demo")),
                        tuple(str(u) for u in upstreams) if isinstance(upstreams, list) else (), freshness=freshness)


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
    pages = list(report.pages)[:6]
    return {"validated": True, "ok": report.ok, "warnings": list(report.warnings)[:20],
            "freshness": list(getattr(report, "freshness", None) or []),
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
        "engine": getattr(result, "engine", "") or "",
    }


def publish_docs(settings: Settings) -> dict[str, Any]:
    """Render this batch's Data Docs pages and the index, and upload what changed, after the batch committed.

    A failure is logged and reported, never raised: the batch is committed and its Assets' events must go
    out; the next publish sends what this one missed (the manifest only records what was uploaded)."""
    from millpond.quality.datadocs import PUBLISH_PREFIX, publish_data_docs

    where = f"s3://{settings.bucket_reports}/{PUBLISH_PREFIX}/"
    try:
        files = publish_data_docs(settings)
    except Exception as exc:  # noqa: BLE001 - the committed batch stands whatever the reports bucket does
        log.warning("Data Docs not published to %s (%s): the batch is committed; the next run's publish, or "
                    "`millpond docs --no-serve --publish`, uploads what this one missed", where, exc)
        return {"published": False, "error": str(exc)[:300]}
    log.info("Data Docs published: %d files to %s", files, where)
    return {"published": True, "files": files}


def log_quality(name: str, summary: dict[str, Any]) -> None:
    """The batch's data-quality report in the task log, with links to its result pages."""
    quality = summary.get("quality") or {}
    log.info("data quality for %s batch %s: %s", name, summary.get("batch"), quality.get("summary"))
    for page in quality.get("results", []):
        log.info("validation result: file://%s", page)
    for line in quality.get("warnings", []):
        log.warning("quality warning: %s", line)


def alert_freshness(name: str, summary: dict[str, Any], run: Any, settings: Settings) -> int:
    """The batch's freshness breaches (``freshness:``; its Data Docs and ``millpond history`` show them) to the
    deployment's hook, each in one log line (``quality.freshness.alert``); a backfill's batches are history: no
    alert. How many were sent."""
    breaches = (summary.get("quality") or {}).get("freshness") or []
    if not breaches or "backfill" in str(getattr(run, "run_type", "") or "").lower():
        return 0
    from millpond.quality.freshness import alert

    detail = {"batch": summary.get("batch"), "processing_time": summary.get("processing_time"),
              "watermark": summary.get("watermark"), "run_id": getattr(run, "run_id", None)}
    for breach in breaches:
        alert(settings, name, breach["check"], breach["message"], detail)
    return len(breaches)


def freshness_deadline(info: PipelineInfo):
    """Airflow's deadline alert for ``freshness.last_batch`` (None without one): a run whose batch has not
    committed by its interval's start (its logical date; the previous batch's processing time) plus last_batch
    means the pipeline has had no batch for that long, whatever the cause (runs queued behind a stuck one,
    failing, too slow). A run that succeeds in time has its deadline dropped by Airflow; manual and asset-triggered
    runs have no logical date, hence no deadline. The callback (:func:`freshness_missed`) runs on the executor."""
    last_batch = info.freshness.get("last_batch")
    if last_batch is None:
        return None
    from airflow.sdk import DeadlineAlert, DeadlineReference, SyncCallback

    return DeadlineAlert(
        reference=DeadlineReference.DAGRUN_LOGICAL_DATE, interval=last_batch, name="freshness.last_batch",
        callback=SyncCallback(freshness_missed, kwargs={"pipeline": info.name, "last_batch": _duration(last_batch)}))


def _duration(value: timedelta) -> str:
    """``15m``, ``2h``, ``90s``: a duration as a pipeline file writes it."""
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def freshness_missed(pipeline: str, last_batch: str, context: dict[str, Any] | None = None) -> None:
    """The deadline callback: one log line, then the deployment's hook (``quality.freshness_hook``), unless the
    run belongs to a backfill (whose past intervals are all "late": their batches are history). ``context`` is
    what Airflow passes a deadline callback (``dag_run``: the run as its REST API shows it; ``deadline``)."""
    run = (context or {}).get("dag_run") or {}
    if "backfill" in str(run.get("run_type") or "").lower():
        log.info("%s: backfill run %s missed its freshness deadline: no alert (a backfill's batches are history)",
                 pipeline, run.get("dag_run_id"))
        return
    deadline = ((context or {}).get("deadline") or {}).get("deadline_time")
    message = (f"{pipeline}: no batch since {run.get('data_interval_start')}: the batch at "
               f"{run.get('data_interval_end')} has not committed within freshness.last_batch {last_batch} "
               f"(deadline {deadline}; run {run.get('dag_run_id')} is {run.get('state')})")
    from millpond.quality.freshness import alert

    alert(load_settings(), pipeline, "last_batch", message,
          {"dag_run": run, "deadline": None if deadline is None else str(deadline)}, strict=True)


def run_microbatch(info: PipelineInfo, context: dict[str, Any], assets: list[Any]) -> dict[str, Any]:
    """What the DAG's task does, in order: skip a live run while live runs are off; the window (an
    asset-triggered stage run takes its upstream batch's time); dry run: log and stop; land demo events when
    asked; reprocess (rewind first) or wait out a catch-up; the batch with its validation, under a lease
    owned by the DAG run; the Assets' events with the batch's processing time; the Data Docs upload.
    Returns the batch summary (the task's XCom)."""
    name, interval = info.name, info.batch_interval
    s = load_settings()
    if live_run_skipped(context, s):
        from airflow.exceptions import AirflowSkipException

        raise AirflowSkipException("live runs are off (MILLPOND_AIRFLOW_SCHEDULED_RUNS=false): "
                                   "only manual runs and backfills process batches")
    start, end = batch_window(context, interval)
    if (upstream_end := triggering_batch_time(context)) is not None:
        start, end = upstream_end - interval, upstream_end
    params, run = context["params"], context.get("dag_run")
    conf = dict(getattr(run, "conf", None) or {})
    summary = _batch(info, s, context, start, end, params, conf)
    if upstream_end is not None and not summary.get("reason") and not params.get("dry_run"):
        summary = _later_upstream_batches(info, s, context, end, params, conf) or summary
    # What a stage downstream needs to run at this batch's processing time (events go out if the task succeeds).
    for asset in assets:
        context["outlet_events"][asset].extra = {"processing_time": summary.get("processing_time") or _iso(end),
                                                 "batch": summary.get("batch")}
    quality = summary.get("quality") or {}
    if quality.get("validated") or (summary.get("skipped") and "reason" not in summary and not params.get("dry_run")):
        # validated, or a rerun of a committed batch (e.g. a retry after its first attempt was killed
        # before the upload): the pages are local, the manifest says what is still to send
        summary["data_docs"] = publish_docs(s)
    if quality.get("validated"):
        log_quality(name, summary)
        alert_freshness(name, summary, run, s)
    if progress := summary.get("backfill"):
        log.info("backfill progress for %s: %d/%d batches done", name, progress["done"], progress["total"])
    return {"pipeline": name, **summary}


def _later_upstream_batches(info: PipelineInfo, s: Settings, context: dict[str, Any], after: datetime,
                            params: dict[str, Any], conf: dict[str, Any]) -> dict[str, Any] | None:
    """An asset-triggered stage run goes on to its upstreams' batches committed after its own, one batch each, as
    their events would (``catchup.upstream_batches_after``); the last one's summary (None: there were none)."""
    from millpond.lake.tables import Tables
    from millpond.runtime import catchup

    summary = None
    for t in catchup.upstream_batches_after(Tables(s), list(info.upstreams), to_us(after)):
        end = to_datetime(t)
        log.info("%s: the upstream batch at %s committed meanwhile: its stage batch too", info.name, _iso(end))
        summary = _batch(info, s, context, end - info.batch_interval, end, params, conf)
        if summary.get("reason"):
            break
    return summary


def _batch(info: PipelineInfo, s: Settings, context: dict[str, Any], start: datetime, end: datetime,
           params: dict[str, Any], conf: dict[str, Any]) -> dict[str, Any]:
    """The run's batch (or why there is none): its summary."""
    name, run = info.name, context.get("dag_run")
    if params.get("dry_run"):
        log.info("dry run: would process %s window [%s, %s); nothing landed or written", name, _iso(start), _iso(end))
        return {"dry_run": True, "start": _iso(start), "processing_time": _iso(end), "skipped": True, "counts": {}}
    if demo_enabled(s, info.has_demo, params):
        from millpond.examples.demo import land_demo_events

        landed = land_demo_events(s, load_spec(s, name), start, end)
        log.info("landed %d demo events for %s arriving in [%s, %s)", landed, name, _iso(start), _iso(end))
    from millpond.lake.tables import Tables
    from millpond.runtime import catchup, rewind

    if _truthy(conf.get("reprocess", params.get("reprocess"))):
        # a reprocess rewinds once: a run done again after later runs committed (a retry, a clear) finds its
        # rewind recorded and its batch committed, and rewinds nothing. ``millpond backfill --reprocess`` names
        # the whole reprocess; a run started in the UI is named by its DAG run, which a retry or clear keeps
        run_id = getattr(run, "run_id", None)
        rewound = rewind.run(s, Tables(s), load_spec(s, name), to_us(start), by=f"{info.dag_id} run {run_id}",
                             reprocess=conf.get("reprocess_id") or (f"{info.dag_id}/{run_id}" if run_id else None))
        if not rewound.noop:
            log.info("reprocess: %s rewound to batch %s (its later batches are in the tables' history)",
                     name, rewound.to_batch or 0)
    elif "backfill" not in str(getattr(run, "run_type", "")).lower() and (
            waits := catchup.catching_up(Tables(s), name)):
        log.info("%s", waits)
        return {"processing_time": _iso(end), "skipped": True, "counts": {}, "reason": waits}
    watermark = None
    if params.get("watermark_lag_override"):
        watermark = end - timedelta(microseconds=parse_duration(params["watermark_lag_override"]))
    from millpond.runtime.engines import choose
    from millpond.runtime.job import run_batch

    # the deployment's engine, or one a backfill forced (``--engine``, in the run's conf); with spark, a Connect
    # client of the stack's warm Spark: no JVM in this process
    s, spark = choose(s, conf.get("engine"))
    from millpond.orchestration import lineage

    # OpenLineage (when on): this task's run as the parent of the Spark job's events
    tagged, started = lineage.tag_spark(spark, context), datetime.now(UTC)
    # the datasets the task's operator was given when the DAG was parsed (``lineage.datasets``), not read again
    io = (getattr(context.get("task"), "lineage", None) or lineage.datasets(info, s)) if tagged else {}

    # Great Expectations runs inside the batch, before its commits: a critical failure fails this task with
    # nothing committed. The lease's owner is this DAG run: a retry of it (a new process) takes the lease back
    # at once, while a killed attempt that still runs somewhere is fenced by the lease's token.
    owner = f"airflow/{info.dag_id}/{getattr(run, 'run_id', None) or _iso(end)}"
    # Its Data Docs pages are rendered after the commit, with the publish: rendering checks nothing.
    try:
        result = run_batch(s, load_spec(s, name), end, watermark=watermark, spark=spark, owner=owner,
                           validate=True, render_docs=False)
    except Exception as exc:
        lineage.emit_spark_job(tagged, io, started, error=exc, spark=spark)
        raise
    summary = summarize(result)
    summary["quality"] = quality_summary(result.quality, s)
    lineage.emit_spark_job(tagged, io, started, summary, spark=spark)
    counts = summary["counts"]
    progress = backfill_progress(conf, start, info.batch_interval)
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


# ------------------------------------------------------------------------------------------------
# The DAG
# ------------------------------------------------------------------------------------------------
def build_dag(info: PipelineInfo, settings: Settings):
    """The DAG of one pipeline."""
    from airflow.sdk import DAG, Asset, AssetAny, AssetOrTimeSchedule, Param

    from millpond.orchestration import lineage

    assets = [Asset(f"s3://{settings.bucket_lake}/{settings.table_root}/{info.name}/{t}") for t in TABLE_ASSETS]
    # A stage reads its upstreams' panes: an upstream batch that committed (its run updates the panes
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
        deadline=freshness_deadline(info),  # freshness.last_batch: batches that stop arriving (None: none)
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

        # its operator also answers the OpenLineage provider: the datasets read and written, the batch's facts
        @lineage.microbatch_task(task_id=TASK_ID, inlets=inlets, outlets=assets,
                                 lineage=lineage.datasets(info, settings))
        def microbatch(**context: Any) -> dict[str, Any]:
            """The run's micro-batch, whole: demo landing when asked, the batch with its validation, the
            Data Docs of what changed, the table Assets' events (see ``run_microbatch``)."""
            return run_microbatch(info, context, assets)

        microbatch()

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
