"""One key's share of a micro-batch: GroupByKeyAndWindow with triggers (paper, Figure 4).

``process_key`` is a pure function of (stored windows of the key, the batch's new elements of the
key, the batch's clock). Spark runs it per key (``microbatch``); the same function runs in the
driver for tiny batches, so both paths give identical tables.

Per key, in order: drop late elements (window end + allowed lateness at or behind the input
watermark), assign windows, merge (sessions; one late event can bridge two stored sessions), add
elements to accumulators and triggers, then ask each touched or due window once whether it fires,
emit panes in the accumulation mode, and garbage-collect windows past end + allowed lateness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, NamedTuple

from millpond.model.accumulation import Accumulation, emit
from millpond.model.aggregations import Combiner, Max, Min, Sum
from millpond.model.clock import BatchClock
from millpond.model.panes import Pane
from millpond.model.state import WindowState
from millpond.model.timeutil import MAX_TS
from millpond.model.triggers import Trigger, TriggerContext, merge_states
from millpond.model.windows import FixedWindows, Window, WindowFn


class Element(NamedTuple):
    """One input element (a tuple: a batch builds one per event, which a frozen dataclass makes slow).
    ``weight``: how many events it stands for: more than one for a lifted element, the combined value of a
    window's on-time events (``lifts``), which counts as that many elements for the triggers."""

    id: str
    key: str
    value: Any
    event_time: int
    arrival_time: int
    weight: int = 1


class WindowGroup(NamedTuple):
    """A window's share of a batch, formed on columns for a key with no stored windows: the values in
    the order the element path would add them (arrival, event time, id), the first one's arrival and how many
    elements they stand for (their weights: more than ``len(values)`` where some were lifted)."""

    window: Window
    values: list[Any]
    first_arrival: int
    count: int


def lifts(window_fn: WindowFn, combiner: Combiner, value_type: str) -> str | None:
    """The aggregate (``sum``, ``min`` or ``max``) that may combine a batch's on-time elements of one window
    into one element before the per-key step (combiner lifting, as Beam's and Spark's partial aggregation),
    or None. Only where the result cannot differ from adding them one by one: each element in exactly one
    window (fixed windows), an exact combiner over integers (sum, min, max), and the caller's to check that the
    window is not closed (each of its elements is a "window closed" row) and that no running sum can overflow,
    from its stored accumulator on (a checked sum drops the one element that would)."""
    if type(window_fn) is not FixedWindows or value_type != "int":
        return None
    return {Sum: "sum", Min: "min", Max: "max"}.get(type(combiner))


@dataclass(frozen=True)
class Strategy:
    """The what / where / when / how of a pipeline, ready to execute."""

    window_fn: WindowFn
    trigger: Trigger
    mode: Accumulation
    combiner: Combiner
    allowed_lateness: int


@dataclass
class KeyResult:
    panes: list[Pane] = field(default_factory=list)
    #: windows to upsert into state
    upserts: list[WindowState] = field(default_factory=list)
    #: windows to delete from state (garbage-collected or merged away)
    deletes: list[Window] = field(default_factory=list)
    #: windows merged away holding an emitted value that no retraction will take back (modes without
    #: retractions): removed from the current view at once
    merged_away: list[Window] = field(default_factory=list)
    #: (element, reason) dropped as late, for a closed window, or because its window's sum would overflow
    late: list[tuple[Element, str]] = field(default_factory=list)


def gc_time(window: Window, lateness: int) -> int:
    return MAX_TS if window.end >= MAX_TS - lateness else window.end + lateness


def timers(ws: WindowState, strategy: Strategy, clock: BatchClock) -> tuple[int, int | None]:
    """(event-time timer, processing-time timer) of a stored window: when it next needs a look."""
    gc = gc_time(ws.window, strategy.allowed_lateness)
    if ws.closed:
        return gc, None
    armed, ptime = strategy.trigger.timers(TriggerContext(ws.window, clock.watermark, clock.processing_time,
                                                          ws.trigger), "0")
    return (min(gc, armed) if armed is not None else gc), ptime


def timer_due(ws: WindowState, strategy: Strategy, clock: BatchClock) -> bool:
    """Whether one of a stored window's timers is due in this batch (asked only of untouched windows)."""
    event_t, ptime_t = timers(ws, strategy, clock)
    return (event_t is not None and event_t <= clock.watermark) or (
        ptime_t is not None and ptime_t <= clock.processing_time
    )


#: why the per-key step drops an element a checked sum cannot take (``Combiner.add_checked``)
SUM_OUT_OF_RANGE = "sum out of range: adding the value would overflow its window's sum"
#: the order a batch's elements are applied in (arrival, then event time, then id)
_ARRIVAL_ORDER = attrgetter("arrival_time", "event_time", "id")


def process_key(
    key: str,
    stored: list[WindowState],
    elements: list[Element],
    clock: BatchClock,
    strategy: Strategy,
    groups: Sequence[WindowGroup] | None = None,
) -> KeyResult:
    """``groups`` stands in for ``elements`` for a key without stored windows none of whose elements is
    late: its windows already assigned and merged on columns (``WindowFn.assign_columns`` and
    ``merge_columns``), so steps 1-3 make no object per element."""
    result = KeyResult()
    comb, trig = strategy.combiner, strategy.trigger
    live: dict[Window, WindowState] = {ws.window: ws for ws in stored}
    touched: set[Window] = set()
    seq = 0

    def make(k, start, end, value, index, timing, is_last, kind) -> Pane:
        nonlocal seq
        seq += 1
        return Pane(k, start, end, value, index, str(timing), is_last, str(kind), clock.batch,
                    clock.processing_time, clock.watermark, seq)

    lateness = strategy.allowed_lateness
    ptime, watermark = clock.processing_time, clock.watermark
    if groups is not None:
        _add_groups(groups, live, touched, strategy, ptime, watermark)
    else:
        _add_elements(elements, live, touched, result, clock, strategy)

    # 4. Fire what is due, once per window; garbage-collect what can no longer fire.
    mode = strategy.mode
    for w in sorted(live):
        ws = live[w]
        gc_due = gc_time(w, lateness) <= watermark
        # A window due for garbage collection has its event timer (never later than that) due too.
        due = w in touched or gc_due or timer_due(ws, strategy, clock)
        fired = False
        if not ws.closed and due:
            ctx = TriggerContext(w, watermark, ptime, ws.trigger)
            if trig.should_fire(ctx, "0"):
                fired = True
                finished = trig.on_fire(ctx, "0")
                if finished:
                    trig.set_finished(ctx, "0")
                    ws.closed = True
                result.panes += emit(ws, mode, comb, key=key, clock=clock, is_last=finished or gc_due, make=make)
            elif gc_due and ws.unfired > 0:
                fired = True
                result.panes += emit(ws, mode, comb, key=key, clock=clock, is_last=True, make=make)
        if gc_due:
            result.deletes.append(w)
        elif w in touched or fired:
            if ws.closed:
                ws.acc, ws.trigger, ws.last, ws.pending = None, {"0": {"done": True}}, None, []
            result.upserts.append(ws)
    return result


def _add_elements(elements: list[Element], live: dict[Window, WindowState], touched: set[Window],
                  result: KeyResult, clock: BatchClock, strategy: Strategy) -> None:
    """Steps 1-3 for a batch's elements of one key: assign, drop the late, merge, accumulate."""
    # 1. Assign windows; drop what is too late or belongs to a closed window.
    assigned: list[tuple[Element, Window]] = []
    closed_windows = [w for w, ws in live.items() if ws.closed]
    comb, trig, wfn = strategy.combiner, strategy.trigger, strategy.window_fn
    assign, lateness, input_watermark = wfn.assign, strategy.allowed_lateness, clock.input_watermark
    # gc_time(w) <= input watermark, inlined (it runs once per element and window)
    forever, late_end = MAX_TS - lateness, input_watermark - lateness
    for el in sorted(elements, key=_ARRIVAL_ORDER):
        for w in assign(el.event_time):
            if (w[1] <= late_end) if w[1] < forever else (MAX_TS <= input_watermark):
                result.late.append((el, "beyond allowed lateness"))
                continue
            if not closed_windows:
                closed = False
            elif wfn.merging:
                closed = any(c.intersects(w) for c in closed_windows)
            else:
                closed = w in live and live[w].closed
            if closed:
                result.late.append((el, "window closed"))
                continue
            assigned.append((el, w))

    # 2. Merge windows (sessions): stored live windows and the new elements' windows.
    if wfn.merging and assigned:
        open_windows = [w for w, ws in live.items() if not ws.closed]
        groups = wfn.merge(open_windows + [w for _, w in assigned])
        if comb.checked and len(open_windows) > 1:
            assigned, groups = _keep_sums_in_range(assigned, groups, open_windows, live, strategy, result)
        target: dict[Window, Window] = {}
        for merged, members in groups:
            for m in members:
                target[m] = merged
            stored_members = sorted({m for m in members if m in live}) if live else []
            if merged in live and stored_members == [merged]:
                continue  # unchanged window
            states = [live[m] for m in stored_members]
            fresh = len(set(members)) > len(stored_members)
            trig_states = [s.trigger for s in states] + ([{}] if fresh else [])
            new = WindowState(
                window=merged,
                acc=comb.merge([s.acc for s in states]) if states else comb.create(),
                trigger=merge_states(trig, trig_states),
                on_time_emitted=any(s.on_time_emitted for s in states),
                unfired=sum(s.unfired for s in states),
            )
            for s in states:
                new.pending.extend(s.pending)
                if s.window == merged:  # the session kept its bounds: keep its pane history
                    new.pane_index, new.last = s.pane_index, s.last
                    continue
                if s.last is not None:
                    # Its retraction is owed (emitted when the merged session fires): until then its value is
                    # what consumers were told, so the current view keeps it (``runtime.assembly``).
                    new.pending.append([s.window.start, s.window.end, s.last[0], s.pane_index - 1])
                elif s.pane_index > 0:
                    result.merged_away.append(s.window)
                del live[s.window]
                result.deletes.append(s.window)
            live[merged] = new
            touched.add(merged)
    else:
        target = None

    # 3. Each window's elements, in arrival order (windows in the order their first element came).
    by_window: dict[Window, list[Element]] = {}
    for el, w in assigned:
        if target is not None:
            w = target[w]
        got = by_window.get(w)
        if got is None:
            by_window[w] = [el]
        else:
            got.append(el)
    # Add them to the accumulator, then to the trigger once (the first element's processing time).
    ptime, watermark = clock.processing_time, clock.watermark
    for w, els in by_window.items():
        ws = live.get(w)
        if ws is None:
            ws = live[w] = WindowState(window=w, acc=comb.create())
        ws.acc, skipped = comb.add_checked(ws.acc, [el.value for el in els])
        if skipped:
            els = _drop_skipped(els, skipped, result)
            if not els:
                continue
        n = sum(el.weight for el in els)
        ws.unfired += n
        ctx = TriggerContext(w, watermark, ptime, ws.trigger)
        trig.on_element(ctx, "0", min(els[0].arrival_time, ptime), n)
        touched.add(w)


def _drop_skipped(els: list[Element], skipped: list[int], result: KeyResult) -> list[Element]:
    """The elements a checked sum took; the others are dropped with the reason (counted like late ones)."""
    gone = set(skipped)
    result.late += [(els[i], SUM_OUT_OF_RANGE) for i in skipped]
    return [el for i, el in enumerate(els) if i not in gone]


def _keep_sums_in_range(assigned: list[tuple[Element, Window]], groups: list[tuple[Window, list[Window]]],
                        open_windows: list[Window], live: dict[Window, WindowState], strategy: Strategy,
                        result: KeyResult) -> tuple[list[tuple[Element, Window]], list[tuple[Window, list[Window]]]]:
    """Sessions whose sums together would overflow are not merged: the batch's elements that would join
    them are dropped with the reason, and the stored sessions stay apart (they never touched each other)."""
    comb = strategy.combiner
    bad: set[Window] = set()
    for _merged, members in groups:
        stored = sorted({m for m in members if m in live})
        if len(stored) > 1 and comb.merge_checked([live[m].acc for m in stored]) is None:
            bad.update(members)
    if not bad:
        return assigned, groups
    result.late += [(el, SUM_OUT_OF_RANGE) for el, w in assigned if w in bad]
    kept = [(el, w) for el, w in assigned if w not in bad]
    return kept, strategy.window_fn.merge(open_windows + [w for _, w in kept])


def _add_groups(groups: Sequence[WindowGroup], live: dict[Window, WindowState], touched: set[Window],
                strategy: Strategy, ptime: int, watermark: int) -> None:
    """Step 3 for windows formed on columns: what ``_add_elements`` does for a key without stored windows
    (new windows; a merging function's get the trigger state merged from none, as step 2 gives them)."""
    comb, trig = strategy.combiner, strategy.trigger
    merging = strategy.window_fn.merging
    for w, values, first_arrival, n in groups:
        # unchecked: a key whose sums could leave the range is never formed on columns (``form_windows``)
        ws = live[w] = WindowState(window=w, acc=comb.add_all(comb.create(), values),
                                   trigger=merge_states(trig, [{}]) if merging else {}, unfired=n)
        trig.on_element(TriggerContext(w, watermark, ptime, ws.trigger), "0", min(first_arrival, ptime), n)
        touched.add(w)
