"""When in processing time: composable trigger state machines (Dataflow paper, section 2.3).

Modelled on Beam's ``TriggerFn``: each trigger reacts to ``on_element``, ``on_merge``,
``should_fire`` and ``on_fire`` (which says whether it finished). Triggers are immutable
descriptions; their per-window state is a JSON dict keyed by the trigger's path in the tree
(``"0"``, ``"0.1"``, ...), so it can live in the ``windows`` Delta table and survive restarts.

Micro-batch semantics (one bundle per batch, as Beam's runner over TestStream): all of a batch's
elements are added first, then the watermark and processing time advance, then each window is
asked once whether it fires.

Trigger expressions in pipeline configs are parsed by :func:`parse_trigger`, e.g.
``"AtWatermark(early=AtPeriod('1m'), late=AtCount(1))"``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from millpond.model.timeutil import parse_duration
from millpond.model.windows import Window

State = dict[str, dict[str, Any]]


@dataclass
class TriggerContext:
    """What a trigger may look at: its window, the watermark and processing time of the batch."""

    window: Window
    watermark: int
    ptime: int
    state: State

    def node(self, path: str) -> dict[str, Any]:
        return self.state.setdefault(path, {})


def _done(state: State, path: str) -> bool:
    """Whether the trigger at ``path`` finished (``Trigger.finished``, without a call per child)."""
    node = state.get(path)
    return node is not None and bool(node.get("done"))


class Trigger:
    """Base state machine. Subclasses override the hooks they need."""

    children: tuple[Trigger, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Trigger:
        self = super().__new__(cls)
        self._kids: dict[str, tuple[tuple[str, Trigger], ...]] = {}
        return self

    def kids(self, path: str) -> tuple[tuple[str, Trigger], ...]:
        """(path, trigger) of each child under ``path``: formatted once, as every window of every key
        walks the same few paths."""
        out = self._kids.get(path)
        if out is None:
            out = self._kids[path] = tuple((f"{path}.{i}", c) for i, c in enumerate(self.children))
        return out

    # -- lifecycle -----------------------------------------------------------------------------
    def on_element(self, ctx: TriggerContext, path: str, element_ptime: int, count: int = 1) -> None:
        """``count`` elements arrived, the first at ``element_ptime``. A batch decides once per window,
        so its elements can be handed over together: the same state as one call per element."""
        state = ctx.state
        for p, child in self.kids(path):
            if not _done(state, p):
                child.on_element(ctx, p, element_ptime, count)

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        raise NotImplementedError

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        """Called when the window fires; True if this trigger is now finished."""
        raise NotImplementedError

    def reset(self, ctx: TriggerContext, path: str) -> None:
        for key in [k for k in ctx.state if k == path or k.startswith(path + ".")]:
            del ctx.state[key]

    # -- state helpers --------------------------------------------------------------------------
    def finished(self, ctx: TriggerContext, path: str) -> bool:
        return _done(ctx.state, path)

    def set_finished(self, ctx: TriggerContext, path: str) -> None:
        ctx.node(path)["done"] = True

    def merge_node(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        """Merge this trigger's own node across merging windows (finished only if finished in all)."""
        out: dict[str, Any] = {}
        if nodes and all(n.get("done") for n in nodes):
            out["done"] = True
        return out

    def ptime_timer(self, ctx: TriggerContext, path: str) -> int | None:
        """Earliest processing time at which this trigger could fire on its own."""
        times = [t for p, c in self.kids(path) if not c.finished(ctx, p) and (t := c.ptime_timer(ctx, p)) is not None]
        return min(times) if times else None

    def event_timer(self, ctx: TriggerContext, path: str) -> int | None:
        """Earliest watermark at which this trigger could fire on its own (an armed watermark timer)."""
        times = [t for p, c in self.kids(path) if not c.finished(ctx, p) and (t := c.event_timer(ctx, p)) is not None]
        return min(times) if times else None

    def timers(self, ctx: TriggerContext, path: str) -> tuple[int | None, int | None]:
        """(``event_timer``, ``ptime_timer``) in one walk of the tree: a stored window's two timers are asked
        for together, once per window the batch writes (the per-key step's largest trigger cost)."""
        event = ptime = None
        state = ctx.state
        for p, child in self.kids(path):
            if _done(state, p):
                continue
            e, t = child.timers(ctx, p)
            if e is not None and (event is None or e < event):
                event = e
            if t is not None and (ptime is None or t < ptime):
                ptime = t
        return event, ptime

    def walk(self, path: str = "0"):
        yield path, self
        for p, child in self.kids(path):
            yield from child.walk(p)

    def nodes(self) -> tuple[tuple[str, Trigger], ...]:
        """``walk()`` from the root, computed once (a trigger is an immutable description)."""
        out = self.__dict__.get("_nodes")
        if out is None:
            out = self.__dict__["_nodes"] = tuple(self.walk())
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.children))})"


# -- leaves ------------------------------------------------------------------------------------
class AtWatermark(Trigger):
    """Fires when the watermark passes the end of the window (a timer armed by data)."""

    def on_element(self, ctx: TriggerContext, path: str, element_ptime: int, count: int = 1) -> None:
        ctx.node(path)["armed"] = True

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        return bool(ctx.state.get(path, {}).get("armed")) and ctx.watermark >= ctx.window.end

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        ctx.node(path).pop("armed", None)
        return True

    def merge_node(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().merge_node(nodes)
        if any(n.get("armed") for n in nodes):
            out["armed"] = True
        return out

    def event_timer(self, ctx: TriggerContext, path: str) -> int | None:
        return ctx.window.end if ctx.state.get(path, {}).get("armed") else None

    def timers(self, ctx: TriggerContext, path: str) -> tuple[int | None, int | None]:
        node = ctx.state.get(path)
        return (ctx.window.end if node and node.get("armed") else None), None

    def __repr__(self) -> str:
        return "AtWatermark()"


class AtCount(Trigger):
    """Data-driven: fires once the pane holds ``n`` elements."""

    def __init__(self, n: int) -> None:
        if int(n) < 1:
            raise ValueError("AtCount needs n >= 1")
        self.n = int(n)

    def on_element(self, ctx: TriggerContext, path: str, element_ptime: int, count: int = 1) -> None:
        node = ctx.node(path)
        node["count"] = node.get("count", 0) + count

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        return ctx.state.get(path, {}).get("count", 0) >= self.n

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        ctx.node(path).pop("count", None)
        return True

    def merge_node(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().merge_node(nodes)
        total = sum(n.get("count", 0) for n in nodes)
        if total:
            out["count"] = total
        return out

    def __repr__(self) -> str:
        return f"AtCount({self.n})"


class _ProcessingTimeTrigger(Trigger):
    """A processing-time timer set by the pane's first element."""

    def timer_for(self, element_ptime: int) -> int:
        raise NotImplementedError

    def on_element(self, ctx: TriggerContext, path: str, element_ptime: int, count: int = 1) -> None:
        node = ctx.node(path)
        if "at" not in node:
            node["at"] = self.timer_for(element_ptime)

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        at = ctx.state.get(path, {}).get("at")
        return at is not None and ctx.ptime >= at

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        ctx.node(path).pop("at", None)
        return True

    def merge_node(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().merge_node(nodes)
        timers = [n["at"] for n in nodes if "at" in n]
        if timers:
            out["at"] = min(timers)
        return out

    def ptime_timer(self, ctx: TriggerContext, path: str) -> int | None:
        return ctx.state.get(path, {}).get("at")

    def timers(self, ctx: TriggerContext, path: str) -> tuple[int | None, int | None]:
        node = ctx.state.get(path)
        return None, (node.get("at") if node else None)


class AtPeriod(_ProcessingTimeTrigger):
    """Fires at the next aligned processing-time boundary after the pane's first element."""

    def __init__(self, period: Any, offset: Any = 0) -> None:
        self.period = parse_duration(period)
        self.offset = parse_duration(offset)
        if self.period <= 0:
            raise ValueError("AtPeriod needs a positive period")

    def timer_for(self, element_ptime: int) -> int:
        base = element_ptime - self.offset
        return base - base % self.period + self.period + self.offset

    def __repr__(self) -> str:
        return f"AtPeriod({self.period / 1e6:g}s)"


class AfterDelay(_ProcessingTimeTrigger):
    """Fires ``delay`` of processing time after the pane's first element (Beam's AfterProcessingTime)."""

    def __init__(self, delay: Any) -> None:
        self.delay = parse_duration(delay)

    def timer_for(self, element_ptime: int) -> int:
        return element_ptime + self.delay

    def __repr__(self) -> str:
        return f"AfterDelay({self.delay / 1e6:g}s)"


# -- composites --------------------------------------------------------------------------------
class Repeat(Trigger):
    """Fires whenever its subtrigger fires, resetting it each time; never finishes."""

    def __init__(self, trigger: Trigger) -> None:
        self.children = (trigger,)

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        p, child = self.kids(path)[0]
        return child.should_fire(ctx, p)

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        p, child = self.kids(path)[0]
        if child.on_fire(ctx, p):
            child.reset(ctx, p)
        return False


class SequenceOf(Trigger):
    """Runs its subtriggers one after another (Beam's AfterEach); finishes with the last."""

    def __init__(self, *triggers: Trigger) -> None:
        if not triggers:
            raise ValueError("SequenceOf needs at least one trigger")
        self.children = tuple(triggers)

    def _current(self, ctx: TriggerContext, path: str) -> int:
        return ctx.state.get(path, {}).get("i", 0)

    def on_element(self, ctx: TriggerContext, path: str, element_ptime: int, count: int = 1) -> None:
        i = self._current(ctx, path)
        if i < len(self.children):
            p, child = self.kids(path)[i]
            child.on_element(ctx, p, element_ptime, count)

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        i = self._current(ctx, path)
        if i >= len(self.children):
            return False
        p, child = self.kids(path)[i]
        return child.should_fire(ctx, p)

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        i = self._current(ctx, path)
        p, child = self.kids(path)[i]
        if child.on_fire(ctx, p):
            child.set_finished(ctx, p)
            i += 1
            ctx.node(path)["i"] = i
        return i >= len(self.children)

    def merge_node(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        # The first subtrigger unfinished in any merging window is current again (Beam's rule).
        out = super().merge_node(nodes)
        out["i"] = min((n.get("i", 0) for n in nodes), default=0)
        return out

    def ptime_timer(self, ctx: TriggerContext, path: str) -> int | None:
        i = self._current(ctx, path)
        if i >= len(self.children):
            return None
        p, child = self.kids(path)[i]
        return child.ptime_timer(ctx, p)

    def event_timer(self, ctx: TriggerContext, path: str) -> int | None:
        i = self._current(ctx, path)
        if i >= len(self.children):
            return None
        p, child = self.kids(path)[i]
        return child.event_timer(ctx, p)

    def timers(self, ctx: TriggerContext, path: str) -> tuple[int | None, int | None]:
        i = self._current(ctx, path)
        if i >= len(self.children):
            return None, None
        p, child = self.kids(path)[i]
        return child.timers(ctx, p)


class FirstOf(Trigger):
    """Fires when any subtrigger fires; finishes when any finishes (Beam's AfterAny)."""

    combine = any

    def __init__(self, *triggers: Trigger) -> None:
        if not triggers:
            raise ValueError(f"{type(self).__name__} needs at least one trigger")
        self.children = tuple(triggers)

    def _open(self, ctx: TriggerContext, path: str) -> list[tuple[str, Trigger]]:
        state = ctx.state
        return [pc for pc in self.kids(path) if not _done(state, pc[0])]

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        return any(c.should_fire(ctx, p) for p, c in self._open(ctx, path))

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        finished_any = False
        for p, c in self._open(ctx, path):
            if c.should_fire(ctx, p) and c.on_fire(ctx, p):
                c.set_finished(ctx, p)
                finished_any = True
        return finished_any


class AllOf(FirstOf):
    """Fires when every unfinished subtrigger is ready; finishes when all have finished."""

    def should_fire(self, ctx: TriggerContext, path: str) -> bool:
        open_ = self._open(ctx, path)
        return bool(open_) and all(c.should_fire(ctx, p) for p, c in open_)

    def on_fire(self, ctx: TriggerContext, path: str) -> bool:
        for p, c in self._open(ctx, path):
            if c.should_fire(ctx, p) and c.on_fire(ctx, p):
                c.set_finished(ctx, p)
        return not self._open(ctx, path)


def RepeatUntil(trigger: Trigger, until: Trigger) -> Trigger:  # noqa: N802 - reads like the paper
    """Repeat ``trigger`` until ``until`` fires (Beam's ``Repeatedly(t).orFinally(until)``)."""
    return FirstOf(Repeat(trigger), until)


OrFinally = RepeatUntil


def AtWatermarkWith(early: Trigger | None = None, late: Trigger | None = None) -> Trigger:  # noqa: N802
    """The early/on-time/late shorthand: repeated early firings, the on-time pane, repeated late ones."""
    on_time: Trigger = RepeatUntil(early, AtWatermark()) if early is not None else AtWatermark()
    return SequenceOf(on_time, Repeat(late)) if late is not None else on_time


DEFAULT_TRIGGER = "Repeat(AtWatermark())"

_NAMES: dict[str, Any] = {
    "AtWatermark": lambda early=None, late=None: (
        AtWatermark() if early is None and late is None else AtWatermarkWith(early, late)
    ),
    "AtCount": AtCount,
    "AtPeriod": AtPeriod,
    "AfterDelay": AfterDelay,
    "Repeat": Repeat,
    "SequenceOf": SequenceOf,
    "RepeatUntil": RepeatUntil,
    "OrFinally": OrFinally,
    "FirstOf": FirstOf,
    "AllOf": AllOf,
}


def parse_trigger(text: str | None) -> Trigger:
    """Build a trigger from a config expression; only trigger names and literals are allowed."""
    text = text or DEFAULT_TRIGGER

    def build(node: ast.AST) -> Any:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _NAMES:
            args = [build(a) for a in node.args]
            kwargs = {k.arg: build(k.value) for k in node.keywords if k.arg}
            return _NAMES[node.func.id](*args, **kwargs)
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float)) or (
            isinstance(node, ast.Constant) and node.value is None
        ):
            return node.value
        raise ValueError(f"not allowed in a trigger expression: {ast.unparse(node)!r} (names: {', '.join(_NAMES)})")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse trigger {text!r}: {exc.msg}") from exc
    trigger = build(tree.body)
    if not isinstance(trigger, Trigger):
        raise ValueError(f"{text!r} is not a trigger")
    return trigger


def merge_states(trigger: Trigger, states: list[State]) -> State:
    """Trigger state of a merged window from the states of the windows it absorbed."""
    if not any(states) and (fresh := _fresh_state(trigger)) is not None:
        return {path: dict(node) for path, node in fresh.items()}
    merged: State = {}
    for path, node in trigger.nodes():
        out = node.merge_node([s.get(path, {}) for s in states])
        if out:
            merged[path] = out
    return merged


#: trigger classes whose ``merge_node`` is a pure function of the nodes' contents (this module's own)
_PURE_MERGE = (AtWatermark, AtCount, AtPeriod, AfterDelay, Repeat, SequenceOf, FirstOf, AllOf)
_SCALARS = (bool, int, float, str, type(None))


def _fresh_state(trigger: Trigger) -> State | None:
    """The state merged from windows without state (a new window's): the same for every window of a
    pipeline, so computed once, to be copied node by node; None unless every node is a builtin trigger
    and the state holds only scalars (then ``merge_states`` does the general merge)."""
    if "_fresh" not in trigger.__dict__:
        fresh: State = {}
        for path, node in trigger.nodes():
            out = node.merge_node([{}])
            if out:
                fresh[path] = out
        pure = all(type(n) in _PURE_MERGE for _, n in trigger.nodes())
        scalars = all(type(v) in _SCALARS for node in fresh.values() for v in node.values())
        trigger.__dict__["_fresh"] = fresh if pure and scalars else None
    return trigger.__dict__["_fresh"]
