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
from millpond.model.timeutil import parse_duration
from millpond.model.triggers import parse_trigger
from millpond.model.watermark import WatermarkPolicy
from millpond.model.windows import window_fn


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


#: the keys a pipeline file may hold, and the keys of its blocks that are not interpreted elsewhere
PIPELINE_KEYS = ("name", "description", "source", "value_type", "window", "trigger", "accumulation", "aggregation",
                 "allowed_lateness", "batch_interval", "watermark", "dedup", "demo", "computation")
BLOCK_KEYS = {"source": ("prefix", "pipeline", "pipelines", "stream", "key", "event_time", *LISTING_KEYS),
              "dedup": ("horizon",)}
WATERMARK_KEYS = {"processing_time": ("lag",), "bounded_out_of_orderness": ("bound",), "injector": ("bound",),
                  "percentile": ("percentile", "fallback_lag"), "explicit": ("values",), "perfect": ()}


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
    return spec
