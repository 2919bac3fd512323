"""The builtin triggers of ``model.triggers`` on columns: one call decides for many windows at once.

A batch's windows see the same watermark and processing time; what differs is each window's end, its trigger
state (the same for every new window; a stored one's read from its JSON, ``NodeColumns.of``), its first element's
arrival and how many elements it holds. Each builtin trigger's hooks are mirrored here over numpy arrays, a mask
saying which windows a call applies to, so ``model.step_columns`` runs the per-key step's firing for all of them
without a Python object per window. The object triggers stay the reference: the same state, node for node, and
the same JSON (``tests/test_fast_paths.py`` holds the two against each other)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.triggers import (
    AfterDelay,
    AllOf,
    AtCount,
    AtPeriod,
    AtWatermark,
    FirstOf,
    Repeat,
    SequenceOf,
    State,
    Trigger,
)

#: fields whose only value is ``True`` (the others hold integers: counts, times, a sequence's position)
FLAGS = frozenset({"armed", "done"})
_INT64 = (-(2**63), 2**63 - 1)
#: (values, present) of a timer over the windows
Timer = tuple[np.ndarray, np.ndarray]


class NodeColumns:
    """The trigger state of ``n`` windows: per path whether its node exists (``ctx.node`` creates an empty one,
    which the JSON keeps), and per field its values and where it is present."""

    def __init__(self, n: int, fresh: State) -> None:
        self.n = n
        self.exists: dict[str, np.ndarray] = {}
        self.fields: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        everywhere = np.ones(n, bool)
        for path, node in fresh.items():
            self.touch(path, everywhere)
            for name, value in node.items():
                self.put(path, name, everywhere, np.int64(value))

    @classmethod
    def of(cls, states: list[State]) -> NodeColumns:
        """The columns of stored trigger states (each as ``NodeColumns.holds`` allows)."""
        out = cls(len(states), {})
        for i, state in enumerate(states):
            for path, node in state.items():
                exists = out.exists.get(path)
                if exists is None:
                    exists = out.exists[path] = np.zeros(out.n, bool)
                exists[i] = True
                fields = out.fields.setdefault(path, {})
                for name, value in node.items():
                    got = fields.get(name)
                    if got is None:
                        got = fields[name] = (np.zeros(out.n, np.int64), np.zeros(out.n, bool))
                    got[0][i] = value
                    got[1][i] = True
        return out

    @staticmethod
    def holds(states: list[State]) -> np.ndarray:
        """Which trigger states the columns can hold: flags that are ``True`` and integer fields."""
        def fits(state: State) -> bool:
            return all(value is True if name in FLAGS else type(value) is int and _INT64[0] <= value <= _INT64[1]
                       for node in state.values() for name, value in node.items())
        return np.array([fits(s) for s in states], bool)

    def take(self, rows: np.ndarray) -> NodeColumns:
        """These windows' states only, in this order."""
        out = NodeColumns(len(rows), {})
        out.exists = {p: e[rows] for p, e in self.exists.items()}
        out.fields = {p: {name: (v[rows], h[rows]) for name, (v, h) in fields.items()}
                      for p, fields in self.fields.items()}
        return out

    def touch(self, path: str, m: np.ndarray) -> None:
        """``ctx.node(path)`` where ``m``."""
        got = self.exists.get(path)
        if got is None:
            self.exists[path] = m.copy()
        else:
            got |= m

    def get(self, path: str, name: str) -> tuple[np.ndarray, np.ndarray]:
        got = self.fields.get(path, {}).get(name)
        return got if got is not None else (np.zeros(self.n, np.int64), np.zeros(self.n, bool))

    def value(self, path: str, name: str, default: int = 0) -> np.ndarray:
        """``state.get(path, {}).get(name, default)``."""
        values, has = self.get(path, name)
        return np.where(has, values, default)

    def put(self, path: str, name: str, m: np.ndarray, values: np.ndarray | np.int64 | int) -> None:
        """``ctx.node(path)[name] = values`` where ``m``."""
        self.touch(path, m)
        got = self.fields.setdefault(path, {}).get(name)
        if got is None:
            got = self.fields[path][name] = (np.zeros(self.n, np.int64), np.zeros(self.n, bool))
        vals, has = got
        vals[m] = values[m] if isinstance(values, np.ndarray) else values
        has |= m

    def pop(self, path: str, name: str, m: np.ndarray) -> None:
        """``ctx.node(path).pop(name, None)`` where ``m``."""
        self.touch(path, m)
        got = self.fields.get(path, {}).get(name)
        if got is not None:
            got[1][m] = False

    def done(self, path: str) -> np.ndarray:
        return self.get(path, "done")[1]

    def reset(self, path: str, m: np.ndarray) -> None:
        """``Trigger.reset``: the node at ``path`` and every node below it deleted where ``m``."""
        below = path + "."
        for p, exists in self.exists.items():
            if p == path or p.startswith(below):
                exists[m] = False
                for _vals, has in self.fields.get(p, {}).values():
                    has[m] = False

    def to_json(self, rows: np.ndarray) -> pa.Array:
        """The JSON of ``rows``' trigger states, as ``json.dumps(state, sort_keys=True, separators=(",", ":"))``
        writes them (inside ``WindowState.to_json``): built per shape (which nodes and fields a window has), a
        handful of templates, each filled on columns."""
        paths = sorted(self.exists)
        slots: list[tuple[str, str | None]] = []  # (path, None) for a node's existence, (path, name) for a field
        for p in paths:
            slots.append((p, None))
            slots += [(p, name) for name in sorted(self.fields.get(p, {}))]
        present = [self.exists[p][rows] if name is None else self.fields[p][name][1][rows] for p, name in slots]
        out = np.empty(len(rows), object)
        if not len(rows):
            return pa.array([], pa.string())
        shapes = np.packbits(np.stack(present, axis=1), axis=1) if present else np.zeros((len(rows), 1), np.uint8)
        kinds, which = np.unique(shapes, axis=0, return_inverse=True)
        which = which.reshape(-1)
        for kind in range(len(kinds)):
            at = np.flatnonzero(which == kind)
            has = [bool(present[i][at[0]]) for i in range(len(slots))]
            pieces: list[str | pa.Array] = ["{"]
            first_node = True
            for p in paths:
                if not has[slots.index((p, None))]:
                    continue
                pieces.append(("" if first_node else ",") + f'"{p}":{{')
                first_node = False
                first_field = True
                for name in sorted(self.fields.get(p, {})):
                    if not has[slots.index((p, name))]:
                        continue
                    pieces.append(("" if first_field else ",") + f'"{name}":')
                    first_field = False
                    if name in FLAGS:
                        pieces.append("true")
                    else:
                        pieces.append(pc.cast(pa.array(self.fields[p][name][0][rows[at]]), pa.string()))
                pieces.append("}")
            pieces.append("}")
            out[at] = join(pieces, len(at)).to_numpy(zero_copy_only=False)
        return pa.array(out, pa.string())


def join(pieces: list[str | pa.Array], n: int) -> pa.Array:
    """Strings and string arrays of ``n`` rows, joined row by row (constant pieces folded together)."""
    folded: list[str | pa.Array] = []
    for piece in pieces:
        if isinstance(piece, str) and folded and isinstance(folded[-1], str):
            folded[-1] += piece
        else:
            folded.append(piece)
    if all(isinstance(p, str) for p in folded):
        return pa.array([folded[0] if folded else ""] * n, pa.string())
    return pc.binary_join_element_wise(*[pa.scalar(p) if isinstance(p, str) else p for p in folded], "")


class Ctx:
    """``TriggerContext`` for ``n`` windows: their ends, the batch's watermark and processing time, their state."""

    def __init__(self, end: np.ndarray, watermark: int, ptime: int, state: NodeColumns) -> None:
        self.end, self.watermark, self.ptime, self.state = end, watermark, ptime, state
        self.n = len(end)

    def none(self) -> np.ndarray:
        return np.zeros(self.n, bool)

    def no_timer(self) -> Timer:
        return np.zeros(self.n, np.int64), np.zeros(self.n, bool)


def _earliest(a: Timer, b: Timer) -> Timer:
    """The earlier of two optional timers, window by window."""
    (av, ah), (bv, bh) = a, b
    return np.where(ah & bh, np.minimum(av, bv), np.where(ah, av, bv)), ah | bh


class ColumnTrigger:
    """One node of the tree, its hooks over columns; ``m``: the windows a call applies to. Mirrors ``Trigger``."""

    def __init__(self, trigger: Trigger, kids: tuple[ColumnTrigger, ...]) -> None:
        self.trigger, self.kids = trigger, kids

    def children(self, path: str) -> list[tuple[str, ColumnTrigger]]:
        return [(p, kid) for (p, _), kid in zip(self.trigger.kids(path), self.kids, strict=True)]

    def on_element(self, c: Ctx, path: str, m: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        for p, kid in self.children(path):
            sub = m & ~c.state.done(p)
            if sub.any():
                kid.on_element(c, p, sub, first, count)

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        raise NotImplementedError

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def set_finished(self, c: Ctx, path: str, m: np.ndarray) -> None:
        if m.any():
            c.state.put(path, "done", m, 1)

    def timers(self, c: Ctx, path: str) -> tuple[Timer, Timer]:
        event, ptime = c.no_timer(), c.no_timer()
        for p, kid in self.children(path):
            open_ = ~c.state.done(p)
            (ev, eh), (pv, ph) = kid.timers(c, p)
            event = _earliest(event, (ev, eh & open_))
            ptime = _earliest(ptime, (pv, ph & open_))
        return event, ptime


class _AtWatermark(ColumnTrigger):
    def on_element(self, c: Ctx, path: str, m: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        c.state.put(path, "armed", m, 1)

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        return c.state.get(path, "armed")[1] & (c.watermark >= c.end)

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        c.state.pop(path, "armed", m)
        return np.ones(c.n, bool)

    def timers(self, c: Ctx, path: str) -> tuple[Timer, Timer]:
        return (c.end, c.state.get(path, "armed")[1].copy()), c.no_timer()


class _AtCount(ColumnTrigger):
    def on_element(self, c: Ctx, path: str, m: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        c.state.put(path, "count", m, c.state.value(path, "count") + count)

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        return c.state.value(path, "count") >= self.trigger.n

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        c.state.pop(path, "count", m)
        return np.ones(c.n, bool)


class _ProcessingTime(ColumnTrigger):
    def __init__(self, trigger: Trigger, kids: tuple[ColumnTrigger, ...], timer_for: Callable[[np.ndarray], np.ndarray]
                 ) -> None:
        super().__init__(trigger, kids)
        self.timer_for = timer_for

    def on_element(self, c: Ctx, path: str, m: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        c.state.touch(path, m)
        unset = m & ~c.state.get(path, "at")[1]
        if unset.any():
            c.state.put(path, "at", unset, self.timer_for(first))

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        at, has = c.state.get(path, "at")
        return has & (c.ptime >= at)

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        c.state.pop(path, "at", m)
        return np.ones(c.n, bool)

    def timers(self, c: Ctx, path: str) -> tuple[Timer, Timer]:
        at, has = c.state.get(path, "at")
        return c.no_timer(), (at.copy(), has.copy())


class _Repeat(ColumnTrigger):
    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        ((p, kid),) = self.children(path)
        return kid.should_fire(c, p)

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        ((p, kid),) = self.children(path)
        finished = m & kid.on_fire(c, p, m)
        if finished.any():
            c.state.reset(p, finished)
        return c.none()


class _SequenceOf(ColumnTrigger):
    def on_element(self, c: Ctx, path: str, m: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        current = c.state.value(path, "i")
        for i, (p, kid) in enumerate(self.children(path)):
            sub = m & (current == i)
            if sub.any():
                kid.on_element(c, p, sub, first, count)

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        current = c.state.value(path, "i")
        out = c.none()
        for i, (p, kid) in enumerate(self.children(path)):
            at = current == i
            if at.any():
                out |= at & kid.should_fire(c, p)
        return out

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        current = c.state.value(path, "i")
        for i, (p, kid) in enumerate(self.children(path)):
            sub = m & (current == i)
            if not sub.any():
                continue
            finished = sub & kid.on_fire(c, p, sub)
            if finished.any():
                kid.set_finished(c, p, finished)
                c.state.put(path, "i", finished, i + 1)
        return c.state.value(path, "i") >= len(self.kids)

    def timers(self, c: Ctx, path: str) -> tuple[Timer, Timer]:
        current = c.state.value(path, "i")
        event, ptime = c.no_timer(), c.no_timer()
        for i, (p, kid) in enumerate(self.children(path)):
            at = current == i
            if at.any():
                (ev, eh), (pv, ph) = kid.timers(c, p)
                event = _earliest(event, (ev, eh & at))
                ptime = _earliest(ptime, (pv, ph & at))
        return event, ptime


class _FirstOf(ColumnTrigger):
    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        out = c.none()
        for p, kid in self.children(path):
            out |= ~c.state.done(p) & kid.should_fire(c, p)
        return out

    def _fire_open(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        """Each open child that is ready fires; those it finishes are set finished. Which windows finished one."""
        opened = [(p, kid, m & ~c.state.done(p)) for p, kid in self.children(path)]
        finished_any = c.none()
        for p, kid, sub in opened:
            ready = sub & kid.should_fire(c, p)
            if not ready.any():
                continue
            finished = ready & kid.on_fire(c, p, ready)
            kid.set_finished(c, p, finished)
            finished_any |= finished
        return finished_any

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        return self._fire_open(c, path, m)


class _AllOf(_FirstOf):
    def _open(self, c: Ctx, path: str) -> list[np.ndarray]:
        return [~c.state.done(p) for p, _ in self.children(path)]

    def should_fire(self, c: Ctx, path: str) -> np.ndarray:
        out, any_open = np.ones(c.n, bool), c.none()
        for (p, kid), open_ in zip(self.children(path), self._open(c, path), strict=True):
            any_open |= open_
            out &= ~open_ | kid.should_fire(c, p)
        return any_open & out

    def on_fire(self, c: Ctx, path: str, m: np.ndarray) -> np.ndarray:
        self._fire_open(c, path, m)
        still = c.none()
        for open_ in self._open(c, path):
            still |= open_
        return ~still


def _period_timer(t: AtPeriod) -> Callable[[np.ndarray], np.ndarray]:
    def timer_for(first: np.ndarray) -> np.ndarray:
        base = first - t.offset
        return base - base % t.period + t.period + t.offset  # numpy's % floors like Python's
    return timer_for


def column_trigger(trigger: Trigger) -> ColumnTrigger | None:
    """The tree on columns, or None if some node is not one of this module's builtins (a subclass included)."""
    kids = []
    for child in trigger.children:
        got = column_trigger(child)
        if got is None:
            return None
        kids.append(got)
    kind, k = type(trigger), tuple(kids)
    if kind is AtWatermark:
        return _AtWatermark(trigger, k)
    if kind is AtCount:
        return _AtCount(trigger, k)
    if kind is AfterDelay:
        return _ProcessingTime(trigger, k, lambda first, d=trigger.delay: first + d)
    if kind is AtPeriod:
        return _ProcessingTime(trigger, k, _period_timer(trigger))
    simple: dict[type, type[ColumnTrigger]] = {Repeat: _Repeat, SequenceOf: _SequenceOf, FirstOf: _FirstOf,
                                               AllOf: _AllOf}
    cls = simple.get(kind)
    return cls(trigger, k) if cls is not None else None
