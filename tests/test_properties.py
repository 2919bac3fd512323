"""Properties of the model, on random streams (Hypothesis): what must hold whatever the data and the batching.

- a retraction cancels exactly the pane it retracts (same key, window and value, not yet retracted);
- with only the watermark trigger, the final view does not depend on how the same arrivals are cut into
  batches, and equals a from-scratch computation;
- merged sessions' values equal the values of their elements.

The driver below is the per-key step as a batch runs it, with state round-tripped through its stored JSON,
but no lake: the model alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from millpond.model.clock import BatchClock
from millpond.model.panes import Pane
from millpond.model.spec import pipeline_from_dict
from millpond.model.state import WindowState
from millpond.model.step import Element, process_key
from millpond.model.timeutil import MIN_TS
from millpond.model.windows import Window

pytestmark = pytest.mark.unit

SEC = 1_000_000
BASE = 1_800_000_000 * SEC  # event times far above 0, aligned to every window size used here
GAP = 5 * 60 * SEC
END_OF_TIME = BASE + 10 * 86_400 * SEC  # a final watermark past every window and its lateness
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_batches(spec: dict[str, Any], batches: list[list[Element]], watermarks: list[int]) -> list[Pane]:
    """Every batch's panes, each batch processing every key it touches or holds state for."""
    strategy = pipeline_from_dict({"name": "prop", **spec}).strategy()
    state: dict[str, dict[Window, str]] = defaultdict(dict)
    panes: list[Pane] = []
    w_in = MIN_TS
    for b, (elements, watermark) in enumerate(zip(batches, watermarks, strict=True), 1):
        clock = BatchClock(batch=b, processing_time=BASE + b * 60 * SEC, input_watermark=w_in, watermark=watermark)
        by_key: dict[str, list[Element]] = defaultdict(list)
        for el in elements:
            by_key[el.key].append(el)
        for key in sorted(set(by_key) | set(state)):
            stored = [WindowState.from_json(w, text) for w, text in sorted(state[key].items())]
            result = process_key(key, stored, by_key.get(key, []), clock, strategy)
            assert not result.late, "these streams are never late"
            panes += result.panes
            for w in result.deletes:
                state[key].pop(w, None)
            for ws in result.upserts:  # a window may be merged away and re-created in one batch: the upsert wins
                state[key][ws.window] = ws.to_json()
        w_in = watermark
    return panes


def sessions_from_scratch(elements: list[Element], gap: int) -> dict[tuple[str, int, int], int]:
    """Sessions computed offline over all elements: each element's [t, t + gap) merged while they overlap."""
    out: dict[tuple[str, int, int], int] = {}
    by_key: dict[str, list[Element]] = defaultdict(list)
    for el in elements:
        by_key[el.key].append(el)
    for key, els in by_key.items():
        els.sort(key=lambda e: e.event_time)
        start, end, total = els[0].event_time, els[0].event_time + gap, 0
        for el in els:
            if el.event_time >= end:
                out[(key, start, end)] = total
                start, total = el.event_time, 0
            end = max(end, el.event_time + gap)
            total += el.value
        out[(key, start, end)] = total
    return out


def outstanding(panes: list[Pane]) -> dict[tuple[str, int, int], int]:
    """Replay the pane log as a downstream consumer of retractions would; fails if a retraction does not
    cancel exactly an emitted, not yet retracted value of its window."""
    live: dict[tuple[str, int, int], int] = {}
    for p in panes:
        window = (p.key, p.window_start, p.window_end)
        if p.kind == "retraction":
            assert window in live, f"retraction of {window} that holds no value"
            assert live.pop(window) == p.value, f"retraction of {window} does not match the value it retracts"
        else:
            assert window not in live, f"new value for {window} without retracting the previous one"
            live[window] = p.value
    return live


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[Element], list[int]]:
    """Elements (distinct ids, a few keys, an hour of event time) in a random arrival order, and cut points."""
    n = draw(st.integers(min_value=1, max_value=40))
    times = draw(st.lists(st.integers(min_value=0, max_value=3600), min_size=n, max_size=n))
    keys = draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n))
    values = draw(st.lists(st.integers(min_value=-50, max_value=100), min_size=n, max_size=n))
    elements = [Element(f"id{i}", k, v, BASE + t * SEC, BASE + 4000 * SEC + i)
                for i, (t, k, v) in enumerate(zip(times, keys, values, strict=True))]
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.lists(st.integers(min_value=1, max_value=max(1, n - 1)), max_size=6, unique=True)))
    return [elements[i] for i in order], [c for c in cuts if c < n]


def cut(arrivals: list[Element], cuts: list[int]) -> tuple[list[list[Element]], list[int]]:
    """Batches at the cut points; each batch's watermark is the earliest event time still to arrive (so no
    element is ever late), the last one past everything."""
    bounds = [0, *cuts, len(arrivals)]
    batches = [arrivals[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    watermarks = [min((e.event_time for e in arrivals[b:]), default=END_OF_TIME) for b in bounds[1:]]
    watermarks[-1] = END_OF_TIME
    return batches, [max(watermarks[: i + 1]) for i in range(len(watermarks))]


SESSIONS = {"window": {"type": "sessions", "gap": "5m"}, "aggregation": "sum", "allowed_lateness": "1d"}


@PROPERTY
@given(streams())
def test_a_retraction_cancels_exactly_the_pane_it_retracts(stream: tuple[list[Element], list[int]]) -> None:
    arrivals, cuts = stream
    spec = {**SESSIONS, "accumulation": "accumulating_and_retracting",
            "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))"}
    panes = run_batches(spec, *cut(arrivals, cuts))
    outstanding(panes)  # asserts every retraction against the log so far


@PROPERTY
@given(streams())
def test_merged_sessions_hold_exactly_their_elements(stream: tuple[list[Element], list[int]]) -> None:
    arrivals, cuts = stream
    spec = {**SESSIONS, "accumulation": "accumulating_and_retracting",
            "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))"}
    final = outstanding(run_batches(spec, *cut(arrivals, cuts)))
    assert final == sessions_from_scratch(arrivals, GAP)


@PROPERTY
@given(streams(), st.data())
def test_watermark_only_results_do_not_depend_on_batch_cuts(stream: tuple[list[Element], list[int]],
                                                            data: st.DataObject) -> None:
    arrivals, cuts = stream
    other = sorted(data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(arrivals) - 1)),
                                      max_size=6, unique=True)))
    spec = {**SESSIONS, "accumulation": "accumulating", "trigger": "AtWatermark()"}
    views = []
    for points in (cuts, [c for c in other if c < len(arrivals)], []):
        panes = run_batches(spec, *cut(arrivals, points))
        views.append({(p.key, p.window_start, p.window_end): p.value for p in panes if p.kind == "value"})
    assert views[0] == views[1] == views[2] == sessions_from_scratch(arrivals, GAP)
