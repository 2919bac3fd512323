"""Pipeline versions: what of a pipeline's spec its stored state depends on, and how two specs differ.

A batch records the fingerprint of its pipeline's semantic spec and the state format it wrote. The next
batch compares: a change that reinterprets stored state (window, trigger, accumulation, aggregation, value
type, computation) stops the pipeline until it is reprocessed under the new spec; a change that is safe by
construction (a longer allowed lateness, a description, batch interval, watermark policy, demo, a dedup
horizon not shorter than allowed lateness plus the window's span, how the landing prefix is listed) is
recorded and the pipeline goes on.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from millpond.model.listing import LISTING_KEYS
from millpond.model.spec import dedup_horizon_floor
from millpond.model.timeutil import parse_duration

#: the layout of the ``windows`` state and the ``batches`` marker this release writes; an older one is
#: read through its migration, a newer one is refused
STATE_FORMAT = 2
#: fields whose change reinterprets stored state or emitted panes
BREAKING = ("value_type", "window", "trigger", "accumulation", "aggregation", "computation", "source")
#: fields that may change between batches: the next batch records the change and goes on
SAFE = ("description", "allowed_lateness", "batch_interval", "watermark", "demo", "dedup", "listing")


def semantic_spec(raw: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields that decide what a batch computes, with the defaults a file may leave out."""
    return {
        "value_type": raw.get("value_type", "int"),
        "window": raw.get("window") or ({"type": "global"} if raw.get("computation") is None else None),
        "trigger": raw.get("trigger") or ("Repeat(AtWatermark())" if raw.get("computation") is None else None),
        "accumulation": raw.get("accumulation", "accumulating"),
        "aggregation": raw.get("aggregation", "sum"),
        "computation": raw.get("computation"),
        # how the prefix is listed decides no result: a safe field of its own, not part of the source
        "source": {k: v for k, v in (raw.get("source") or {"prefix": f"{raw.get('name')}/"}).items()
                   if k not in LISTING_KEYS},
        "listing": {k: v for k, v in (raw.get("source") or {}).items() if k in LISTING_KEYS} or None,
        "allowed_lateness": parse_duration(raw.get("allowed_lateness", 0)),
        "batch_interval": parse_duration(raw.get("batch_interval", "5m")),
        "watermark": raw.get("watermark") or {"policy": "processing_time", "lag": 0},
        "dedup": raw.get("dedup") or {},
        "demo": raw.get("demo") or {},
        "description": raw.get("description", ""),
    }


def canonical(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(spec: dict[str, Any]) -> str:
    """A short hash of the breaking fields: equal fingerprints read each other's state."""
    core = {k: spec.get(k) for k in BREAKING}
    return hashlib.sha256(canonical(core).encode()).hexdigest()[:16]


def changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(breaking changes, safe changes) from ``old`` to ``new``, as field names. A shorter allowed lateness
    drops state a longer one kept: it counts as breaking. So does a dedup horizon that the change leaves
    shorter than allowed lateness plus the window's span (``spec.dedup_horizon_floor``): ids would be forgotten
    while their records are still accepted, and a re-delivery counted twice (a pipeline file with one does not
    load; this keeps a spec built some other way from passing as safe)."""
    breaking = [k for k in BREAKING if old.get(k) != new.get(k)]
    safe = [k for k in SAFE if old.get(k) != new.get(k)]
    if "allowed_lateness" in safe and (new.get("allowed_lateness") or 0) < (old.get("allowed_lateness") or 0):
        safe.remove("allowed_lateness")
        breaking.append("allowed_lateness (shorter)")
    if {"dedup", "allowed_lateness"} & set(safe) and _horizon_too_short(new):
        if "dedup" in safe:
            safe.remove("dedup")
        breaking.append("dedup.horizon (below allowed_lateness + the window's span)")
    return breaking, safe


def _horizon_too_short(spec: dict[str, Any]) -> bool:
    """Whether a semantic spec's explicit dedup horizon is below its floor (unknown: not too short)."""
    try:
        horizon = (spec.get("dedup") or {}).get("horizon")
        if horizon is None or spec.get("computation") is not None or not spec.get("window"):
            return False
        floor = dedup_horizon_floor(spec["window"], spec.get("allowed_lateness") or 0)
        return floor is not None and parse_duration(horizon) < floor
    except (ValueError, TypeError, ImportError, AttributeError):  # a spec recorded by an older file, unreadable now
        return False
