"""MillWheel computations (paper, sections 4-5): the user API (records, timers, context) and one key's
share of a batch as a pure function. The batch around it lives in :mod:`millpond.runtime.computation`."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from millpond.errors import MillpondError
from millpond.model.clock import BatchClock
from millpond.model.timeutil import to_us

COMPUTATION_TABLES = ("comp_state", "timers", "watermarks")
#: names a production stream may not take (the pipeline's own tables)
RESERVED = frozenset({"panes", "current", "windows", "late", "quarantine", "seen_ids", "ingest_log", "batches",
                      *COMPUTATION_TABLES})
EVENT, PROCESSING = "event", "processing"


@dataclass(frozen=True)
class Record:
    """One input record (times in microseconds since the epoch, UTC)."""

    id: str
    key: str
    value: Any
    event_time: int
    arrival_time: int
    #: behind the input low watermark (MillWheel's late record: the computation decides what to do)
    late: bool = False


@dataclass(frozen=True)
class Timer:
    key: str
    tag: str
    domain: str  # 'event' | 'processing'
    at: int


def _at(value: int | datetime | str) -> int:
    """Timer times: int microseconds (like ``Record.event_time``), a datetime, or ISO text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (datetime, str)):
        return to_us(value)
    raise MillpondError(f"timer time must be int microseconds, a datetime or ISO text, got {value!r}")


class Context:
    """What user code may touch while handling one key: its state, its timers, productions."""

    def __init__(self, key: str, state: dict[str, Any], timers: dict[str, Timer], clock: BatchClock,
                 streams: frozenset[str]) -> None:
        self.key = key
        self.state = state
        self._timers = timers
        self._clock = clock
        self._streams = streams
        self.productions: list[tuple[str, dict[str, Any]]] = []

    @property
    def batch(self) -> int:
        return self._clock.batch

    @property
    def processing_time(self) -> int:
        return self._clock.processing_time

    @property
    def watermark(self) -> int:
        """The input low watermark after this batch's advance: event timers up to it fire now."""
        return self._clock.watermark

    @property
    def input_watermark(self) -> int:
        """The low watermark before this batch: records behind it are late."""
        return self._clock.input_watermark

    def set_event_timer(self, tag: str, at: int | datetime | str) -> None:
        """Fire ``process_timer`` once the low watermark reaches ``at`` (replaces the tag's timer)."""
        self._timers[str(tag)] = Timer(self.key, str(tag), EVENT, _at(at))

    def set_processing_timer(self, tag: str, at: int | datetime | str) -> None:
        """Fire once a batch's processing time reaches ``at`` (replaces the tag's timer)."""
        self._timers[str(tag)] = Timer(self.key, str(tag), PROCESSING, _at(at))

    def cancel_timer(self, tag: str) -> None:
        self._timers.pop(str(tag), None)

    def timer(self, tag: str) -> Timer | None:
        return self._timers.get(str(tag))

    @property
    def timers(self) -> dict[str, Timer]:
        """This key's pending timers by tag (a copy: change them through set/cancel)."""
        return dict(self._timers)

    def produce(self, stream: str, record: dict[str, Any]) -> None:
        """A production to a declared output stream, committed with the batch (exactly once)."""
        if stream not in self._streams:
            raise MillpondError(f"produce to undeclared stream {stream!r}: declare it in output_streams "
                                f"(have {', '.join(sorted(self._streams)) or 'none'})")
        if not isinstance(record, dict):
            raise MillpondError(f"a production is a dict of columns, got {type(record).__name__}")
        self.productions.append((stream, dict(record)))


class Computation:
    """Subclass and override ``process_record`` / ``process_timer`` (MillWheel's Figure 7).

    Code must be deterministic (no wall clock, no unseeded randomness): a crashed batch is recomputed
    and must yield the same state, timers and productions. Keep per-key data in ``ctx.state``, never
    on ``self`` (one instance serves all keys of a batch).
    """

    #: output stream name -> Arrow schema of its rows (None: inferred; a ``batch`` column is added)
    output_streams: dict[str, pa.Schema | None] = {}
    #: per key and batch; timers still due after this many firings wait for the next batch
    max_timer_firings: int = 10_000

    def process_record(self, ctx: Context, record: Record) -> None:
        """Called once per new record (exactly once across retries)."""

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        """Called once per timer firing; the timer is already removed (set it again to repeat)."""


def load_computation(conf: str | dict[str, Any]) -> Computation:
    """``"module:Class"`` or ``{class: "module:Class", **options}`` -> an instance; ValueError if unusable."""
    options: dict[str, Any] = {}
    if isinstance(conf, dict):
        options = {k: v for k, v in conf.items() if k != "class"}
        conf = conf.get("class", "")
    if not isinstance(conf, str) or ":" not in conf:
        raise ValueError(f"computation {conf!r}: use 'module:Class' or {{class: 'module:Class', ...options}}")
    module_name, _, cls_name = conf.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"computation {conf!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Computation)):
        raise ValueError(f"computation {conf!r} is not a subclass of millpond.model.computation.Computation")
    try:
        comp = cls(**options)
    except TypeError as exc:
        raise ValueError(f"computation {conf!r}: bad options {sorted(options)}: {exc}") from exc
    for stream in comp.output_streams:
        if not str(stream).replace("_", "").isalnum() or stream in RESERVED:
            raise ValueError(f"computation {conf!r}: output stream name {stream!r} is not allowed "
                             "(letters, digits, underscores; not one of the pipeline's own tables)")
    return comp


# -- one key's share of a batch (a pure function: the same inputs give the same outcome) ----------------
@dataclass
class KeyOutcome:
    key: str
    #: canonical JSON of the new state; None deletes it (only meaningful when ``state_changed``)
    state: str | None
    state_changed: bool
    timer_upserts: list[Timer] = field(default_factory=list)
    timer_deletes: list[str] = field(default_factory=list)
    productions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    fired: int = 0
    late: int = 0
    #: the earliest event timer that was due but left pending (firing bound hit): holds the output watermark
    held_by: int | None = None


def _canonical(key: str, state: dict[str, Any]) -> str:
    if not isinstance(state, dict):
        raise MillpondError(f"key {key!r}: ctx.state must stay a dict, got {type(state).__name__}")
    try:
        return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MillpondError(f"key {key!r}: ctx.state is not JSON-serialisable: {exc}") from exc


def run_key(comp: Computation, key: str, records: list[Record], state_json: str | None,
            stored: dict[str, Timer], clock: BatchClock) -> KeyOutcome:
    """Records in (event_time, id) order, then due timers in (time, tag) order, until none is due."""
    before = state_json if state_json is not None else "{}"
    timers = dict(stored)
    ctx = Context(key, json.loads(before), timers, clock, frozenset(comp.output_streams))
    late = 0
    for rec in sorted(records, key=lambda r: (r.event_time, r.id)):
        late += rec.late
        comp.process_record(ctx, rec)

    def due() -> list[Timer]:
        return [t for t in timers.values()
                if t.at <= (clock.watermark if t.domain == EVENT else clock.processing_time)]

    fired = 0
    while fired < comp.max_timer_firings:
        ready = due()
        if not ready:
            break
        nxt = min(ready, key=lambda t: (t.at, t.tag))
        del timers[nxt.tag]
        comp.process_timer(ctx, nxt)
        fired += 1
    held = min((t.at for t in due() if t.domain == EVENT), default=None)
    after = _canonical(key, ctx.state)
    upserts = [t for tag, t in sorted(timers.items()) if stored.get(tag) != t]
    deletes = sorted(tag for tag in stored if tag not in timers)
    # ``before`` is canonical (it was written by this function), so unchanged state compares equal
    return KeyOutcome(key, None if after == "{}" else after, after != before, upserts, deletes, ctx.productions,
                      fired, late, held)
