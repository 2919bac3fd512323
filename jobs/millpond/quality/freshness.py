"""Freshness: is a pipeline's watermark advancing, and are its batches arriving? Against ``freshness:`` in its file.

Two checks, both optional, both warnings (a breach never stops a batch):

- ``watermark_lag``: a batch's processing time minus its (output) watermark. A watermark that has not started
  (no event yet under an event-time policy) lags without bound.
- ``last_batch``: a batch's processing time minus the previous committed batch's. Judged at the batch's own
  processing time, not the wall clock, so a rerun, a backfill and a reprocess judge a batch as its live run did.
  While no batch arrives at all, Airflow's deadline alert says so (``orchestration.dagfactory``).

A validated batch checks both with the ``millpond_freshness`` suite (one row, :class:`BatchFreshness`): a breach is
a failed warning in its Data Docs. ``millpond history P`` and ``make report`` compute the same numbers from the
``batches`` table. :func:`alert` logs a breach in one line and hands it to the deployment's hook
(``quality.freshness_hook``: ``module:function``, or an ``http(s)://`` URL that gets the alert as JSON).
"""

from __future__ import annotations

import importlib
import json
import logging
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import yaml

from millpond.config import Settings
from millpond.model.timeutil import MAX_TS, MIN_TS, iso, to_us

log = logging.getLogger(__name__)

#: check -> (its column in the suite's row, its expectation parameter)
CHECKS = {"watermark_lag": ("watermark_lag_s", "max_watermark_lag_s"),
          "last_batch": ("since_last_batch_s", "max_last_batch_s")}
HOOK_TIMEOUT_S = 10.0


def duration_text(us: int | float) -> str:
    """A duration as people write it: ``45m``, ``2h30m``, ``1d2h``, ``90s``, ``0.5s``."""
    if us < 0:
        return "-" + duration_text(-us)
    seconds = us / 1e6
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:.3g}s"
    total = int(round(seconds))
    if total >= 3650 * 86400:
        return "unbounded"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if total >= size:
            parts.append(f"{total // size}{unit}")
            total %= size
    return "".join(parts[:2]) or "0s"


@dataclass(frozen=True)
class BatchFreshness:
    """One batch's freshness (times in microseconds) against the declared ``limits`` (microseconds by check)."""

    pipeline: str
    batch: int
    processing_time: int
    watermark: int
    #: the previous committed batch's processing time (None: the pipeline's first batch)
    previous: int | None
    limits: dict[str, int] = field(default_factory=dict)

    def measured(self) -> dict[str, int | None]:
        """Each declared check's value in microseconds (None: nothing to judge, e.g. a first batch)."""
        values = {"watermark_lag": self.processing_time - max(self.watermark, MIN_TS),
                  "last_batch": None if self.previous is None else self.processing_time - self.previous}
        return {check: values[check] for check in CHECKS if check in self.limits}

    def breaches(self) -> list[dict[str, str]]:
        """``{"check", "message"}`` per exceeded threshold, the message one line naming the pipeline and batch."""
        out = []
        for check, value in self.measured().items():
            limit = self.limits[check]
            if value is None or value <= limit:
                continue
            where = f"{self.pipeline} batch {self.batch} at {iso(self.processing_time)}"
            if check == "watermark_lag":
                since = ("has not started: no event yet" if self.watermark <= MIN_TS
                         else f"is {iso(self.watermark)}")
                text = (f"{where}: watermark lag {duration_text(value)} exceeds freshness.watermark_lag "
                        f"{duration_text(limit)} (the watermark {since})")
            else:
                text = (f"{where}: {duration_text(value)} since the previous batch (at {iso(self.previous)}) "
                        f"exceeds freshness.last_batch {duration_text(limit)}")
            out.append({"check": check, "message": text})
        return out

    def marker(self) -> str:
        """The breaches in a few words, for ``millpond history`` ('' when fresh)."""
        words = {"watermark_lag": "watermark lag {v} > {lim}", "last_batch": "{v} since last batch > {lim}"}
        return "; ".join(words[b["check"]].format(v=duration_text(self.measured()[b["check"]] or 0),
                                                  lim=duration_text(self.limits[b["check"]]))
                         for b in self.breaches())

    def frame(self) -> pd.DataFrame:
        """The ``millpond_freshness`` suite's row: seconds per check, null where the check is not declared."""
        measured = self.measured()
        row: dict[str, Any] = {"batch": self.batch, "processing_time": iso(self.processing_time),
                               "watermark": "-inf" if self.watermark <= MIN_TS else
                               "+inf" if self.watermark >= MAX_TS else iso(self.watermark)}
        for check, (column, _) in CHECKS.items():
            value = measured.get(check)
            row[column] = float("nan") if value is None else value / 1e6
        return pd.DataFrame([row]).astype({c: "float64" for c, _ in CHECKS.values()})

    def params(self) -> dict[str, float]:
        """The suite's thresholds in seconds (an undeclared check's column is null: its bound judges nothing)."""
        return {param: self.limits.get(check, 0) / 1e6 for check, (_, param) in CHECKS.items()}


def history_markers(pipeline: str, batches: list[dict[str, Any]], limits: dict[str, int]) -> list[str]:
    """Per committed batch (``batch``, ``processing_time``, ``watermark``; in batch order), its breaches in a few
    words ('' when fresh): what ``millpond history P`` shows in its ``freshness`` column."""
    out, previous = [], None
    for row in batches:
        p = to_us(row["processing_time"])
        w = MIN_TS if row.get("watermark") is None else to_us(row["watermark"])
        out.append(BatchFreshness(pipeline, int(row["batch"]), p, w, previous, limits).marker())
        previous = p
    return out


def declared(settings: Settings, pipeline: str) -> dict[str, int]:
    """The ``freshness`` thresholds of the pipeline file named ``pipeline`` in the conf dir ({} when it declares
    none, or there is no such file: a pipeline's history and report do not need one)."""
    from millpond.model.spec import pipeline_from_dict

    for path in sorted((settings.conf_dir / "pipelines").glob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(doc, dict) and str(doc.get("name") or path.stem) == pipeline:
            try:
                return pipeline_from_dict(doc).freshness
            except (ValueError, TypeError, ImportError) as exc:
                log.warning("%s: freshness not read (%s)", path.name, exc)
                return {}
    return {}


def _post(url: str, payload: dict[str, Any]) -> None:
    request = urllib.request.Request(url, data=json.dumps(payload, default=str).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HOOK_TIMEOUT_S) as response:  # noqa: S310 - the operator's URL
        response.read()


def hook(target: str) -> Callable[..., Any]:
    """The callable ``quality.freshness_hook`` names: ``module:function``, or a URL the alert is POSTed to as JSON."""
    if target.startswith(("http://", "https://")):
        return lambda **payload: _post(target, payload)
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"quality.freshness_hook {target!r}: expected module:function or an http(s):// URL")
    return getattr(importlib.import_module(module), name)


def alert(settings: Settings, pipeline: str, check: str, message: str, detail: dict[str, Any] | None = None, *,
          strict: bool = False) -> bool:
    """A freshness breach: one log line, then the deployment's hook (``quality.freshness_hook``), called as
    ``hook(pipeline=, check=, message=, detail=)``. Whether a hook took it; a failing hook is logged (``strict``:
    raised, so that Airflow marks its deadline callback failed)."""
    log.warning("freshness alert: %s", message)
    target = settings.freshness_hook.strip()
    if not target:
        return False
    try:
        hook(target)(pipeline=pipeline, check=check, message=message, detail=dict(detail or {}))
    except Exception as exc:
        log.error("freshness hook %s failed for %s: %s", target, pipeline, exc)
        if strict:
            raise
        return False
    return True
