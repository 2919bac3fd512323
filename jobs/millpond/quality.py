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

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from . import quality_suites as qs
from .config import PROJECT_ROOT, Settings
from .errors import MillpondError

log = logging.getLogger(__name__)

EXPECTATIONS_DIR = Path(os.environ.get("MILLPOND_EXPECTATIONS_DIR", PROJECT_ROOT / "expectations"))
SITE = "millpond"
DATASOURCE = "millpond_pandas"
BATCH_DEFINITION = "whole_dataframe"
DEFAULT_KEEP = 100
DEFAULT_FUTURE_TOLERANCE = timedelta(days=1)

_LOCK = threading.RLock()  # GX is not thread-safe: one validation at a time per process
_CONTEXTS: dict[Path, Any] = {}


@dataclass
class QualityReport:
    """What a batch's validation found; ``seconds`` lets the batch report validation's share of its time."""

    pipeline: str
    batch: int
    critical_failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    result_urls: list[str] = field(default_factory=list)
    suites: dict[str, bool] = field(default_factory=dict)  # suite -> GX success (all expectations met)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.critical_failures

    def summary(self) -> str:
        state = "ok" if self.ok else f"{len(self.critical_failures)} critical"
        return (f"quality {self.pipeline} batch {self.batch}: {state}, {len(self.warnings)} warning(s), "
                f"{len(self.suites)} suite(s) in {self.seconds:.2f}s")


# -- context -----------------------------------------------------------------------------------
def gx_root(settings: Settings) -> Path:
    return Path(settings.home) / "gx"


def site_dir(settings: Settings) -> Path:
    return gx_root(settings) / "data_docs"


def keep_results() -> int:
    return max(1, int(os.environ.get("MILLPOND_DQ_KEEP_RESULTS", DEFAULT_KEEP)))


@contextlib.contextmanager
def file_lock(settings: Settings) -> Iterator[None]:
    """Serialise GX store writes between processes that share ``settings.home``."""
    root = gx_root(settings)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".millpond.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _desired_config() -> dict[str, Any]:
    def fs(base: str, **extra: Any) -> dict[str, Any]:
        return {"class_name": "TupleFilesystemStoreBackend", "base_directory": base, **extra}

    return {
        "config_version": 4,
        "plugins_directory": None,
        "stores": {
            # The reviewed suites, committed in the repository (absolute path: runtime files live elsewhere).
            "expectations_store": {"class_name": "ExpectationsStore",
                                   "store_backend": fs(str(EXPECTATIONS_DIR), suppress_store_backend_id=True)},
            "validation_results_store": {"class_name": "ValidationResultsStore",
                                         "store_backend": fs("validations/", suppress_store_backend_id=True)},
            "checkpoint_store": {"class_name": "CheckpointStore",
                                 "store_backend": fs("checkpoints/", suppress_store_backend_id=True)},
            "validation_definition_store": {"class_name": "ValidationDefinitionStore",
                                            "store_backend": fs("validation_definitions/",
                                                                suppress_store_backend_id=True)},
        },
        "expectations_store_name": "expectations_store",
        "validation_results_store_name": "validation_results_store",
        "checkpoint_store_name": "checkpoint_store",
        "data_docs_sites": {
            SITE: {
                "class_name": "SiteBuilder",
                "show_how_to_buttons": False,
                "store_backend": fs("data_docs/"),
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            }
        },
        "analytics_enabled": False,
        "progress_bars": {"globally": False, "metric_calculations": False},
    }


def _write_config(root: Path) -> None:
    """Write ``great_expectations.yml`` only when our part of it differs (keeps datasources GX added)."""
    path = root / "great_expectations.yml"
    current: dict[str, Any] = yaml.safe_load(path.read_text()) if path.exists() else {}
    desired = {**(current or {}), **_desired_config()}
    if current != desired:
        path.write_text(yaml.safe_dump(desired, sort_keys=False))


def _ensure_suite(context: Any, name: str) -> Any:
    """The committed suite; created from :mod:`quality_suites` only if it is missing."""
    import great_expectations as gx
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    try:
        return context.suites.get(name)
    except Exception:  # noqa: BLE001 - GX raises DataContextError subclasses for "not found"
        pass
    suite = gx.ExpectationSuite(name=name, meta={"owner": "millpond", "notes": qs.__doc__.splitlines()[0]})
    for spec in qs.suite_definitions()[name]:
        config = ExpectationConfiguration(type=spec["type"], kwargs=spec["kwargs"], meta=spec["meta"],
                                          severity=spec["meta"]["severity"])
        suite.add_expectation_configuration(config)
    return context.suites.add(suite)


def _ensure_checkpoint(context: Any, suite_name: str) -> Any:
    import great_expectations as gx

    try:
        return context.checkpoints.get(f"{suite_name}_checkpoint")
    except Exception:  # noqa: BLE001
        pass
    try:
        source = context.data_sources.get(DATASOURCE)
    except Exception:  # noqa: BLE001
        source = context.data_sources.add_pandas(DATASOURCE)
    try:
        asset = source.get_asset(suite_name)
    except LookupError:
        asset = source.add_dataframe_asset(suite_name)
    try:
        batch_definition = asset.get_batch_definition(BATCH_DEFINITION)
    except (KeyError, LookupError):
        batch_definition = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION)
    vd_name = f"{suite_name}_validation"
    try:
        definition = context.validation_definitions.get(vd_name)
    except Exception:  # noqa: BLE001
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=vd_name, data=batch_definition, suite=context.suites.get(suite_name)))
    return context.checkpoints.add(gx.Checkpoint(
        name=f"{suite_name}_checkpoint", validation_definitions=[definition], actions=[],
        result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5}))


def get_context(settings: Settings) -> Any:
    """The project's file GX context (cached per home): config, suites, datasource, checkpoints."""
    root = gx_root(settings)
    with _LOCK:
        if root in _CONTEXTS:
            return _CONTEXTS[root]
        import great_expectations as gx

        if not EXPECTATIONS_DIR.is_dir():
            raise MillpondError(f"expectation suites folder missing: {EXPECTATIONS_DIR}")
        for name in ("great_expectations", "great_expectations.core.usage_statistics"):
            logging.getLogger(name).setLevel(logging.WARNING)
        with file_lock(settings):
            _write_config(root)
            context = gx.get_context(mode="file", project_root_dir=str(root.parent))
            for suite in qs.SUITES:
                _ensure_suite(context, suite)
                _ensure_checkpoint(context, suite)
        _CONTEXTS[root] = context
        return context


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
    this run's Data Docs pages right away (incremental: the index is rebuilt by :func:`build_data_docs`).
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
            prune_results(context, settings, keep_results())
            if render and identifiers:
                from .datadocs import render_pages

                report.result_urls = render_pages(context, settings, identifiers)
            else:
                report.result_urls = [str(validation_result_path(settings, i)) for i in identifiers]
    report.seconds = time.perf_counter() - start
    (log.warning if not report.ok else log.info)(report.summary())
    return report


def validation_result_path(settings: Settings, vrid: Any) -> Path:
    return gx_root(settings) / "validations" / Path(*vrid.to_tuple()).with_suffix(".json")


def validation_page_path(settings: Settings, vrid: Any) -> Path:
    return site_dir(settings) / "validations" / Path(*vrid.to_tuple()).with_suffix(".html")


def prune_results(context: Any, settings: Settings, keep: int) -> int:
    """Delete all but the newest ``keep`` validation results (and their pages) of each suite."""
    store = context.validation_results_store
    by_suite: dict[str, list[Any]] = {}
    for key in store.list_keys():
        by_suite.setdefault(key.expectation_suite_identifier.name, []).append(key)
    removed = 0
    for keys in by_suite.values():
        keys.sort(key=lambda k: k.run_id.run_time)
        for key in keys[: max(0, len(keys) - keep)]:
            store.remove_key(key)
            page = validation_page_path(settings, key)
            page.unlink(missing_ok=True)
            for path in (validation_result_path(settings, key), page):
                _remove_empty_parents(path.parent, stop=gx_root(settings))
            removed += 1
    return removed


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
