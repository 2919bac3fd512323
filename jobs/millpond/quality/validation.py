"""Data quality of a micro-batch with Great Expectations: raw input, emitted panes, window state.

Why this shape:
- Suites are reviewed JSON committed under ``expectations/`` (the GX expectations store points
  there); everything GX writes at run time (config, checkpoints, validation results, Data Docs)
  lives under ``settings.home/gx`` so the repository stays clean. Everything is get-or-create:
  nothing is rewritten with fresh UUIDs on start.
- Frames are validated where they live: pandas frames (the local engine) with GX's pandas engine,
  Spark DataFrames (the Spark engine, a classic or a Spark Connect session) with GX's Spark engine, so a
  Spark batch's rows never come to the driver (only aggregates and GX's few unexpected examples do).
  The ``chk_*`` helper columns are computed by the same engine (:mod:`millpond.quality.suites` with
  pandas, :mod:`millpond.quality.spark_checks` with Spark's functions; a test keeps them equal). Spark
  pays a fixed cost per checkpoint (GX runs Spark jobs per metric graph level), pandas none; GX looks for
  unexpected examples only when its count found some, and the suites and each level's jobs run side by side
  (:mod:`millpond.quality.gx_spark`).
- GX is not thread-safe, so one validation runs at a time per process (its Spark suites run in threads, each
  on its own batch, which GX keeps apart); a file lock serialises
  the few writes (set-up, pruning, index builds) between processes sharing ``settings.home``.
- Severity lives in each expectation's ``meta`` (and GX's own ``severity`` field): a critical
  failure makes ``QualityReport.ok`` false, a warning is only reported.
- Freshness (``freshness:`` in a pipeline file) is a one-row suite of warnings, ``millpond_freshness``
  (:mod:`millpond.quality.freshness`): validated with pandas whatever the batch's engine (it is one row).
- History is bounded: only the last ``keep`` validation results per suite are kept
  (``MILLPOND_DQ_KEEP_RESULTS``, default 100), so Data Docs builds do not slow down as batches pile up.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from millpond.config import Settings
from millpond.quality import suites as qs
from millpond.quality.context import (
    _LOCK,
    PANDAS,
    SPARK,
    checkpoint_name,
    file_lock,
    get_context,
    keep_results,
    prune_results,
    validation_page_path,
    validation_result_path,
)
from millpond.quality.freshness import BatchFreshness
from millpond.quality.gx_spark import resolved_on_spark

log = logging.getLogger(__name__)

DEFAULT_FUTURE_TOLERANCE = timedelta(days=1)


@dataclass
class QualityReport:
    """What a batch's validation found; ``seconds`` lets the batch report validation's share of its time."""

    pipeline: str
    batch: int
    critical_failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    result_urls: list[str] = field(default_factory=list)
    #: the run's Data Docs pages (rendered with it, or by the next Data Docs build when it was not asked to)
    pages: list[str] = field(default_factory=list)
    suites: dict[str, bool] = field(default_factory=dict)  # suite -> GX success (all expectations met)
    seconds: float = 0.0
    #: the freshness thresholds the batch exceeded (``{"check", "message"}``; also among ``warnings``)
    freshness: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.critical_failures

    def summary(self) -> str:
        state = "ok" if self.ok else f"{len(self.critical_failures)} critical"
        return (f"quality {self.pipeline} batch {self.batch}: {state}, {len(self.warnings)} warning(s), "
                f"{len(self.suites)} suite(s) in {self.seconds:.2f}s")


# -- validation --------------------------------------------------------------------------------
def _describe(suite: str, r: Any) -> str:
    cfg = r.expectation_config
    kw = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_list", "column_A", "column_B")}
    where = ", ".join(f"{v}" for v in kw.values()) or "table"
    res = r.result or {}
    if r.exception_info and r.exception_info.get("raised_exception"):
        detail = f"error: {str(r.exception_info.get('exception_message'))[:200]}"
    elif "unexpected_count" in res:
        sample = res.get("partial_unexpected_list") or []
        detail = f"{res['unexpected_count']} of {res.get('element_count')} rows unexpected, e.g. {sample[:3]}"
    elif "details" in res:
        detail = f"{res['details']}"
    else:
        detail = f"observed {res.get('observed_value')}"
    why = (cfg.meta or {}).get("why", "")
    return f"{suite}: {cfg.type}({where}): {detail}" + (f" [{why}]" if why else "")


def severity_of(r: Any) -> str:
    cfg = r.expectation_config
    meta = cfg.meta or {}
    sev = meta.get("severity") or getattr(cfg, "severity", None) or qs.CRITICAL
    return str(getattr(sev, "value", sev)).lower()


def validate_batch(
    settings: Settings,
    pipeline: str,
    batch: int,
    *,
    raw: Any,
    panes: Any,
    state: Any,
    prior_panes: Any = None,
    processing_time: datetime | None = None,
    window_type: str | None = None,
    future_tolerance: timedelta = DEFAULT_FUTURE_TOLERANCE,
    render: bool = True,
    retractions: bool = True,
    freshness: BatchFreshness | None = None,
) -> QualityReport:
    """Validate what one batch read, emitted and left as state; never raises on bad data.

    The frames are pandas DataFrames or Spark DataFrames (all of one kind, ``prior_panes`` too): Spark
    ones are validated on Spark (panes and state cached while their suites run, unpersisted after).
    ``processing_time`` (default now) bounds plausible event times; ``window_type`` 'sliding' or
    'custom' turns off the session-overlap check (such windows overlap by design); ``render`` writes
    this run's Data Docs pages right away (incremental: the index is rebuilt by :func:`build_data_docs`,
    which also renders the pages of results that have none); a failed check's pages are rendered anyway,
    so its error can point at one. ``retractions=False`` tells that ``panes`` holds no retraction (a Spark
    batch knows it from a query it runs anyway), which spares the Spark engine the retraction check's sort.
    ``freshness``: the batch's freshness against its pipeline's thresholds, checked by the freshness suite.
    """
    start = time.perf_counter()  # includes the one-time GX import and set-up: the first batch pays it
    report = QualityReport(pipeline, batch)
    now = processing_time or datetime.now(UTC)
    engine = _engine(raw, panes, state, prior_panes)
    frames = _prepare(engine, raw, panes, state, prior_panes, window_type, retractions)
    params = {"max_event_epoch_s": (now + future_tolerance).timestamp()}
    try:
        with _LOCK:
            _run(settings, pipeline, batch, engine, frames, params, report, render)
            _run_freshness(settings, pipeline, batch, freshness, report, render)
    finally:
        if engine == SPARK:
            for df in frames.values():
                if df is not None:
                    df.unpersist()
    report.seconds = time.perf_counter() - start
    (log.warning if not report.ok else log.info)(report.summary())
    return report


def validate_streams(settings: Settings, pipeline: str, batch: int, streams: dict[str, Any],
                     render: bool = True, freshness: BatchFreshness | None = None,
                     engine: str = PANDAS) -> QualityReport:
    """Validate what a MillWheel computation's batch produces (frames by stream name: pandas, or Spark
    DataFrames with ``engine`` SPARK) with the committed suite of each stream that has one
    (``millpond_stream_<stream>``), and its ``freshness``; never raises on bad data."""
    start = time.perf_counter()
    report = QualityReport(pipeline, batch)
    frames = {qs.STREAM_PREFIX + name: df for name, df in sorted(streams.items())
              if qs.STREAM_PREFIX + name in qs.SUITES}
    if frames or freshness is not None:
        with _LOCK:
            if frames:
                _run(settings, pipeline, batch, engine, frames, {}, report, render)
            _run_freshness(settings, pipeline, batch, freshness, report, render)
    report.seconds = time.perf_counter() - start
    (log.warning if not report.ok else log.info)(report.summary())
    return report


def _run_freshness(settings: Settings, pipeline: str, batch: int, freshness: BatchFreshness | None,
                   report: QualityReport, render: bool) -> None:
    """The freshness suite on the batch's one row (pandas, whatever the batch's engine); its breaches noted."""
    if freshness is None or not freshness.limits:
        return
    _run(settings, pipeline, batch, PANDAS, {qs.FRESHNESS: freshness.frame()}, freshness.params(), report, render)
    if not report.suites.get(qs.FRESHNESS, True):
        report.freshness = freshness.breaches()


def _engine(*frames: Any) -> str:
    """SPARK when the frames are Spark DataFrames (classic or Connect), else PANDAS; never both."""
    kinds = {SPARK if type(f).__module__.startswith("pyspark.") else PANDAS for f in frames if f is not None}
    if len(kinds) > 1:
        raise TypeError("validate_batch takes pandas frames or Spark DataFrames, not both")
    return kinds.pop() if kinds else PANDAS


def _prepare(engine: str, raw: Any, panes: Any, state: Any, prior: Any, window_type: str | None,
             retractions: bool = True) -> dict[str, Any]:
    """The frames with their ``chk_*`` columns, computed by the frames' own engine (Spark: panes and state
    cached, as every suite runs several jobs over its frame and their checks are window functions; raw's
    checks, and panes' when they hold no retraction, are projections of rows the engine has kept already:
    copying them would cost more than the few jobs that read them)."""
    if engine == PANDAS:
        return {qs.RAW: None if raw is None else qs.prepare_raw(raw),
                qs.PANES: None if panes is None else qs.prepare_panes(panes, prior),
                qs.STATE: None if state is None else qs.prepare_state(state, window_type)}
    from millpond.quality import spark_checks as sc

    # suite -> (its frame, the frame with its checks, cached for the suite's several jobs?)
    checks = {qs.RAW: (raw, lambda: sc.prepare_raw(raw), False),
              qs.PANES: (panes, lambda: sc.prepare_panes(panes, prior, retractions), retractions),
              qs.STATE: (state, lambda: sc.prepare_state(state, window_type), True)}

    def make(suite: str) -> Any:
        _df, framed, cached = checks[suite]
        return framed().cache() if cached else framed()

    # each asks the server for its frame's schema and cache: their round trips overlap
    todo = [suite for suite, (df, _f, _c) in checks.items() if df is not None]
    with ThreadPoolExecutor(max(1, len(todo)), thread_name_prefix="gx-prepare") as pool:
        futures = {suite: pool.submit(make, suite) for suite in todo}
        return {suite: futures[suite].result() if suite in futures else None for suite in checks}


def _run(settings: Settings, pipeline: str, batch: int, engine: str, frames: dict[str, Any],
         params: dict[str, Any], report: QualityReport, render: bool) -> None:
    """Each suite's checkpoint on its frame, the report filled in, results pruned, pages rendered.

    On Spark the suites run at the same time, one thread each: their jobs are small and the server's cores
    would idle between one suite's round trips; GX keys each run's metrics by its own batch. Pandas suites
    run one after the other (they hold the interpreter, so threads would not help)."""
    from great_expectations.core.run_identifier import RunIdentifier

    context = get_context(settings, engine)
    todo = [(suite, df, context.checkpoints.get(checkpoint_name(suite, engine)))
            for suite, df in frames.items() if df is not None]

    def run(item: tuple[str, Any, Any]) -> Any:
        suite, df, checkpoint = item
        # run_time given: without it GX parses the run name as a date, and a pipeline named like
        # "t7203516975" overflows dateutil (or, worse, dates the run in year 7203516975).
        return checkpoint.run(batch_parameters={"dataframe": df}, expectation_parameters=params,
                              run_id=RunIdentifier(run_name=f"{pipeline}-{batch}", run_time=datetime.now(UTC)))

    with resolved_on_spark() if engine == SPARK else contextlib.nullcontext():
        if engine == SPARK and len(todo) > 1:
            with ThreadPoolExecutor(len(todo), thread_name_prefix="gx-suite") as pool:
                results = list(pool.map(run, todo))
        else:
            results = [run(item) for item in todo]
    identifiers = []
    for (suite, _, _), result in zip(todo, results, strict=True):
        for vrid, vr in result.run_results.items():
            identifiers.append(vrid)
            report.suites[suite] = bool(vr.success)
            for r in vr.results:
                if r.success:
                    continue
                target = report.critical_failures if severity_of(r) == qs.CRITICAL else report.warnings
                target.append(_describe(suite, r))
    with file_lock(settings):
        prune_results(context, settings, keep_results(settings))
        if identifiers and (render or not report.ok):
            from millpond.quality.datadocs import render_pages

            report.result_urls = render_pages(context, settings, identifiers)
        else:
            report.result_urls = [str(validation_result_path(settings, i)) for i in identifiers]
        report.pages = [str(validation_page_path(settings, i)) for i in identifiers]
