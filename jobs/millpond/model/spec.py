"""A pipeline's configuration (``conf/pipelines/*.yaml``) turned into an executable strategy."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from millpond.model.accumulation import Accumulation
from millpond.model.aggregations import combiner, output_value_type
from millpond.model.listing import LISTING_KEYS, Listing
from millpond.model.stages import Upstream, check_stage, parse_upstream
from millpond.model.step import Strategy
from millpond.model.timeutil import MAX_TS, parse_duration
from millpond.model.triggers import parse_trigger
from millpond.model.watermark import WatermarkPolicy
from millpond.model.windows import FixedWindows, GlobalWindows, Sessions, SlidingWindows, window_fn


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    source_prefix: str
    value_type: str
    window: dict[str, Any]
    trigger: str
    accumulation: str
    aggregation: str
    allowed_lateness: int
    batch_interval: int
    watermark: dict[str, Any]
    description: str = ""
    demo: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    #: the upstream pipelines whose panes are this pipeline's input (None: landing files under the prefix)
    upstream: Upstream | None = None
    #: how the landing prefix is listed (``model.listing``)
    listing: Listing = field(default_factory=Listing)

    def strategy(self) -> Strategy:
        return Strategy(
            window_fn=window_fn(self.window),
            trigger=parse_trigger(self.trigger),
            mode=Accumulation.parse(self.accumulation),
            combiner=combiner(self.aggregation),
            allowed_lateness=self.allowed_lateness,
        )

    @property
    def mode(self) -> Accumulation:
        return Accumulation.parse(self.accumulation)

    @property
    def watermark_policy(self) -> WatermarkPolicy:
        return WatermarkPolicy.from_config(self.watermark)

    @property
    def pane_value_type(self) -> str:
        return output_value_type(combiner(self.aggregation), self.value_type)

    @property
    def freshness(self) -> dict[str, int]:
        """The declared ``freshness`` thresholds in microseconds by check (``watermark_lag``, ``last_batch``)."""
        return parse_freshness(self.raw.get("freshness"))

    @property
    def retention(self) -> int | None:
        """How long this pipeline's table history is kept, in microseconds, when its file says (``retention:``);
        the deployment's ``retention`` setting applies when it is longer, or when the file says nothing."""
        return parse_retention(self.raw.get("retention"))

    @property
    def expire(self) -> int | None:
        """How long the output rows of a window are kept once it has ended (``expire: 90d``, event time against
        the watermark), in microseconds; None: kept for good."""
        return parse_expire(self.raw.get("expire"))


#: the keys a pipeline file may hold, and the keys of its blocks that are not interpreted elsewhere
PIPELINE_KEYS = ("name", "description", "source", "value_type", "window", "trigger", "accumulation", "aggregation",
                 "allowed_lateness", "batch_interval", "watermark", "dedup", "demo", "computation", "freshness")
#: ``freshness``: watermark_lag = a batch's processing time - its watermark; last_batch = a batch's processing
#: time - the previous batch's (and, in Airflow, how long after an interval's start its batch may still be missing)
FRESHNESS_KEYS = ("watermark_lag", "last_batch")
BLOCK_KEYS = {"source": ("prefix", "pipeline", "pipelines", "stream", "key", "event_time", *LISTING_KEYS),
              "dedup": ("horizon",), "freshness": FRESHNESS_KEYS}
WATERMARK_KEYS = {"processing_time": ("lag",), "bounded_out_of_orderness": ("bound",), "injector": ("bound",),
                  "percentile": ("percentile", "fallback_lag"), "explicit": ("values",), "perfect": ()}
#: ``retention``: a pipeline that needs a longer history than the deployment's (time travel, reprocess, stages)
PIPELINE_KEYS += ("retention",)
#: ``expire``: a time to live for the output rows of windows that ended long ago (``runtime.upkeep.expire_rows``)
PIPELINE_KEYS += ("expire",)


def _unknown(where: str, key: str, known: tuple[str, ...]) -> ValueError:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"use one of {', '.join(known)}"
    return ValueError(f"unknown key {where}{key!r}: {hint}")


def check_keys(doc: dict[str, Any]) -> None:
    """Strict pipeline files: a misspelt key (``allowed_latenes``) is an error, never a silent default."""
    if not isinstance(doc, dict):
        raise ValueError("a pipeline file holds a mapping of keys")
    for key in doc:
        if key not in PIPELINE_KEYS:
            raise _unknown("", str(key), PIPELINE_KEYS)
    for block, known in BLOCK_KEYS.items():
        value = doc.get(block)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{block}: expected a mapping such as {{{known[0]}: ...}}, got {value!r}")
        for key in value or {}:
            if key not in known:
                raise _unknown(f"{block}.", str(key), known)
    watermark = doc.get("watermark")
    if isinstance(watermark, dict):
        known = WATERMARK_KEYS.get(str(watermark.get("policy", "processing_time")))
        for key in watermark:
            if known is not None and key != "policy" and key not in known:
                raise _unknown("watermark.", str(key), ("policy", *known))
    for key in ("window", "watermark", "demo"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ValueError(f"{key}: expected a mapping, got {doc[key]!r}")


def dedup_horizon_floor(window: dict[str, Any], allowed_lateness: int) -> int | None:
    """The shortest ``dedup.horizon`` under which no record is counted twice, in microseconds; None when it
    cannot be known (a custom window function without a ``span``); MAX_TS for the global window (never closed).

    A record is accepted while its window ends later than the input watermark less allowed lateness (its own
    window, before any merge: for sessions [t, t + gap)), so while its event time is later than ``watermark -
    allowed_lateness - span``; its id is forgotten once its event time is behind ``watermark - horizon``
    (``runtime.steps.dedup``; the watermark never moves back). Ids must outlive acceptance: the horizon must be
    at least allowed lateness plus the span (less one microsecond, exactly), which is also the default."""
    fn = window_fn(window)
    if isinstance(fn, GlobalWindows):
        return MAX_TS
    span = fn.span()
    return None if span is None else allowed_lateness + span


def _duration_text(us: int) -> str:
    """Microseconds as a duration a pipeline file takes (``11m``, ``150m``, ``89500ms``)."""
    if not us:
        return "0s"
    for unit, factor in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000),
                         ("ms", 1_000)):
        if us % factor == 0:
            return f"{us // factor}{unit}"
    return f"{us}us"


def check_dedup_horizon(doc: dict[str, Any], window: dict[str, Any], allowed_lateness: int) -> None:
    """A ``dedup.horizon`` shorter than ``dedup_horizon_floor`` would forget ids whose records are still
    accepted, and count a re-delivery twice: refused, in one line naming the minimum."""
    horizon = (doc.get("dedup") or {}).get("horizon")
    if horizon is None or doc.get("computation") is not None:  # a computation has no window to bound it
        return
    floor = dedup_horizon_floor(window, allowed_lateness)
    given = parse_duration(horizon)
    if floor is None or given >= floor:
        return
    if floor == MAX_TS:
        raise ValueError(f"dedup.horizon {_duration_text(given)}: the global window never closes, so a record "
                         "delivered again is accepted at any age and its id must be kept for good: "
                         "remove dedup.horizon")
    fn = window_fn(window)
    span = ("the session gap" if isinstance(fn, Sessions) else
            "the window size" if isinstance(fn, (FixedWindows, SlidingWindows)) else "the window's span")
    raise ValueError(
        f"dedup.horizon {_duration_text(given)} is shorter than allowed_lateness {_duration_text(allowed_lateness)} "
        f"plus {span} {_duration_text(floor - allowed_lateness)}: a record delivered again while still within "
        f"allowed lateness would be counted twice; set dedup.horizon to at least {_duration_text(floor)}, "
        "or leave it out (the default is that minimum)")


def parse_freshness(block: dict[str, Any] | None, batch_interval: int | None = None) -> dict[str, int]:
    """``freshness: {watermark_lag: 30m, last_batch: 15m}`` (both optional) as positive microseconds; with
    ``batch_interval``, a last_batch that every batch would exceed is refused."""
    out = {}
    for key, value in (block or {}).items():
        try:
            us = None if isinstance(value, bool) else parse_duration(value)
        except ValueError:
            us = None
        if us is None or us <= 0:
            raise ValueError(f"freshness.{key}: expected a positive duration such as 30m, got {value!r}")
        out[str(key)] = us
    if batch_interval is not None and out.get("last_batch", batch_interval + 1) <= batch_interval:
        raise ValueError(f"freshness.last_batch {_duration_text(out['last_batch'])} must be longer than batch_interval "
                         f"{_duration_text(batch_interval)}: batches come one batch_interval apart at best")
    return out


def parse_retention(value: Any) -> int | None:
    """``retention: 30d`` as positive microseconds (None: not given)."""
    return _positive_duration("retention", value, "30d")


def parse_expire(value: Any) -> int | None:
    """``expire: 90d`` as positive microseconds (None: not given)."""
    return _positive_duration("expire", value, "90d")


def _positive_duration(key: str, value: Any, example: str) -> int | None:
    if value is None:
        return None
    try:
        us = None if isinstance(value, bool) else parse_duration(value)
    except (ValueError, TypeError):
        us = None
    if us is None or us <= 0:
        raise ValueError(f"{key}: expected a duration longer than zero such as {example}, got {value!r}")
    return us


def check_expire(doc: dict[str, Any], window: dict[str, Any], allowed_lateness: int) -> None:
    """``expire`` removes the rows of windows that ended that long before the watermark: only windows that close
    have such rows, and only once no late pane can reach them any more."""
    us = parse_expire(doc.get("expire"))
    if us is None:
        return
    if doc.get("computation") is not None:
        raise ValueError("expire: a computation pipeline has no windows whose rows could expire: remove expire")
    if isinstance(window_fn(window), GlobalWindows):
        raise ValueError("expire: the global window never ends, so none of its rows would ever expire: remove "
                         "expire, or use windows that close")
    if us <= allowed_lateness:
        raise ValueError(f"expire {_duration_text(us)} must be longer than allowed_lateness "
                         f"{_duration_text(allowed_lateness)}: a late pane could land on a window whose rows expired")


def pipeline_from_dict(doc: dict[str, Any]) -> PipelineSpec:
    """Validate a config mapping: every mistake is reported by name, before anything runs."""
    check_keys(doc)
    if "name" not in doc:
        raise ValueError("pipeline config needs a name")
    name = str(doc["name"])
    if not name.replace("_", "").isalnum():
        raise ValueError(f"pipeline name {name!r}: use letters, digits and underscores")
    value_type = doc.get("value_type", "int")
    if value_type not in ("int", "float"):
        raise ValueError(f"value_type {value_type!r}: use int or float")
    source = doc.get("source") or {}
    upstream = parse_upstream(source)
    if upstream is not None:
        check_stage(doc, str(doc.get("aggregation", "sum")))
        if listed := [k for k in LISTING_KEYS if k in source]:
            raise ValueError(f"source.{listed[0]}: a stage reads its upstreams' panes, it lists no landing prefix")
    spec = PipelineSpec(
        name=name,
        source_prefix=str(source.get("prefix", f"{name}/")),
        value_type=value_type,
        window=dict(doc.get("window") or {"type": "global"}),
        trigger=str(doc.get("trigger") or "Repeat(AtWatermark())"),
        accumulation=str(doc.get("accumulation", "accumulating")),
        aggregation=str(doc.get("aggregation", "sum")),
        allowed_lateness=parse_duration(doc.get("allowed_lateness", 0)),
        batch_interval=parse_duration(doc.get("batch_interval", "5m")),
        watermark=dict(doc.get("watermark") or {"policy": "processing_time", "lag": 0}),
        description=str(doc.get("description", "")),
        demo=dict(doc.get("demo") or {}),
        raw=dict(doc),
        upstream=upstream,
        listing=Listing.from_source(source),
    )
    if doc.get("computation") is not None:  # a MillWheel computation (millpond.model.computation) replaces them
        if doc.get("window") is not None or doc.get("trigger") is not None:
            raise ValueError("computation pipelines take no window or trigger (the computation's timers decide)")
        from millpond.model.computation import load_computation

        load_computation(doc["computation"])  # importable, a Computation, options accepted
    spec.strategy()  # parse window, trigger, accumulation and aggregation now
    _ = spec.watermark_policy  # and the watermark policy
    check_dedup_horizon(doc, spec.window, spec.allowed_lateness)
    parse_freshness(doc.get("freshness"), spec.batch_interval)
    parse_retention(doc.get("retention"))
    check_expire(doc, spec.window, spec.allowed_lateness)
    return spec
