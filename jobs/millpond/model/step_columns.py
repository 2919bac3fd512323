"""The per-key step's firing on columns, for the windows of keys that have no stored window, and for the stored
windows of keys that have no new element.

A key with no stored window has only new windows: each starts from the same trigger state and accumulator,
takes the batch's elements, and is asked once whether it fires (``model.step.process_key``, steps 3 and 4). A key
with stored windows and no new element merges nothing: each of its windows is looked at if one of its timers is
due, and fires or is collected on its own. A first batch is all keys of the first kind, and a later one has many
of both (a session fires early, on time and is collected in later batches than the one that opened it).
``fire_new`` and ``fire_stored`` do that for all of them at once: accumulators by numpy's ``reduceat`` (or the
combiner's own ``add_all`` where the order of addition matters), triggers through ``model.trigger_columns``, and
each window's state as the JSON ``WindowState.to_json`` writes, built on columns. ``process_key`` stays the
reference (``tests/test_fast_paths.py``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.accumulation import Accumulation
from millpond.model.aggregations import Combiner, Count, Max, Mean, Min, Sum
from millpond.model.clock import BatchClock
from millpond.model.panes import Timing
from millpond.model.state import encode_json
from millpond.model.step import Strategy
from millpond.model.timeutil import MAX_TS
from millpond.model.trigger_columns import ColumnTrigger, Ctx, NodeColumns, column_trigger, join
from millpond.model.triggers import merge_states

_COMBINERS = (Sum, Count, Min, Max, Mean)
#: a closed window's trigger state (``process_key`` keeps only that it finished)
_CLOSED_TRIGGER = '{"0":{"done":true}}'


@dataclass(frozen=True)
class NewWindows:
    """``n`` new windows in the order ``process_key`` fires them (by key, then by window): bounds, the first
    element's arrival, how many elements they stand for (``count``: their weights), and their elements' values
    in the order they are added (``values[bounds[i]:bounds[i + 1]]`` for window ``i``)."""

    start: np.ndarray
    end: np.ndarray
    first_arrival: np.ndarray
    count: np.ndarray
    values: np.ndarray
    bounds: np.ndarray


@dataclass
class WindowColumns:
    """``n`` windows' state on columns, as ``WindowState`` holds it, with no retraction owed (``pend`` empty):
    accumulators (Python values) and their JSON, trigger state, pane index, the last value emitted (``has_last``,
    ``last``), whether the on-time pane was emitted, elements since the last firing, whether closed."""

    start: np.ndarray
    end: np.ndarray
    acc: list
    acc_json: pa.Array
    nodes: NodeColumns
    pane: np.ndarray
    has_last: np.ndarray
    last: list
    ontime: np.ndarray
    unfired: np.ndarray
    closed: np.ndarray

    def take(self, rows: np.ndarray) -> WindowColumns:
        """These windows only, in this order."""
        at = rows.tolist()
        return WindowColumns(self.start[rows], self.end[rows], [self.acc[i] for i in at],
                             self.acc_json.take(pa.array(rows, pa.int64())), self.nodes.take(rows), self.pane[rows],
                             self.has_last[rows], [self.last[i] for i in at], self.ontime[rows], self.unfired[rows],
                             self.closed[rows])


@dataclass(frozen=True)
class Fired:
    """What the step does with each window: whether it emitted, and then its value pane (``value``, ``pane_index``,
    ``timing``, ``is_last``), preceded by a retraction of ``retracted`` where ``retract``; whether its state row is
    an upsert (``state``'s JSON, its timers) or a delete (collected), or neither (left as stored)."""

    emitted: np.ndarray
    value: list
    pane_index: np.ndarray
    timing: np.ndarray
    is_last: np.ndarray
    retract: np.ndarray
    retracted: list
    upsert: np.ndarray
    delete: np.ndarray
    state: pa.Array
    event_timer: np.ndarray
    ptime_timer: np.ndarray
    has_ptime_timer: np.ndarray


def column_step(strategy: Strategy) -> ColumnTrigger | None:
    """The strategy's trigger on columns, or None where the firing cannot run on columns (a combiner or trigger
    node that is not a builtin)."""
    if type(strategy.combiner) not in _COMBINERS:
        return None
    cached = strategy.trigger.__dict__.get("_columns", False)
    if cached is False:
        cached = strategy.trigger.__dict__["_columns"] = column_trigger(strategy.trigger)
    return cached


def _float_json(v: float) -> str:
    """A float as ``json`` writes it."""
    if math.isfinite(v):
        return float.__repr__(v)
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def _json_of(values: list | np.ndarray) -> pa.Array:
    """JSON text of each value: an int, a float, None, or (a mean's accumulator) a list."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "i":
        return pc.cast(pa.array(values), pa.string())
    return pa.array([_one_json(v) for v in values], pa.string())


def _one_json(v: Any) -> str:
    if v is None:
        return "null"
    if type(v) is int:
        return str(v)
    if type(v) is float:
        return _float_json(v)
    return encode_json(v)


def _accumulators(comb: Combiner, w: NewWindows) -> tuple[list, pa.Array]:
    """Each new window's accumulator (what ``add_all`` from ``create`` gives) and its JSON."""
    n = len(w.start)
    starts = w.bounds[:-1]
    kind = type(comb)
    if kind is Count:
        acc = np.diff(w.bounds)
        return acc.tolist(), _json_of(acc)
    if w.values.dtype.kind == "i" and kind in (Sum, Min, Max, Mean):
        ufunc = {Sum: np.add, Mean: np.add, Min: np.minimum, Max: np.maximum}[kind]
        total = ufunc.reduceat(w.values, starts) if n else np.zeros(0, np.int64)
        if kind is not Mean:
            return total.tolist(), _json_of(total)
        counts = np.diff(w.bounds)
        acc_json = join(["[", _json_of(total), ",", _json_of(counts), "]"], n)
        return [list(p) for p in zip(total.tolist(), counts.tolist(), strict=True)], acc_json
    values = w.values.tolist()
    bounds = w.bounds.tolist()
    acc = [comb.add_all(comb.create(), values[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return acc, _json_of(acc)


def fire_new(strategy: Strategy, clock: BatchClock, w: NewWindows) -> Fired | None:
    """Steps 3 and 4 of ``process_key`` for new windows (none closed, none late: the caller's to ensure), or None
    where they cannot run on columns (``column_step``)."""
    trigger = column_step(strategy)
    if trigger is None:
        return None
    n = len(w.start)
    fresh = merge_states(strategy.trigger, [{}]) if strategy.window_fn.merging else {}
    if any(type(v) is not int for node in fresh.values() for v in node.values()):
        return None
    acc, acc_json = _accumulators(strategy.combiner, w)
    nodes = NodeColumns(n, fresh)
    # step 3: the elements reach each window's trigger at once (the first one's processing time)
    trigger.on_element(Ctx(w.end, clock.watermark, clock.processing_time, nodes), "0", np.ones(n, bool),
                       np.minimum(w.first_arrival, clock.processing_time), w.count)
    columns = WindowColumns(w.start, w.end, acc, acc_json, nodes, np.zeros(n, np.int64), np.zeros(n, bool),
                            [None] * n, np.zeros(n, bool), w.count.copy(), np.zeros(n, bool))
    return _fire(strategy, clock, trigger, columns, touched=True)


def stored_columns(start: np.ndarray, end: np.ndarray, texts: list[str]
                   ) -> tuple[WindowColumns | None, np.ndarray]:
    """Stored windows' states (``WindowState.to_json``'s JSON) on columns, and which of them can fire on columns:
    those that owe no retraction of a merged-away session and whose trigger state holds only counts, times and
    flags. The columns hold the windows that can (None if none can)."""
    docs = [json.loads(t) for t in texts]
    ok = np.array([not d["pend"] for d in docs], bool)
    trigs = [d["trig"] for d in docs]
    ok &= NodeColumns.holds(trigs)
    at = np.flatnonzero(ok)
    if not len(at):
        return None, ok
    docs = [docs[i] for i in at.tolist()]
    acc = [d["acc"] for d in docs]
    lasts = [d["last"] for d in docs]
    return WindowColumns(
        start[at], end[at], acc, _json_of(acc), NodeColumns.of([trigs[i] for i in at.tolist()]),
        np.array([d["pane"] for d in docs], np.int64), np.array([v is not None for v in lasts], bool),
        [None if v is None else v[0] for v in lasts], np.array([d["ontime"] for d in docs], bool),
        np.array([d["unfired"] for d in docs], np.int64), np.array([d["closed"] for d in docs], bool)), ok


def fire_stored(strategy: Strategy, clock: BatchClock, w: WindowColumns) -> Fired | None:
    """Step 4 of ``process_key`` for the stored windows of keys with no new element (``stored_columns``): each
    looked at if a timer is due, fired, collected or left; None where it cannot run on columns."""
    trigger = column_step(strategy)
    return None if trigger is None else _fire(strategy, clock, trigger, w, touched=False)


def _timers(trigger: ColumnTrigger, ctx: Ctx, gc: np.ndarray, closed: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``model.step.timers`` on columns: (event timer, processing-time timer, whether it has one)."""
    (armed, has_armed), (ptimer, has_ptimer) = trigger.timers(ctx, "0")
    return np.where(has_armed & ~closed, np.minimum(gc, armed), gc), ptimer, has_ptimer & ~closed


def _fire(strategy: Strategy, clock: BatchClock, trigger: ColumnTrigger, w: WindowColumns, touched: bool) -> Fired:
    """Step 4 of ``process_key`` on columns: each window fires once if touched (``touched``: every window, as a
    batch's new ones are; else none) or due, is collected once past its end and allowed lateness, and keeps its
    state if touched or fired."""
    comb, mode, lateness = strategy.combiner, strategy.mode, strategy.allowed_lateness
    watermark, ptime = clock.watermark, clock.processing_time
    n = len(w.start)
    ctx = Ctx(w.end, watermark, ptime, w.nodes)
    gc = np.minimum(w.end, MAX_TS - lateness) + lateness
    gc_due = gc <= watermark
    if touched:
        due = np.ones(n, bool)
    else:  # a window due for garbage collection has its event timer (never later than that) due too
        event_t, ptime_t, has_ptime_t = _timers(trigger, ctx, gc, w.closed)
        due = gc_due | (event_t <= watermark) | (has_ptime_t & (ptime_t <= ptime))
    looked = due & ~w.closed
    ready = looked & trigger.should_fire(ctx, "0")
    finished = ready & trigger.on_fire(ctx, "0", ready) if ready.any() else ready
    trigger.set_finished(ctx, "0", finished)
    emitted = ready | (looked & gc_due & (w.unfired > 0))
    is_last = np.where(ready, finished | gc_due, True)
    timing = np.where(watermark < w.end, Timing.EARLY.value,
                      np.where(w.ontime | (clock.input_watermark >= w.end), Timing.LATE.value,
                               Timing.ON_TIME.value)).astype(object)
    at = np.flatnonzero(emitted).tolist()
    value: list = [None] * n
    for i in at:
        value[i] = comb.extract(w.acc[i])
    retracting = mode is Accumulation.RETRACTING
    retract = emitted & w.has_last if retracting else np.zeros(n, bool)

    # the state kept: a window touched or fired, unless collected
    delete = gc_due
    upsert = ~gc_due & (ready | touched)
    keep = np.flatnonzero(upsert)
    k_emitted, k_closed = emitted[keep], (w.closed | finished)[keep]
    acc_kept = w.acc_json.take(pa.array(keep))
    if mode is Accumulation.DISCARDING:
        acc_kept = pc.if_else(pa.array(k_emitted), encode_json(comb.create()), acc_kept)
    acc_kept = pc.if_else(pa.array(k_closed), "null", acc_kept)
    if retracting:
        fired_last = join(["[", _json_of([value[i] for i in keep.tolist()]), "]"], len(keep))
        held_last = join(["[", _json_of([w.last[i] for i in keep.tolist()]), "]"], len(keep))
        last = pc.if_else(pa.array(k_closed), "null", pc.if_else(
            pa.array(k_emitted), fired_last, pc.if_else(pa.array(w.has_last[keep]), held_last, "null")))
    else:
        last = pc.if_else(pa.array(k_closed | ~w.has_last[keep]), "null",
                          join(["[", _json_of([w.last[i] for i in keep.tolist()]), "]"], len(keep)))
    ontime = pa.array((w.ontime | (emitted & (timing == Timing.ON_TIME.value)))[keep])
    trig = np.full(len(keep), _CLOSED_TRIGGER, object)
    trig[~k_closed] = w.nodes.to_json(keep[~k_closed]).to_numpy(zero_copy_only=False)
    state_kept = join([
        '{"acc":', acc_kept, ',"closed":', pc.if_else(pa.array(k_closed), "true", "false"), ',"last":', last,
        ',"ontime":', pc.if_else(ontime, "true", "false"), ',"pane":',
        pc.cast(pa.array((w.pane + emitted)[keep]), pa.string()), ',"pend":[],"trig":', pa.array(trig, pa.string()),
        ',"unfired":', pc.cast(pa.array(np.where(k_emitted, 0, w.unfired[keep])), pa.string()), "}"], len(keep))
    state = np.full(n, None, object)
    state[keep] = state_kept.to_numpy(zero_copy_only=False)
    event_timer, ptime_timer, has_ptime_timer = _timers(trigger, ctx, gc, w.closed | finished)
    return Fired(emitted, value, w.pane.copy(), timing, is_last, retract,
                 [w.last[i] if r else None for i, r in enumerate(retract.tolist())], upsert, delete,
                 pa.array(state, pa.string()), event_timer, ptime_timer, has_ptime_timer)
