"""The per-key step's shortcuts against the general code they stand in for, on random inputs.

Each shortcut (the copied trigger state of a new window, the sessions merge over plain ints, the
garbage-collection firing that skips the timer walk, windows formed on columns for keys without
stored windows) must give exactly the rows the general code gives: same panes, same state JSON, same
deletes and late rows, batch after batch."""

from __future__ import annotations

import json
import random
from typing import Any

import pyarrow as pa
import pytest
from millpond.config import load_settings
from millpond.model import step as engine
from millpond.model import triggers
from millpond.model.spec import pipeline_from_dict
from millpond.model.state import WINDOWS_SCHEMA, WindowState
from millpond.model.step import BatchClock, Element, gc_time, timers
from millpond.model.timeutil import MAX_TS, to_us
from millpond.model.triggers import merge_states, parse_trigger
from millpond.model.windows import Sessions, Window
from millpond.runtime import layout
from millpond.runtime.assembly import Assembly, key_rows, strategy_of
from millpond.runtime.engines.local import KeysOnCores
from millpond.runtime.engines.spark_lift import lifted_id
from millpond.runtime.layout import EVENT_COLUMNS, WEIGHT

MIN = 60_000_000

TRIGGERS = [
    "AtWatermark(early=AfterDelay('1m'), late=AtCount(1))",
    "AtWatermark(early=AtPeriod('1m'), late=AtCount(1))",
    "AtWatermark(early=AtCount(2))",
    "AtWatermark(late=AtPeriod('2m'))",
    "AtWatermark()",
    "Repeat(AtWatermark())",
    "Repeat(AtCount(3))",
    "AtCount(2)",
    "Repeat(AllOf(AtCount(2), AfterDelay('1m')))",
    "FirstOf(AtCount(4), AtWatermark())",
    "SequenceOf(AtCount(1), AtCount(2), Repeat(AtPeriod('1m')))",
    "RepeatUntil(AtCount(2), AtWatermark())",
]
WINDOWS: list[dict[str, Any]] = [
    {"type": "sessions", "gap": "5m"},
    {"type": "sessions", "gap": "1m"},
    {"type": "fixed", "size": "2m"},
    {"type": "sliding", "size": "3m", "period": "1m"},
    {"type": "global"},
]
MODES = ["discarding", "accumulating", "accumulating_and_retracting"]
AGGREGATIONS = ["sum", "count", "min", "max", "mean"]


def _reference_sessions_merge(self: Sessions, windows: list[Window]) -> list[tuple[Window, list[Window]]]:
    """Sessions.merge as first written: spans grown with ``Window.span``."""
    spans: list[Window] = []
    members: list[list[Window]] = []
    for w in sorted(set(windows)):
        if spans and spans[-1].intersects(w):
            spans[-1] = spans[-1].span(w)
            members[-1].append(w)
        else:
            spans.append(w)
            members.append([w])
    return list(zip(spans, members, strict=True))


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch the shortcuts off: every merged trigger state is merged node by node, sessions merge
    through ``Window.span``, and every stored window's timers are walked."""
    monkeypatch.setattr(triggers, "_fresh_state", lambda trigger: None)
    monkeypatch.setattr(Sessions, "merge", _reference_sessions_merge)
    monkeypatch.setattr(engine, "timer_due", _timer_due_walked)
    for cls in vars(triggers).values():  # each timer on a walk of its own
        if isinstance(cls, type) and "timers" in vars(cls):
            monkeypatch.setattr(cls, "timers", _timers_walked_apart)


def _timers_walked_apart(self: triggers.Trigger, ctx: triggers.TriggerContext, path: str
                         ) -> tuple[int | None, int | None]:
    """``Trigger.timers`` as the two walks it fuses."""
    return self.event_timer(ctx, path), self.ptime_timer(ctx, path)


def _timer_due_walked(ws: WindowState, strategy: engine.Strategy, clock: BatchClock) -> bool:
    event_t, ptime_t = timers(ws, strategy, clock)
    return event_t <= clock.watermark or (ptime_t is not None and ptime_t <= clock.processing_time)


def _spec(rng: random.Random) -> str:
    doc = {
        "name": "fast_paths", "source": {"prefix": "fast_paths/"}, "value_type": "int",
        "window": rng.choice(WINDOWS), "trigger": rng.choice(TRIGGERS), "accumulation": rng.choice(MODES),
        "aggregation": rng.choice(AGGREGATIONS), "allowed_lateness": rng.choice(["0s", "3m", "1h"]),
        "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "2m"},
    }
    return json.dumps(doc, sort_keys=True)


def _scenario(seed: int) -> tuple[str, list[tuple[BatchClock, dict[str, list[Element]]]]]:
    """A pipeline and its batches: a few keys, elements on time, early and late, then a flush."""
    rng = random.Random(seed)
    spec = _spec(rng)
    t0 = 1_780_000_000_000_000
    batches = []
    watermark = t0 - 10 * MIN
    n = 0
    for b in range(1, rng.randint(3, 8)):
        ptime = t0 + b * MIN
        input_watermark = watermark
        watermark = max(watermark, ptime - rng.choice([0, 1, 2, 4]) * MIN)
        by_key: dict[str, list[Element]] = {}
        for _ in range(rng.randint(0, 25)):
            key = rng.choice("abcd")
            event = ptime - rng.randint(-2, 24) * MIN // 2  # on a grid: sessions that touch, equal times
            arrival = ptime - rng.randint(0, 3) * MIN // 4
            by_key.setdefault(key, []).append(Element(f"e{n}", key, rng.randint(-5, 50), event, arrival))
            n += 1
        batches.append((BatchClock(b, ptime, input_watermark, watermark), by_key))
    last = batches[-1][0]
    batches.append((BatchClock(last.batch + 1, last.processing_time + MIN, last.watermark, MAX_TS), {}))
    return spec, batches


def _run(spec: str, batches: list[tuple[BatchClock, dict[str, list[Element]]]]) -> list[list[tuple]]:
    """Every batch's rows, the stored state carried over as the ``windows`` table would carry it."""
    stored: dict[str, dict[tuple[int, int], str]] = {}
    out = []
    for clock, by_key in batches:
        rows: list[tuple] = []
        for key in sorted(set(by_key) | set(stored)):
            state_rows = [(s, e, st) for (s, e), st in sorted(stored.get(key, {}).items())]
            rows += key_rows(spec, clock, key, by_key.get(key, []), state_rows)
        for rtype, key, p in rows:
            if rtype == "delete":
                stored.get(key, {}).pop((p[0], p[1]), None)
        for rtype, key, p in rows:
            if rtype == "state":
                stored.setdefault(key, {})[(p[0], p[1])] = p[2]
        out.append(rows)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_shortcuts_match_the_general_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, batches = _scenario(seed)
    fast = _run(spec, batches)
    strategy_of.cache_clear()
    with monkeypatch.context() as m:
        _general(m)
        general = _run(spec, batches)
    strategy_of.cache_clear()
    assert fast == general
    assert any(rows for rows in fast)


@pytest.mark.parametrize("text", TRIGGERS)
def test_fresh_trigger_state_is_the_merge_of_empty_states(text: str) -> None:
    trigger = parse_trigger(text)
    for states in ([], [{}], [{}, {}]):
        general = {p: out for p, node in trigger.walk() if (out := node.merge_node([s.get(p, {}) for s in states]))}
        first = merge_states(trigger, states)
        assert first == general
        for node in first.values():  # a copy: one window's trigger state never leaks into the next
            node["x"] = 1
        assert merge_states(trigger, states) == general


def test_sessions_merge_matches_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    fn = Sessions("5m")
    for _ in range(500):
        windows = []
        for _ in range(rng.randint(0, 30)):
            start = rng.randint(0, 40) * MIN // 2
            windows.append(Window(start, start + rng.choice([1, 5, 10]) * MIN))
        assert fn.merge(windows) == _reference_sessions_merge(fn, windows)


def test_event_timer_never_after_garbage_collection() -> None:
    """Why a window due for garbage collection needs no timer walk: its event timer is due too."""
    rng = random.Random(5)
    for text in TRIGGERS:
        trigger = parse_trigger(text)
        strategy = engine.Strategy(Sessions("5m"), trigger, None, None, rng.choice([0, 3 * MIN]))  # type: ignore[arg-type]
        for _ in range(50):
            start = rng.randint(0, 100) * MIN
            ws = WindowState(Window(start, start + 5 * MIN), 0, merge_states(trigger, [{}]))
            clock = BatchClock(1, start + rng.randint(0, 20) * MIN, start, start + rng.randint(0, 20) * MIN)
            ctx = triggers.TriggerContext(ws.window, clock.watermark, clock.processing_time, ws.trigger)
            trigger.on_element(ctx, "0", clock.processing_time, rng.randint(1, 3))
            ws.closed = rng.random() < 0.2
            assert timers(ws, strategy, clock)[0] <= gc_time(ws.window, strategy.allowed_lateness)


def test_one_walk_gives_both_timers() -> None:
    """``Trigger.timers`` (one walk) equals ``event_timer`` and ``ptime_timer`` (a walk each), on states that
    elements, firings and merges leave behind."""
    rng = random.Random(9)
    for text in TRIGGERS:
        trigger = parse_trigger(text)
        for _ in range(200):
            start = rng.randint(0, 100) * MIN
            window = Window(start, start + 5 * MIN)
            states = []
            for _ in range(rng.randint(1, 3)):
                ctx = triggers.TriggerContext(window, start + rng.randint(0, 10) * MIN,
                                              start + rng.randint(0, 10) * MIN, merge_states(trigger, [{}]))
                for _ in range(rng.randint(0, 3)):
                    trigger.on_element(ctx, "0", ctx.ptime - rng.randint(0, 3) * MIN, rng.randint(1, 3))
                    if trigger.should_fire(ctx, "0") and trigger.on_fire(ctx, "0"):
                        trigger.set_finished(ctx, "0")
                states.append(ctx.state)
            ctx = triggers.TriggerContext(window, start + rng.randint(0, 10) * MIN, start + rng.randint(0, 10) * MIN,
                                          merge_states(trigger, states))
            assert trigger.timers(ctx, "0") == (trigger.event_timer(ctx, "0"), trigger.ptime_timer(ctx, "0")), text


def _run_tables(spec: str, batches: list[tuple[BatchClock, dict[str, list[Element]]]], columnar: bool,
                lift: bool = False) -> list[dict[str, list]]:
    """Every batch through the local engine (no forks), windows formed on columns or not, the ``windows`` rows
    carried over as the table carries them: each batch's output tables as rows. ``lift``: each batch's elements
    are lifted first (``_lifted``, as ``runtime.engines.spark_lift`` lifts them), the closed stored windows'
    one by one."""
    pipeline = pipeline_from_dict(json.loads(spec))
    value = pa.float64() if pipeline.value_type == "float" else pa.int64()
    types = {"id": pa.string(), "key": pa.string(), "value": value}
    schema = pa.schema([(c, types.get(c, pa.int64())) for c in (*EVENT_COLUMNS, *([WEIGHT] if lift else []))])
    stored: dict[tuple[str, int, int], dict[str, Any]] = {}
    engine = KeysOnCores(load_settings(env={}).with_overrides(driver_workers=0, columnar_windows=columnar))
    out = []
    for clock, by_key in batches:
        if lift:
            closed = {(k, to_us(start)) for (k, start, _end), row in stored.items()
                      if json.loads(row["state"])["closed"]}
            by_key = _lifted(spec, clock, by_key, closed)
        events = pa.Table.from_pylist([el._asdict() for els in by_key.values() for el in els], schema=schema)
        state = pa.Table.from_pylist(sorted(stored.values(), key=lambda r: (r["key"], r["window_start"])),
                                     schema=WINDOWS_SCHEMA)
        sink = Assembly(clock.batch, clock, pipeline.value_type, pipeline.pane_value_type,
                        pipeline.mode.value == "discarding")
        engine.run(spec, clock, events, state, sink)
        sink.finish()
        for row in sink.state.to_pylist():
            at = (row["key"], row["window_start"], row["window_end"])
            if row["deleted"]:
                stored.pop(at, None)
            else:
                stored[at] = row
        out.append({name: getattr(sink, name).to_pylist() for name in ("panes", "state", "late", "current")})
    return out


@pytest.mark.parametrize("seed", range(60))
def test_windows_formed_on_columns_match_the_element_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys without stored windows (every key of a first batch, a key back after its sessions were
    collected) get their windows assigned, merged and grouped on columns; a key with a late element or
    stored windows, and every key of a sliding or global pipeline, keeps the element path."""
    spec, batches = _scenario(seed)
    formed: list[int] = []
    real = layout.form_windows

    def counted(*args: Any) -> Any:
        got = real(*args)
        formed.append(0 if got is None else int(got[1].sum()))
        return got

    monkeypatch.setattr(layout, "form_windows", counted)
    columnar = _run_tables(spec, batches, columnar=True)
    reference = _run_tables(spec, batches, columnar=False)
    assert columnar == reference
    assert any(b["panes"] or b["late"] for b in reference)
    window = json.loads(spec)["window"]["type"]
    assert (sum(formed) > 0) == (window in ("sessions", "fixed")), formed


def test_windows_formed_on_columns_cover_many_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A larger first batch and a second one (hundreds of keys, late elements, ties in arrival and event
    time, float sums that depend on the order values are added in): the same tables with and without
    the columnar path, for sessions and fixed windows."""
    rng = random.Random(17)
    t0 = 1_780_000_000_000_000
    for window in ({"type": "sessions", "gap": "2m"}, {"type": "fixed", "size": "1m", "offset": "10s"}):
        doc = {"name": "fast_paths", "source": {"prefix": "fast_paths/"}, "value_type": "float", "window": window,
               "trigger": "AtWatermark(early=AfterDelay('1m'), late=AtCount(1))",
               "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "5m",
               "batch_interval": "5m", "watermark": {"policy": "processing_time", "lag": "2m"}}
        spec = json.dumps(doc, sort_keys=True)
        batches = []
        watermark = t0
        for b in (1, 2):
            ptime = t0 + 5 * b * MIN
            clock = BatchClock(b, ptime, watermark, ptime - 2 * MIN)
            watermark = clock.watermark
            by_key: dict[str, list[Element]] = {}
            for n in range(3000):
                key = f"k{min(int(rng.paretovariate(1.0)), 400):03d}"
                event = ptime - rng.randint(0, 40) * MIN // 4
                if key.endswith(("1", "3")) and rng.random() < 0.05:  # late: these keys keep the element path
                    event -= 15 * MIN
                value = rng.choice([1e16, -1e16, 1.0, 3.0])  # a sum that depends on the order of addition
                el = Element(f"b{b}e{n}", key, value, event, ptime - rng.randint(0, 4) * MIN)
                by_key.setdefault(key, []).append(el)
            batches.append((clock, by_key))
        columnar = _run_tables(spec, batches, columnar=True)
        assert columnar == _run_tables(spec, batches, columnar=False)
        assert columnar[0]["late"] and columnar[1]["panes"]


def _lifted(spec: str, clock: BatchClock, by_key: dict[str, list[Element]],
            closed: set[tuple[str, int]] = frozenset()) -> dict[str, list[Element]]:
    """``spark_lift.lifted`` in Python: each key's on-time elements of one window as one element (the window's
    id, ``spark_lift.lifted_id``; their smallest event time and arrival; the aggregate of their values; how many
    they were), the late ones and those of a ``closed`` stored window ((key, start)) as they are."""
    strategy = strategy_of(spec)
    how = engine.lifts(strategy.window_fn, strategy.combiner, pipeline_from_dict(json.loads(spec)).value_type)
    assert how is not None
    agg = {"sum": sum, "min": min, "max": max}[how]
    late_end = clock.input_watermark - strategy.allowed_lateness
    out: dict[str, list[Element]] = {}
    for key, els in by_key.items():
        windows: dict[Window, list[Element]] = {}
        for el in els:
            (w,) = strategy.window_fn.assign(el.event_time)
            if w.end <= late_end or (key, w.start) in closed:
                out.setdefault(key, []).append(el)
            else:
                windows.setdefault(w, []).append(el)
        for w, group in windows.items():
            out.setdefault(key, []).append(Element(
                lifted_id(w.start), key, agg(e.value for e in group), min(e.event_time for e in group),
                min(e.arrival_time for e in group), len(group)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_lifted_windows_match_their_elements(seed: int) -> None:
    """Combiner lifting (``model.step.lifts``, ``runtime.engines.spark_lift``): batches whose on-time elements of
    each window come as one element, weighted by how many they were, give the tables their elements give one by
    one (triggers that count, fire early, late or repeatedly; stored windows open and closed; late elements
    beside), on columns or on the element path."""
    spec, batches = _scenario(seed)
    rng = random.Random(seed)
    doc = {**json.loads(spec), "window": {"type": "fixed", "size": rng.choice(["2m", "5m"]),
                                          "offset": rng.choice(["0s", "30s"])},
           "aggregation": rng.choice(["sum", "min", "max"])}
    spec = json.dumps(doc, sort_keys=True)
    reference = _run_tables(spec, batches, columnar=False)
    assert any(b["panes"] for b in reference)
    for columnar in (True, False):
        assert _run_tables(spec, batches, columnar=columnar, lift=True) == reference, columnar
    lifted = _lifted(spec, batches[0][0], batches[0][1])
    assert sum(map(len, lifted.values())) <= sum(map(len, batches[0][1].values()))


def test_only_exact_combiners_over_one_window_lift() -> None:
    """Lifting changes no table only where combining first is exact: fixed windows, integer sum, min, max."""
    def lifts(window: dict, aggregation: str, value_type: str = "int") -> str | None:
        s = strategy_of(json.dumps({"name": "l", "source": {"prefix": "l/"}, "window": window,
                                    "aggregation": aggregation, "value_type": value_type}, sort_keys=True))
        return engine.lifts(s.window_fn, s.combiner, value_type)

    fixed = {"type": "fixed", "size": "1h"}
    assert [lifts(fixed, a) for a in ("sum", "min", "max")] == ["sum", "min", "max"]
    assert lifts(fixed, "count") is None and lifts(fixed, "mean") is None  # a count of counts, a mean of means
    assert lifts(fixed, "sum", "float") is None  # a float sum depends on the order of addition
    assert lifts({"type": "sessions", "gap": "5m"}, "sum") is None  # windows merge per element
    assert lifts({"type": "sliding", "size": "3m", "period": "1m"}, "sum") is None  # one element, many windows


#: composites whose children are composites too (what finishes, what resets, under which parent)
NESTED_TRIGGERS = [
    "AllOf(Repeat(AtCount(2)), AtWatermark())",
    "Repeat(AllOf(Repeat(AtCount(2)), AfterDelay('1m')))",
    "FirstOf(Repeat(AtPeriod('1m')), SequenceOf(AtCount(2), AtCount(3)))",
    "AtWatermark(early=FirstOf(AtCount(3), AfterDelay('30s')), late=AllOf(AtCount(1), AtPeriod('1m')))",
    "SequenceOf(AllOf(AtCount(1), AtWatermark()), Repeat(FirstOf(AtCount(2), AtPeriod('2m'))))",
]


def _many_new_keys(seed: int) -> tuple[str, list[tuple[BatchClock, dict[str, list[Element]]]]]:
    """A pipeline and batches of many keys, most of them new in their batch (no stored window): windows that
    fire early, on time and late, that count up to a trigger's threshold or not, that are due for garbage
    collection in the batch that opens them; integer and float values; then a flush."""
    rng = random.Random(1000 + seed)
    doc = json.loads(_spec(rng))
    doc["trigger"] = rng.choice(TRIGGERS + NESTED_TRIGGERS)
    doc["window"] = rng.choice([{"type": "sessions", "gap": "5m"}, {"type": "sessions", "gap": "1m"},
                                {"type": "fixed", "size": "2m"}, {"type": "fixed", "size": "1m", "offset": "10s"}])
    doc["value_type"] = rng.choice(["int", "float"])
    spec = json.dumps(doc, sort_keys=True)
    t0 = 1_780_000_000_000_000
    watermark = t0 - 10 * MIN
    batches = []
    n = 0
    for b in range(1, rng.randint(3, 5)):
        ptime = t0 + b * MIN
        input_watermark = watermark
        watermark = max(watermark, ptime - rng.choice([0, 1, 2, 4, 8]) * MIN)
        by_key: dict[str, list[Element]] = {}
        keys = [f"b{b}k{i:03d}" for i in range(rng.randint(40, 160))] + [f"old{i}" for i in range(rng.randint(0, 8))]
        for key in keys:
            for _ in range(rng.randint(1, 6)):
                event = ptime - rng.randint(-2, 30) * MIN // 2
                arrival = ptime - rng.randint(0, 6) * MIN // 4
                value: Any = (rng.randint(-5, 50) if doc["value_type"] == "int"
                              else rng.choice([0.1, 2.5, 1e16, -1e16, 3.0]))
                by_key.setdefault(key, []).append(Element(f"e{n}", key, value, event, arrival))
                n += 1
        batches.append((BatchClock(b, ptime, input_watermark, watermark), by_key))
    last = batches[-1][0]
    batches.append((BatchClock(last.batch + 1, last.processing_time + MIN, last.watermark, MAX_TS), {}))
    return spec, batches


@pytest.mark.parametrize("seed", range(80))
def test_new_windows_fired_on_columns_match_the_element_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's new windows, and the stored windows of a key without new elements, fire on columns
    (``model.step_columns``: accumulators, every builtin trigger through ``model.trigger_columns``, state read and
    written as JSON on columns): the same panes (retractions too), state rows (JSON byte for byte, timers),
    deletes and current rows as ``process_key`` gives them one by one, batch after batch."""
    spec, batches = _many_new_keys(seed)
    fired: dict[str, list[int]] = {"fire_new": [], "fire_stored": []}

    def counted(name: str) -> Any:
        real = getattr(layout, name)

        def count(*args: Any) -> Any:
            got = real(*args)
            fired[name].append(0 if got is None else int(got.emitted.sum() + got.upsert.sum() + got.delete.sum()))
            return got
        return count

    for name in fired:
        monkeypatch.setattr(layout, name, counted(name))
    columnar = _run_tables(spec, batches, columnar=True)
    reference = _run_tables(spec, batches, columnar=False)
    assert columnar == reference
    assert sum(fired["fire_new"]) > 0 and sum(fired["fire_stored"]) > 0, fired
    assert any(b["panes"] for b in reference)
