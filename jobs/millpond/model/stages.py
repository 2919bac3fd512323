"""Stages: a pipeline whose input is another pipeline's panes (Dataflow paper, section 2.4).

A pipeline file says ``source: {pipeline: sessions, stream: panes}`` (or ``pipelines: [a, b]`` for fan-in)
instead of ``source: {prefix: ...}``. Each upstream pane becomes one downstream element:

- ``key``: ``keep`` (default) the upstream key, or ``all``: one key, ``"all"``, for a total over keys;
- ``event_time``: ``window_end`` (default; the window's last instant, ``end - 1us``, Beam's end of window,
  so that an on-time upstream pane is never late downstream) or ``window_start``;
- the value: what the pane changed. Over an ``accumulating_and_retracting`` upstream a value pane adds its
  value and a retraction pane subtracts its value; over an ``accumulating`` upstream a pane adds its value
  minus the window's previous pane's value; over a ``discarding`` upstream a pane adds its value.

A regrouping consumer must undo what it took from a pane that changed, so the downstream aggregation must
be additive (``sum``, or a Combiner with ``additive = True``), or the stage a MillWheel computation, which
takes the elements as its records (Zeitgeist's model over its window counter). An ``accumulating`` upstream with merging
windows (sessions) cannot be undone (a merge retracts nothing) and is refused: use
``accumulating_and_retracting``. These rules are pure; ``runtime.steps.upstream`` reads the panes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from millpond.model.aggregations import combiner, output_value_type
from millpond.model.windows import window_fn

STREAMS = ("panes",)
KEY_MODES = ("keep", "all")
EVENT_TIMES = ("window_end", "window_start")
#: the key every element gets under ``key: all``
ALL_KEY = "all"


@dataclass(frozen=True)
class Upstream:
    """Where a stage reads: the upstream pipelines, their stream, and how a pane becomes an element."""

    pipelines: tuple[str, ...]
    stream: str = "panes"
    key: str = "keep"
    event_time: str = "window_end"


def parse_upstream(source: Mapping[str, Any]) -> Upstream | None:
    """The ``source`` block's upstream, or None for landing files (``prefix``)."""
    if "pipeline" not in source and "pipelines" not in source:
        for k in ("stream", "key", "event_time"):
            if k in source:
                raise ValueError(f"source.{k} applies to an upstream source: add source.pipeline")
        return None
    if "prefix" in source:
        raise ValueError("source: either prefix (landing files) or pipeline (an upstream's panes), not both")
    if "pipeline" in source and "pipelines" in source:
        raise ValueError("source: either pipeline or pipelines, not both")
    names = source.get("pipelines") if "pipelines" in source else [source["pipeline"]]
    if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
        raise ValueError(f"source.pipelines: expected a list of pipeline names, got {names!r}")
    names = tuple(str(n) for n in names)
    if len(set(names)) != len(names):
        raise ValueError(f"source.pipelines: {list(names)} names a pipeline twice")
    up = Upstream(names, str(source.get("stream", "panes")), str(source.get("key", "keep")),
                  str(source.get("event_time", "window_end")))
    for field, value, known in (("stream", up.stream, STREAMS), ("key", up.key, KEY_MODES),
                                ("event_time", up.event_time, EVENT_TIMES)):
        if value not in known:
            raise ValueError(f"source.{field} {value!r}: use {' or '.join(known)}")
    return up


def check_stage(doc: Mapping[str, Any], aggregation: str) -> None:
    """What a stage's own file must say: an additive aggregation (a computation takes the elements as
    records instead, MillWheel's downstream computation), no watermark policy."""
    comb = combiner(aggregation)
    if doc.get("computation") is None and not getattr(comb, "additive", False):
        raise ValueError(
            f"aggregation {aggregation!r} cannot read an upstream's panes: they arrive as additions and "
            "retractions (negative values), which only an additive aggregation takes (sum, or a Combiner with "
            "additive = True)")
    if doc.get("watermark") is not None:
        raise ValueError("a pipeline with an upstream source takes its input watermark from its upstreams "
                         "(the least of their committed watermarks): remove its watermark block")


def check_upstream(name: str, upstream: str, up: Mapping[str, Any], value_type: str) -> None:
    """Whether stage ``name`` can read pipeline ``upstream``, from the upstream's semantic spec
    (``model.versions.semantic_spec``: a pipeline file, or the spec its last marker recorded)."""
    if up.get("computation") is not None:
        raise ValueError(f"{name}: upstream {upstream!r} is a computation; only a windowed pipeline's panes "
                         "can be read")
    accumulation = str(up.get("accumulation") or "accumulating")
    if accumulation == "accumulating" and window_fn(dict(up.get("window") or {"type": "global"})).merging:
        raise ValueError(
            f"{name}: upstream {upstream!r} is accumulating with merging windows ({up['window'].get('type')}): "
            "a merge retracts nothing there, so a consumer cannot undo what it took; make it "
            "accumulating_and_retracting")
    emitted = output_value_type(combiner(str(up.get("aggregation") or "sum")), str(up.get("value_type") or "int"))
    if emitted != value_type:
        raise ValueError(f"{name}: value_type {value_type!r}, but upstream {upstream!r} emits {emitted!r} values: "
                         f"set value_type: {emitted}")


def graph_cycle(edges: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    """A cycle in the stage graph (pipeline -> the upstreams it reads) as a path back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def upstream_first(edges: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The pipelines in an order where each comes after the upstreams it reads (an acyclic graph), else by
    name: a run over all pipelines then feeds each stage what its upstreams committed in the same round."""
    done: list[str] = []

    def visit(node: str) -> None:
        if node in done or node not in edges:
            return
        for nxt in sorted(edges[node]):
            visit(nxt)
        done.append(node)

    for name in sorted(edges):
        visit(name)
    return done


def check_graph(stages: Mapping[str, Upstream | None], specs: Mapping[str, Mapping[str, Any]],
                value_types: Mapping[str, str]) -> None:
    """Every pipeline's upstreams exist and can be read, and no pipeline reads itself through its upstreams."""
    edges = {name: (up.pipelines if up else ()) for name, up in stages.items()}
    cycle = graph_cycle(edges)
    if cycle:
        raise ValueError("pipelines read each other in a cycle: " + " -> ".join(cycle)
                         + " (each reads the panes of the next): a stage can only read pipelines upstream of it")
    for name, up in stages.items():
        for upstream in up.pipelines if up else ():
            if upstream not in specs:
                near = ", ".join(sorted(specs))
                raise ValueError(f"{name}: source.pipeline {upstream!r} is not a pipeline here (pipelines: {near})")
            check_upstream(name, upstream, specs[upstream], value_types[name])
