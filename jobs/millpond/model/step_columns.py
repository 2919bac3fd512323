"""The per-key step's firing on columns, for the windows of keys that have no stored window.

Such a key's windows are new: each starts from the same trigger state and accumulator, takes the batch's
elements, and is asked once whether it fires (``model.step.process_key``, steps 3 and 4). A batch's first
batch is all such keys, and any batch has many. ``fire_new`` does that for all of them at once: accumulators by
numpy's ``reduceat`` (or the combiner's own ``add_all`` where the order of addition matters), triggers through
``model.trigger_columns``, and each window's stored state as the JSON ``WindowState.to_json`` writes, built on
columns. ``process_key`` stays the reference (``tests/test_fast_paths.py``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.accumulation import Accumulation
from millpond.model.aggregations import Count, Max, Mean, Min, Sum
from millpond.model.clock import BatchClock
from millpond.model.panes import Timing
from millpond.model.step import Strategy
from millpond.model.timeutil import MAX_TS
from millpond.model.trigger_columns import ColumnTrigger, Ctx, NodeColumns, column_trigger, join
from millpond.model.triggers import merge_states

_COMBINERS = (Sum, Count, Min, Max, Mean)


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


@dataclass(frozen=True)
class Fired:
    """What the step does with each new window: whether it emitted a pane (one value pane, index 0: a new window
    has nothing to retract) with its ``value``, ``timing`` and ``is_last``; whether it is due for garbage
    collection (then its state row is a delete), else its state's JSON and timers."""

    emitted: np.ndarray
    value: list
    timing: np.ndarray
    is_last: np.ndarray
    gc_due: np.ndarray
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
    """JSON text of each value: an int, a float, or None."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "i":
        return pc.cast(pa.array(values), pa.string())
    return pa.array([("null" if v is None else str(v) if isinstance(v, int) else _float_json(v)) for v in values],
                    pa.string())


def _accumulators(strategy: Strategy, w: NewWindows) -> tuple[list | np.ndarray, pa.Array, list | np.ndarray]:
    """Each window's accumulator (what ``add_all`` from ``create`` gives), its JSON, and the value it extracts."""
    comb, n = strategy.combiner, len(w.start)
    starts = w.bounds[:-1]
    kind = type(comb)
    ints = w.values.dtype.kind == "i"
    if kind is Count:
        acc = np.diff(w.bounds)
        return acc, _json_of(acc), acc
    if ints and kind in (Sum, Min, Max, Mean):
        ufunc = {Sum: np.add, Mean: np.add, Min: np.minimum, Max: np.maximum}[kind]
        total = ufunc.reduceat(w.values, starts) if n else np.zeros(0, np.int64)
        if kind is not Mean:
            return total, _json_of(total), total
        counts = np.diff(w.bounds)
        acc_json = join(["[", _json_of(total), ",", _json_of(counts), "]"], n)
        return list(zip(total.tolist(), counts.tolist(), strict=True)), acc_json, [
            s / c for s, c in zip(total.tolist(), counts.tolist(), strict=True)]
    values = w.values.tolist()
    bounds = w.bounds.tolist()
    acc = [comb.add_all(comb.create(), values[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    if kind is Mean:
        acc_json = pa.array([json.dumps(a, separators=(",", ":")) for a in acc], pa.string())
        return acc, acc_json, [comb.extract(a) for a in acc]
    return acc, _json_of(acc), acc


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
    comb, mode, lateness = strategy.combiner, strategy.mode, strategy.allowed_lateness
    watermark, ptime = clock.watermark, clock.processing_time
    acc, acc_json, value = _accumulators(strategy, w)

    # step 3: the elements reach each window's trigger at once (the first one's processing time)
    nodes = NodeColumns(n, fresh)
    ctx = Ctx(w.end, watermark, ptime, nodes)
    everywhere = np.ones(n, bool)
    trigger.on_element(ctx, "0", everywhere, np.minimum(w.first_arrival, ptime), w.count)
    # step 4: fire what is ready; a window due for garbage collection fires what it holds
    gc = np.minimum(w.end, MAX_TS - lateness) + lateness
    gc_due = gc <= watermark
    ready = trigger.should_fire(ctx, "0")
    finished = ready & trigger.on_fire(ctx, "0", ready) if ready.any() else ready
    trigger.set_finished(ctx, "0", finished)
    emitted = ready | gc_due  # a new window holds elements: a garbage-collection firing has something to emit
    is_last = np.where(ready, finished | gc_due, True)
    timing = np.where(watermark < w.end, Timing.EARLY.value,
                      np.where(clock.input_watermark >= w.end, Timing.LATE.value, Timing.ON_TIME.value)).astype(object)

    # the state each window keeps (those due for garbage collection are deleted)
    closed = finished
    keep = np.flatnonzero(~gc_due)
    k_emitted, k_closed = emitted[keep], closed[keep]
    acc_kept = acc_json.take(pa.array(keep))
    if mode is Accumulation.DISCARDING:
        acc_kept = pc.if_else(pa.array(k_emitted), json.dumps(comb.create(), separators=(",", ":")), acc_kept)
    acc_kept = pc.if_else(pa.array(k_closed), "null", acc_kept)
    if mode is Accumulation.RETRACTING:
        value_json = _json_of(np.asarray(value)[keep] if isinstance(value, np.ndarray) else [value[i] for i in keep])
        last = pc.if_else(pa.array(k_emitted & ~k_closed), join(["[", value_json, "]"], len(keep)), "null")
    else:
        last = "null"
    ontime = pa.array(k_emitted & (timing[keep] == Timing.ON_TIME.value))
    open_rows = keep[~k_closed]
    trig = np.full(len(keep), '{"0":{"done":true}}', object)
    trig[~k_closed] = nodes.to_json(open_rows).to_numpy(zero_copy_only=False)
    state_kept = join([
        '{"acc":', acc_kept, ',"closed":', pc.if_else(pa.array(k_closed), "true", "false"), ',"last":', last,
        ',"ontime":', pc.if_else(ontime, "true", "false"), ',"pane":', pc.if_else(pa.array(k_emitted), "1", "0"),
        ',"pend":[],"trig":', pa.array(trig, pa.string()), ',"unfired":',
        pc.cast(pa.array(np.where(k_emitted, 0, w.count[keep])), pa.string()), "}"], len(keep))
    state = np.full(n, None, object)
    state[keep] = state_kept.to_numpy(zero_copy_only=False)

    (armed, has_armed), (ptimer, has_ptimer) = trigger.timers(ctx, "0")
    event_timer = np.where(has_armed & ~closed, np.minimum(gc, armed), gc)
    return Fired(emitted, value if isinstance(value, list) else value.tolist(), timing, is_last, gc_due,
                 pa.array(state, pa.string()), event_timer, ptimer, has_ptimer & ~closed)
