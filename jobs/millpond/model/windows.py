"""Where in event time: window assignment and merging (Dataflow paper, section 2.2).

A window function is ``assign`` (element timestamp -> windows) plus ``merge`` (a key's windows ->
groups that become one). Non-merging functions leave ``merge`` as the identity. Add a custom window
function by subclassing :class:`WindowFn` and naming it in the pipeline config as
``window: {type: custom, class: "my_module:MyWindows", ...}``; its extra keys are passed to
the constructor.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np

from millpond.model.timeutil import MAX_TS, MIN_TS, parse_duration


class Window(NamedTuple):
    """Half-open interval [start, end) of event time, in microseconds (a tuple: hashing and ordering
    happen in C, which matters when a hot key's batch merges and sorts many windows)."""

    start: int
    end: int

    def intersects(self, other: Window) -> bool:
        return self.start < other.end and other.start < self.end

    def span(self, other: Window) -> Window:
        return Window(min(self.start, other.start), max(self.end, other.end))


GLOBAL_WINDOW = Window(MIN_TS, MAX_TS)


def _fits(ts: np.ndarray, span: int) -> bool:
    """Whether ``ts + span`` stays within int64 (Python's ints never overflow; numpy's would)."""
    return not len(ts) or int(ts.max()) <= np.iinfo(np.int64).max - span


class WindowFn:
    """Assign and merge: the two halves of a windowing strategy."""

    merging: bool = False

    def span(self) -> int | None:
        """The most event time one element's window covers (size, or the session gap): how long a record id
        must be remembered beyond allowed lateness. None: unbounded or unknown (the global window, a custom fn)."""
        return None

    def reach(self) -> int | None:
        """How far past an element a stored window it can fall into or merge with may start: the session gap,
        0 for windows an element reaches only by lying inside them; None when unknown (a custom merging fn),
        and then a batch reads every stored window of the keys it touches."""
        return None

    def assign(self, ts: int) -> list[Window]:
        raise NotImplementedError

    def merge(self, windows: list[Window]) -> list[tuple[Window, list[Window]]]:
        """Groups of windows that merge, as (result, members); singletons included."""
        return [(w, [w]) for w in sorted(set(windows))]

    def assign_columns(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``assign`` on a column of timestamps, for a function that gives each element one window:
        (start, end) arrays. None (the default, and for a custom function) keeps the per-element path."""
        return None

    def merge_columns(self, key: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``merge`` on columns: each element's window after merging with the other windows of its key
        (``key``: equal codes are one key). Only asked for keys without stored windows."""
        return start, end


class GlobalWindows(WindowFn):
    def reach(self) -> int | None:
        return 0

    def assign(self, ts: int) -> list[Window]:
        return [GLOBAL_WINDOW]


class FixedWindows(WindowFn):
    def __init__(self, size: Any, offset: Any = 0) -> None:
        self.size = parse_duration(size)
        self.offset = parse_duration(offset) % self.size

    def span(self) -> int | None:
        return self.size

    def reach(self) -> int | None:
        return 0

    def assign(self, ts: int) -> list[Window]:
        start = ts - (ts - self.offset) % self.size
        return [Window(start, start + self.size)]

    def assign_columns(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        if type(self) is not FixedWindows or not _fits(ts, self.size):
            return None
        start = ts - (ts - self.offset) % self.size  # numpy's % floors like Python's
        return start, start + self.size


class SlidingWindows(WindowFn):
    def __init__(self, size: Any, period: Any, offset: Any = 0) -> None:
        self.size = parse_duration(size)
        self.period = parse_duration(period)
        self.offset = parse_duration(offset) % self.period

    def span(self) -> int | None:
        return self.size

    def reach(self) -> int | None:
        return 0

    def assign(self, ts: int) -> list[Window]:
        last_start = ts - (ts - self.offset) % self.period
        out = []
        start = last_start
        while start > ts - self.size:
            out.append(Window(start, start + self.size))
            start -= self.period
        return sorted(out)


class Sessions(WindowFn):
    """Each element opens [t, t + gap); overlapping windows of a key merge into one session."""

    merging = True

    def __init__(self, gap: Any) -> None:
        self.gap = parse_duration(gap)

    def span(self) -> int | None:
        return self.gap

    def reach(self) -> int | None:
        return self.gap

    def assign(self, ts: int) -> list[Window]:
        return [Window(ts, ts + self.gap)]

    def assign_columns(self, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        if type(self) is not Sessions or not _fits(ts, self.gap):
            return None
        return ts, ts + self.gap

    def merge_columns(self, key: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted by key and start, a window joins the session before it iff it starts before that
        session's end, which (every window spanning ``gap``) is the previous window's end."""
        n = len(start)
        if not n:
            return start, end
        order = np.lexsort((start, key))
        k, s, e = key[order], start[order], end[order]
        opens = np.empty(n, bool)
        opens[0] = True
        np.logical_or(k[1:] != k[:-1], s[1:] >= e[:-1], out=opens[1:])
        firsts = np.flatnonzero(opens)
        lasts = np.append(firsts[1:] - 1, n - 1)
        session = np.cumsum(opens) - 1
        merged_start, merged_end = np.empty_like(start), np.empty_like(end)
        merged_start[order] = s[firsts][session]
        merged_end[order] = e[lasts][session]
        return merged_start, merged_end

    def merge(self, windows: list[Window]) -> list[tuple[Window, list[Window]]]:
        out: list[tuple[Window, list[Window]]] = []
        ordered = sorted(set(windows))
        if not ordered:
            return out
        # The current span as plain ints: sorted by start, a window joins it iff it starts before its end.
        start, end = ordered[0]
        group = [ordered[0]]
        for w in ordered[1:]:
            if w[0] < end and start < w[1]:
                group.append(w)  # in place: a hot key's merge stays linear
                if w[1] > end:
                    end = w[1]
            else:
                out.append((Window(start, end), group))
                start, end = w
                group = [w]
        out.append((Window(start, end), group))
        return out


def window_fn(config: dict[str, Any]) -> WindowFn:
    """Build the window function named by a pipeline's ``window:`` block."""
    cfg = dict(config)
    kind = cfg.pop("type", "global")
    if kind == "global":
        return GlobalWindows()
    if kind == "fixed":
        return FixedWindows(**cfg)
    if kind == "sliding":
        return SlidingWindows(**cfg)
    if kind == "sessions":
        return Sessions(**cfg)
    if kind == "custom":
        module, _, name = cfg.pop("class").partition(":")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, WindowFn)):
            raise ValueError(f"{module}:{name} is not a millpond.model.windows.WindowFn")
        return cls(**cfg)
    raise ValueError(f"unknown window type {kind!r}: use global, fixed, sliding, sessions or custom")
