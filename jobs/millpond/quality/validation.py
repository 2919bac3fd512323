"""Data quality of a micro-batch with Great Expectations: raw input, emitted panes, window state.

Why this shape:
- Suites are reviewed JSON committed under ``expectations/`` (the GX expectations store points
  there); everything GX writes at run time (config, checkpoints, validation results, Data Docs)
  lives under ``settings.home/gx`` so the repository stays clean. Everything is get-or-create:
  nothing is rewritten with fresh UUIDs on start.
- DataFrames are validated with pandas: Spark has a 3-10 s fixed cost per checkpoint.
- GX is not thread-safe, so one validation runs at a time per process; a file lock serialises
  the few writes (set-up, pruning, index builds) between processes sharing ``settings.home``.
- Severity lives in each expectation's ``meta`` (and GX's own ``severity`` field): a critical
  failure makes ``QualityReport.ok`` false, a warning is only reported.
- History is bounded: only the last ``keep`` validation results per suite are kept
  (``MILLPOND_DQ_KEEP_RESULTS``, default 100), so Data Docs builds do not slow down as batches pile up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd

from millpond.config import Settings
from millpond.quality import suites as qs
from millpond.quality.context import (
    _LOCK,
    file_lock,
    get_context,
    keep_results,
    prune_results,
    validation_page_path,
    validation_result_path,
)

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
    raw: pd.DataFrame | None,
    panes: pd.DataFrame | None,
    state: pd.DataFrame | None,
    prior_panes: pd.DataFrame | None = None,
    processing_time: datetime | None = None,
    window_type: str | None = None,
    future_tolerance: timedelta = DEFAULT_FUTURE_TOLERANCE,
    render: bool = True,
) -> QualityReport:
    """Validate what one batch read, emitted and left as state; never raises on bad data.

    ``processing_time`` (default now) bounds plausible event times; ``window_type`` 'sliding' or
    'custom' turns off the session-overlap check (such windows overlap by design); ``render`` writes
    this run's Data Docs pages right away (incremental: the index is rebuilt by :func:`build_data_docs`,
    which also renders the pages of results that have none); a failed check's pages are rendered anyway,
    so its error can point at one.
    """
    start = time.perf_counter()  # includes the one-time GX import and set-up: the first batch pays it
    from great_expectations.core.run_identifier import RunIdentifier

    report = QualityReport(pipeline, batch)
    now = processing_time or datetime.now(UTC)
    frames = {
        qs.RAW: None if raw is None else qs.prepare_raw(raw),
        qs.PANES: None if panes is None else qs.prepare_panes(panes, prior_panes),
        qs.STATE: None if state is None else qs.prepare_state(state, window_type),
    }
    params = {"max_event_epoch_s": (now + future_tolerance).timestamp()}
    with _LOCK:
        context = get_context(settings)
        identifiers = []
        for suite, df in frames.items():
            if df is None:
                continue
            checkpoint = context.checkpoints.get(f"{suite}_checkpoint")
            # run_time given: without it GX parses the run name as a date, and a pipeline named like
            # "t7203516975" overflows dateutil (or, worse, dates the run in year 7203516975).
            result = checkpoint.run(batch_parameters={"dataframe": df}, expectation_parameters=params,
                                    run_id=RunIdentifier(run_name=f"{pipeline}-{batch}", run_time=datetime.now(UTC)))
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
    report.seconds = time.perf_counter() - start
    (log.warning if not report.ok else log.info)(report.summary())
    return report
