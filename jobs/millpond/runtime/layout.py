"""A batch's elements and state rows grouped by key, without a Python object per element.

The per-key step runs key range by key range (``KeyLayout.rows``): only one chunk exists as objects at a
time, and each forked worker makes its own range's. Keys with no stored windows get their windows formed
on columns (``form_windows``); the per-element path stays the reference (``tests/test_fast_paths.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.clock import BatchClock
from millpond.model.step import Element, Strategy, WindowGroup
from millpond.model.step_columns import NewWindows, column_step, fire_new, fire_stored, stored_columns
from millpond.model.timeutil import MAX_TS
from millpond.model.windows import Window
from millpond.runtime.assembly import FiredKeys, us_column

#: the per-key step turns this many elements (+ state rows) at a time into Python objects, and assembles
#: their output into Arrow before the next: a batch's memory grows with its Arrow columns, not beyond
CHUNK_ELEMENTS = 200_000
#: the per-key step's cost of a key with stored windows and of a stored window, in elements (measured: ~30 us a key,
#: ~1.5 us an element): the weights that split a chunk's keys evenly over the cores (Zipf keys sort hot ones
#: together)
KEY_COST, STATE_ROW_COST = 20, 3
#: a key without stored windows: its new windows fire on columns (``model.step_columns``), about an element's cost
NEW_KEY_COST = 1
#: the columns of a batch's elements, in ``Element`` field order
EVENT_COLUMNS = ("id", "key", "value", "event_time", "arrival_time")
#: an optional column after them: how many events an element stands for (a lifted element's, ``Element.weight``)
WEIGHT = "weight"


def chunks_of(offsets: np.ndarray, size: int) -> Iterator[tuple[int, int]]:
    """(lo, hi) ranges of consecutive groups (group g holds items offsets[g]..offsets[g+1]) of about
    ``size`` items each; a group is never split, so one larger than ``size`` makes a chunk alone."""
    n = len(offsets) - 1
    lo = 0
    while lo < n:
        hi = int(np.searchsorted(offsets, offsets[lo] + size, side="right")) - 1
        hi = min(n, max(hi, lo + 1))
        yield lo, hi
        lo = hi


@dataclass
class KeyLayout:
    """The batch's elements and state rows grouped by key, keys in ascending order (UTF-8 byte order,
    the order of Python's ``sorted``), without making Python objects: ``rows(lo, hi)`` makes them for a
    range of keys, so only one chunk exists as objects at a time, and each worker makes its own range's."""

    events: pa.Table
    state: pa.Table
    keys: pa.Array
    ev_order: np.ndarray
    ev_off: np.ndarray
    st_order: np.ndarray
    st_off: np.ndarray

    @classmethod
    def of(cls, events: pa.Table, state: pa.Table) -> KeyLayout:
        parts = [c for t in (events, state) for c in t.column("key").cast(pa.string()).chunks]
        keys = pc.unique(pa.chunked_array(parts, pa.string()))
        keys = keys.take(pc.sort_indices(keys))
        nk = len(keys)

        def layout(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
            """Row order grouping the table by key rank (stable), and where each key's rows start."""
            offsets = np.zeros(nk + 1, np.int64)
            if not table.num_rows or not nk:
                return np.zeros(0, np.int64), offsets
            rank = pc.index_in(table.column("key").cast(pa.string()), value_set=keys).to_numpy()
            np.cumsum(np.bincount(rank, minlength=nk), out=offsets[1:])
            return np.argsort(rank, kind="stable"), offsets

        return cls(events, state, keys, *layout(events), *layout(state))

    def chunks(self) -> Iterator[tuple[int, int]]:
        """Key ranges of about CHUNK_ELEMENTS elements + state rows (a key is never split)."""
        return chunks_of(self.ev_off + self.st_off, CHUNK_ELEMENTS) if len(self.keys) else iter(())

    def weights(self, lo: int, hi: int) -> np.ndarray:
        """The per-key step's expected cost of each key in the range, in elements."""
        stored = np.diff(self.st_off[lo:hi + 1])
        return np.where(stored > 0, KEY_COST, NEW_KEY_COST) + np.diff(self.ev_off[lo:hi + 1]) + STATE_ROW_COST * stored

    def rows(self, lo: int, hi: int, strategy: Strategy, clock: BatchClock, columnar: bool = True
             ) -> list[KeyInput]:
        """Keys ``lo..hi``, each with its elements (or its windows formed on columns, see ``form_windows``) and
        its state rows (start, end, JSON), in table order."""
        return self.split(lo, hi, strategy, clock, columnar, fire=False)[0]

    def split(self, lo: int, hi: int, strategy: Strategy, clock: BatchClock, columnar: bool = True,
              fire: bool = True) -> tuple[list[KeyInput], list[FiredKeys]]:
        """``rows``, less the keys whose windows fired on columns (``fire``: ``model.step_columns``): those with no
        stored window (their new windows) and those with no new element (their stored windows), which come back
        apart, as ``FiredKeys``."""
        ev_off, st_off = self.ev_off, self.st_off
        ev = self.events.take(self.ev_order[ev_off[lo]:ev_off[hi]])
        counts = np.diff(ev_off[lo:hi + 1])
        stored = np.diff(st_off[lo:hi + 1])
        got = form_windows(ev, counts, stored == 0, strategy, clock) if columnar else None
        fired_keys: list[FiredKeys] = []
        skip = np.zeros(hi - lo, bool)
        keys = self.keys.slice(lo, hi - lo)
        if got is None:
            by_key: list[list[WindowGroup] | None] = [None] * (hi - lo)
        else:  # the formed keys' elements are in their groups: only the others become objects
            fired = fire_new(strategy, clock, got.windows) if fire else None
            if fired is None:
                by_key = got.groups()
            else:
                by_key = [None] * (hi - lo)
                fired_keys.append(FiredKeys(keys.take(pa.array(got.key)), got.windows.start, got.windows.end, fired))
                skip |= got.formed
            ev = ev.filter(np.repeat(~got.formed, counts))
            counts = np.where(got.formed, 0, counts)
        st = self.state.take(self.st_order[st_off[lo]:st_off[hi]])
        if columnar and fire and column_step(strategy) is not None and ((counts == 0) & (stored > 0)).any():
            new = _fire_untouched(st, stored, counts == 0, keys, strategy, clock)
            if new is not None:
                fired_keys.append(new[0])
                skip |= new[1]
        cols = [ev.column(c).to_pylist() for c in EVENT_COLUMNS]
        # lifted elements (``model.step.lifts``) stand for their weight's events; the others for one
        cols.append(ev.column(WEIGHT).to_pylist() if WEIGHT in ev.column_names else [1] * ev.num_rows)
        elements = list(map(Element._make, zip(*cols, strict=True)))
        st_rows = list(zip(us_column(st, "window_start"), us_column(st, "window_end"),
                           st.column("state").to_pylist(), strict=True))
        del ev, st
        e_off = np.concatenate([[0], np.cumsum(counts)]).tolist()
        s_off = (st_off[lo:hi + 1] - st_off[lo]).tolist()
        inputs = [KeyInput(key, elements[e0:e1], by_key[i], st_rows[s0:s1]) for i, (key, (e0, e1), (s0, s1))
                  in enumerate(zip(keys.to_pylist(), pairwise(e_off), pairwise(s_off), strict=True)) if not skip[i]]
        return inputs, fired_keys


def _fire_untouched(st: pa.Table, stored: np.ndarray, quiet: np.ndarray, keys: pa.Array, strategy: Strategy,
                    clock: BatchClock) -> tuple[FiredKeys, np.ndarray] | None:
    """The stored windows (``st``, grouped by key: ``stored`` rows each) of the keys with no new element
    (``quiet``), fired on columns where every window of the key can be (``model.step_columns.stored_columns``);
    with which keys they were. None if no key's could."""
    key = np.repeat(np.arange(len(stored)), stored)
    rows = np.flatnonzero(quiet[key])
    start = pc.cast(st.column("window_start"), pa.int64()).to_numpy()[rows]
    end = pc.cast(st.column("window_end"), pa.int64()).to_numpy()[rows]
    texts = st.column("state").take(pa.array(rows)).to_pylist()
    columns, ok = stored_columns(start, end, texts)
    if columns is None:
        return None
    # a key fires on columns only whole: each of its windows can
    blocked = np.bincount(key[rows][~ok], minlength=len(stored)) > 0
    fine = quiet & (stored > 0) & ~blocked
    wkey = key[rows][ok]  # the columns' windows' keys
    take = fine[wkey]
    if not take.any():
        return None
    # ``process_key`` fires a key's windows in order (start, end)
    at = np.flatnonzero(take)
    order = at[np.lexsort((columns.end[at], columns.start[at], wkey[at]))]
    columns, wkey = columns.take(order), wkey[order]
    fired = fire_stored(strategy, clock, columns)
    if fired is None:
        return None
    return FiredKeys(keys.take(pa.array(wkey)), columns.start, columns.end, fired), fine


class KeyInput(NamedTuple):
    """One key's input to the per-key step: elements, or windows already formed on columns."""

    key: str
    elements: list[Element]
    groups: list[WindowGroup] | None
    state_rows: list[tuple[int, int, str]]


class Formed(NamedTuple):
    """A range's keys whose windows were formed on columns (``formed``), each window's key (its index in the
    range) and the windows themselves, in the order the per-key step fires them."""

    windows: NewWindows
    formed: np.ndarray
    key: np.ndarray

    def groups(self) -> list[list[WindowGroup] | None]:
        """Each key's windows as ``WindowGroup``s (None for a key not formed), for ``process_key``."""
        w = self.windows
        values, bounds = w.values.tolist(), w.bounds.tolist()
        groups = [WindowGroup(win, values[a:b], t, n) for win, (a, b), t, n
                  in zip(map(Window, w.start.tolist(), w.end.tolist()), pairwise(bounds), w.first_arrival.tolist(),
                         w.count.tolist(), strict=True)]
        # each formed key's windows: a slice of ``groups`` (keys ascending, each key's windows by start)
        per_key = np.searchsorted(self.key, np.arange(len(self.formed) + 1)).tolist()
        return [groups[per_key[i]:per_key[i + 1]] if f else None for i, f in enumerate(self.formed.tolist())]


def form_windows(ev: pa.Table, counts: np.ndarray, stateless: np.ndarray, strategy: Strategy, clock: BatchClock
                 ) -> Formed | None:
    """Windows formed on columns for the keys with elements, no stored windows and no late element: steps
    1-3 of ``engine.process_key`` (assign, merge, group in arrival order) without an object per element.
    Returns the formed keys and their windows, or None where the window function cannot assign on columns
    (or no key qualifies). The per-element path stays the reference (``tests/test_fast_paths.py``)."""
    wfn, lateness, w_in = strategy.window_fn, strategy.allowed_lateness, clock.input_watermark
    key = np.repeat(np.arange(len(counts)), counts)
    ts = pc.cast(ev.column("event_time"), pa.int64()).to_numpy()
    assigned = wfn.assign_columns(ts)
    if assigned is None or ev.column("value").null_count:
        return None
    start, end = assigned
    # an element is late if its window's garbage-collection time is at or behind the input watermark
    forever = MAX_TS - lateness
    late = np.where(end < forever, end <= w_in - lateness, MAX_TS <= w_in)
    formed = stateless & (counts > 0) & (np.bincount(key[late], minlength=len(counts)) == 0)
    if strategy.combiner.checked:  # keys whose sums might overflow take the element path, which reports drops
        formed &= ~may_overflow(ev.column("value"), counts)
    if not formed.any():
        return None
    take = formed[key]
    key, start, end = key[take], start[take], end[take]
    if wfn.merging:
        start, end = wfn.merge_columns(key, start, end)
    ev = ev.filter(take)
    # the element path's order: by window (a key's windows by start), then (arrival, event time, id)
    arrival = ev.column("arrival_time")
    order = pc.sort_indices(pa.table({"k": key, "s": start, "a": arrival, "t": ev.column("event_time"),
                                      "id": ev.column("id")}),
                            [(c, "ascending") for c in ("k", "s", "a", "t", "id")]).to_numpy()
    k, s, e = key[order], start[order], end[order]
    opens = np.empty(len(k), bool)
    opens[:1] = True
    np.logical_or(k[1:] != k[:-1], s[1:] != s[:-1], out=opens[1:])
    firsts = np.flatnonzero(opens)
    bounds = np.append(firsts, len(k))
    if WEIGHT in ev.column_names:  # lifted elements count as the events they stand for
        counts_of = np.add.reduceat(pc.cast(ev.column(WEIGHT), pa.int64()).to_numpy()[order], firsts)
    else:
        counts_of = np.diff(bounds)
    values = ev.column("value").take(pa.array(order)).to_numpy()
    first_arrival = pc.cast(arrival, pa.int64()).to_numpy()[order[firsts]]
    windows = NewWindows(s[firsts], e[firsts], first_arrival, counts_of.astype(np.int64), values, bounds)
    return Formed(windows, formed, k[firsts])


def may_overflow(values: pa.ChunkedArray | pa.Array, counts: np.ndarray) -> np.ndarray:
    """Per key (values grouped by key, ``counts`` each): whether some running sum of its values could leave
    the value type's range (count x largest magnitude, with a margin for the float arithmetic)."""
    limit = 2.0**62 if pa.types.is_integer(values.type) else 1e307
    peak = np.zeros(len(counts))
    has = counts > 0
    if has.any():
        mag = np.abs(pc.cast(values, pa.float64(), safe=False).to_numpy())  # rounding is within the margin
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[has]
        peak[has] = np.maximum.reduceat(mag, starts)
    return counts * peak >= limit
