"""The micro-batch job: one Airflow run = one batch, from landing files to panes in Delta.

Steps (each timed into ``phases``): plan (which files, which state versions; written first so a
rerun after a crash recomputes the same batch), ingest + quarantine, dedup, watermark, per-key
windowing/triggers (over new elements and the state of the keys they touch or whose timers are
due: in the job's process and its forked workers, or on Spark with ``mapInArrow`` for batches of
``LOCAL_THRESHOLD`` elements or more), then commits, each tagged with the
application transaction (pipeline, batch) so a retried batch never applies anything twice, with the
``batches`` row last as the commit marker.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.landing import LandingFile, event_schema, file_arrival, parse_file_table
from millpond.lake.lease import Lease
from millpond.lake.objectstore import ObjectStore, StoredObject
from millpond.lake.tables import Tables, Txn, sql_in, sql_ts
from millpond.model.panes import TS, pane_schema
from millpond.model.spec import PipelineSpec, pipeline_from_dict
from millpond.model.state import WINDOWS_SCHEMA, WindowState
from millpond.model.step import BatchClock, Element, Strategy, WindowGroup, process_key, timers
from millpond.model.timeutil import MAX_TS, MIN_TS, parse_duration, to_datetime, to_us
from millpond.model.watermark import advance
from millpond.model.windows import Window
from millpond.runtime import cores

logger = logging.getLogger(__name__)

INPROGRESS = ".inprogress"
#: below this many new elements the per-key step runs in the driver (same code, no Spark job). On one
#: 2-core machine the driver path was faster at every size measured (up to 1M elements, see bench/);
#: on a cluster, lower it (``MILLPOND_LOCAL_THRESHOLD``) so Spark spreads the per-key step.
LOCAL_THRESHOLD = int(os.environ.get("MILLPOND_LOCAL_THRESHOLD", "1000000"))
#: up to this many ids/keys a SQL IN list (file pruning); above, a scan probed in Arrow
SMALL_IN_LIST = 200
#: the per-key step turns this many elements (+ state rows) at a time into Python objects, and assembles
#: their output into Arrow before the next: a batch's memory grows with its Arrow columns, not beyond
CHUNK_ELEMENTS = 200_000
#: the per-key step's cost of a key and of a stored window, in elements (measured: ~30 us a key, ~1.5 us an
#: element): the weights that split a chunk's keys evenly over the cores (Zipf keys sort hot ones together)
KEY_COST, STATE_ROW_COST = 20, 3
#: ids probed against earlier batches' ``seen_ids`` per call (bounds the Python lists handed over)
SEEN_PROBE_CHUNK = 1_000_000
#: keys without stored windows get their windows formed on columns (``_formed``); off: every key's
#: elements go through the per-element path (``MILLPOND_COLUMNAR_WINDOWS=0``, the reference)
COLUMNAR = os.environ.get("MILLPOND_COLUMNAR_WINDOWS", "1") != "0"
#: the columns of a batch's elements, in ``Element`` field order
EVENT_COLUMNS = ("id", "key", "value", "event_time", "arrival_time")

PLAN_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        ("processing_time", TS),
        ("files", pa.list_(pa.string())),
        ("file_arrivals", pa.list_(pa.int64())),
        ("versions", pa.string()),
    ]
)
QUARANTINE_SCHEMA = pa.schema(
    [("source_file", pa.string()), ("line", pa.int64()), ("raw", pa.string()), ("reason", pa.string()),
     ("batch", pa.int64())]
)
SEEN_SCHEMA = pa.schema([("id", pa.string()), ("event_time", TS), ("batch", pa.int64())])
BATCHES_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        ("processing_time", TS),
        ("watermark", TS),
        ("input_watermark", TS),
        ("max_event_time", TS),
        ("files", pa.int64()),
        ("input", pa.int64()),
        ("accepted", pa.int64()),
        ("duplicates", pa.int64()),
        ("late", pa.int64()),
        ("quarantined", pa.int64()),
        ("panes", pa.int64()),
        ("retractions", pa.int64()),
        ("state_rows_read", pa.int64()),
        ("phases", pa.string()),
        ("versions", pa.string()),
    ]
)
STATE_TABLES = ("windows", "seen_ids")
#: read whole by every batch's plan
BOOKKEEPING_TABLES = ("batches", "ingest_log")
#: compacted once they pass COMPACT_OVER_FILES, so that what a batch pays does not grow with the number
#: of batches: the bookkeeping tables are read whole, and panes gets a file from every batch, while a
#: delta-rs commit's cost grows with the table's file count (measured: an append took 22 ms at 5 files,
#: 66 ms at 400; 23 ms at 400 versions compacted every 11 commits)
COMPACTED_TABLES = (*BOOKKEEPING_TABLES, "panes")
COMPACT_OVER_FILES = 8
#: ``seen_ids`` is read by every batch's dedup (an event-time range that spans its files): once it has
#: more than this many files, the batch's own commit to it replaces them by one file of the ids within
#: the dedup horizon plus its own, from the rows its dedup read anyway (see ``_dedup``)
SEEN_FOLD_OVER_FILES = 4
#: compaction bin-packs the files below this size (delta-rs re-packs the last, unfilled bin each time, so a
#: turn rewrites at most about this much of an output that grows without bound: small, since the batch
#: waits for its upkeep step before committing; files of large batches stand alone); default: 100 MB
COMPACT_TARGET_BYTES = {"panes": 4 << 20}
#: a table's first commits replay about as fast as a checkpoint reads: its turns start at this version
CHECKPOINT_FROM_VERSION = 4
#: the current view's partitions: a batch's MERGE rewrites the hours it touches
CURRENT_PARTITIONS = ("window_end_day", "window_end_hour")
#: above this many (day, hour) partitions in one batch, its MERGE filter names whole days
MAX_PARTITION_CLAUSES = 48
OUTPUT_TABLES = ("panes", "current", "late", "quarantine", "windows", "seen_ids", "ingest_log")


def crash_point(step: str, batch: int) -> None:
    """Fault injection for the exactly-once tests: ``MILLPOND_CRASH_AFTER=<step>`` (and optionally
    ``MILLPOND_CRASH_BATCH=<n>``) kills the process with SIGKILL, no cleanup, right after that commit."""
    if os.environ.get("MILLPOND_CRASH_AFTER") == step and os.environ.get("MILLPOND_CRASH_BATCH", str(batch)) == str(
        batch
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MILLPOND_PAUSE_AFTER") == step:  # a slow run, for the single-writer tests
        time.sleep(float(os.environ.get("MILLPOND_PAUSE_S", "5")))


def committed_versions(tables: Tables, pipeline: str) -> dict[str, int]:
    """Table versions as of the last committed batch: read at these, a reader never sees half a batch."""
    done = tables.read_arrow(pipeline, "batches", schema=BATCHES_SCHEMA, columns=["batch", "versions"])
    if not done.num_rows:
        return {}
    last = max(done.to_pylist(), key=lambda r: r["batch"])
    return json.loads(last["versions"] or "{}")


@dataclass
class BatchResult:
    pipeline: str
    batch: int
    processing_time: datetime
    watermark: datetime | None
    counts: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    #: the data-quality report (millpond.quality.validation.QualityReport) when the batch was validated
    quality: Any = None
    reason: str = ""

    def summary(self) -> str:
        if self.skipped:
            return f"{self.pipeline}: batch at {self.processing_time.isoformat()} skipped: {self.reason}"
        c = self.counts
        return (
            f"{self.pipeline} batch {self.batch} @ {self.processing_time.isoformat()}: watermark "
            f"{self.watermark.isoformat() if self.watermark else '-'}; input {c.get('input', 0)}, accepted "
            f"{c.get('accepted', 0)}, duplicates {c.get('duplicates', 0)}, late {c.get('late', 0)}, "
            f"quarantined {c.get('quarantined', 0)}, panes {c.get('panes', 0)}; "
            + ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
        )


def late_schema(value_type: str) -> pa.Schema:
    return pa.schema(
        [("id", pa.string()), ("key", pa.string()),
         ("value", pa.int64() if value_type == "int" else pa.float64()),
         ("event_time", TS), ("arrival_time", TS), ("reason", pa.string()), ("batch", pa.int64())]
    )


def current_schema(value_type: str) -> pa.Schema:
    return pa.schema(
        [("key", pa.string()), ("window_start", TS), ("window_end", TS),
         ("value", pa.int64() if value_type == "int64" else pa.float64()),
         ("pane_index", pa.int64()), ("timing", pa.string()), ("batch", pa.int64()), ("deleted", pa.bool_())]
    )


def _ts(values: Iterable[int | None]) -> pa.Array:
    return pa.array(list(values), pa.int64()).cast(TS)


def _us_column(table: pa.Table, name: str) -> list[int]:
    return table.column(name).cast(pa.int64()).to_pylist()


class _Timer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        self._t = now


def _concurrently(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Independent reads of different tables at once: each mostly waits on the object store, with the
    GIL released. The first failure is raised after all have finished."""
    if len(calls) <= 1:
        return {k: f() for k, f in calls.items()}
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {k: pool.submit(f) for k, f in calls.items()}
    return {k: f.result() for k, f in futures.items()}


# -- the per-key step, shared by the Spark and the driver paths ------------------------------------
@lru_cache(maxsize=8)
def _strategy(spec_json: str):
    return pipeline_from_dict(json.loads(spec_json)).strategy()


def key_rows(
    spec_json: str, clock: BatchClock, key: str, elements: list[Element], state_rows: list[tuple[int, int, str]],
    groups: list[WindowGroup] | None = None,
) -> list[tuple[str, str, list]]:
    """Run one key; return (row type, key, payload fields) rows (``process_group`` sends them as JSON)."""
    strategy = _strategy(spec_json)
    stored = [WindowState.from_json(Window(s, e), st) for s, e, st in state_rows]
    res = process_key(key, stored, elements, clock, strategy, groups)
    out: list[tuple[str, str, list]] = []
    for p in res.panes:
        out.append(("pane", key, [p.window_start, p.window_end, p.value, p.pane_index, p.timing, p.is_last, p.kind,
                                  p.seq]))
    for ws in res.upserts:
        et, pt = timers(ws, strategy, clock)
        out.append(("state", key, [ws.window.start, ws.window.end, ws.to_json(), et, pt]))
    for w in res.deletes:
        out.append(("delete", key, [w.start, w.end]))
    for w in res.merged_away:
        out.append(("gone", key, [w.start, w.end]))
    for el, reason in res.late:
        out.append(("late", key, [el.id, el.value, el.event_time, el.arrival_time, reason]))
    return out


def process_group(
    spec_json: str, clock: BatchClock, key: str, elements: list[Element], state_rows: list[tuple[int, int, str]],
    groups: list[WindowGroup] | None = None,
) -> list[tuple[str, str, str]]:
    """Run one key; return (row type, key, JSON payload) rows for the driver to commit."""
    return [(rtype, k, json.dumps(payload)) for rtype, k, payload in key_rows(spec_json, clock, key, elements,
                                                                             state_rows, groups)]


def _chunks(offsets: np.ndarray, size: int) -> Iterator[tuple[int, int]]:
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
class _KeyLayout:
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
    def of(cls, events: pa.Table, state: pa.Table) -> _KeyLayout:
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
        return _chunks(self.ev_off + self.st_off, CHUNK_ELEMENTS) if len(self.keys) else iter(())

    def weights(self, lo: int, hi: int) -> np.ndarray:
        """The per-key step's expected cost of each key in the range, in elements."""
        return (KEY_COST + np.diff(self.ev_off[lo:hi + 1]) + STATE_ROW_COST * np.diff(self.st_off[lo:hi + 1]))

    def rows(self, lo: int, hi: int, strategy: Strategy, clock: BatchClock) -> list[KeyInput]:
        """Keys ``lo..hi``, each with its elements (or its windows formed on columns, see ``_formed``) and
        its state rows (start, end, JSON), in table order."""
        ev_off, st_off = self.ev_off, self.st_off
        ev = self.events.take(self.ev_order[ev_off[lo]:ev_off[hi]])
        counts = np.diff(ev_off[lo:hi + 1])
        got = _formed(ev, counts, np.diff(st_off[lo:hi + 1]) == 0, strategy, clock) if COLUMNAR else None
        if got is None:
            by_key: list[list[WindowGroup] | None] = [None] * (hi - lo)
        else:  # the formed keys' elements are in their groups: only the others become objects
            by_key, formed = got
            ev = ev.filter(np.repeat(~formed, counts))
            counts = np.where(formed, 0, counts)
        elements = list(map(Element._make, zip(*(ev.column(c).to_pylist() for c in EVENT_COLUMNS), strict=True)))
        st = self.state.take(self.st_order[st_off[lo]:st_off[hi]])
        st_rows = list(zip(_us_column(st, "window_start"), _us_column(st, "window_end"),
                           st.column("state").to_pylist(), strict=True))
        del ev, st
        e_off = np.concatenate([[0], np.cumsum(counts)]).tolist()
        s_off = (st_off[lo:hi + 1] - st_off[lo]).tolist()
        return [KeyInput(key, elements[e0:e1], by_key[i], st_rows[s0:s1]) for i, (key, (e0, e1), (s0, s1))
                in enumerate(zip(self.keys.slice(lo, hi - lo).to_pylist(), pairwise(e_off), pairwise(s_off),
                                 strict=True))]


class KeyInput(NamedTuple):
    """One key's input to the per-key step: elements, or windows already formed on columns."""

    key: str
    elements: list[Element]
    groups: list[WindowGroup] | None
    state_rows: list[tuple[int, int, str]]


def _formed(ev: pa.Table, counts: np.ndarray, stateless: np.ndarray, strategy: Strategy, clock: BatchClock
            ) -> tuple[list[list[WindowGroup] | None], np.ndarray] | None:
    """Windows formed on columns for the keys with elements, no stored windows and no late element: steps
    1-3 of ``engine.process_key`` (assign, merge, group in arrival order) without an object per element.
    Returns (each key's groups or None, which keys were formed), or None where the window function cannot
    assign on columns. The per-element path stays the reference (``tests/test_fast_paths.py``)."""
    wfn, lateness, w_in = strategy.window_fn, strategy.allowed_lateness, clock.input_watermark
    key = np.repeat(np.arange(len(counts)), counts)
    ts = pc.cast(ev.column("event_time"), pa.int64()).to_numpy()
    assigned = wfn.assign_columns(ts)
    if assigned is None:
        return None
    start, end = assigned
    # an element is late if its window's garbage-collection time is at or behind the input watermark
    forever = MAX_TS - lateness
    late = np.where(end < forever, end <= w_in - lateness, MAX_TS <= w_in)
    formed = stateless & (counts > 0) & (np.bincount(key[late], minlength=len(counts)) == 0)
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
    values = ev.column("value").take(order).to_pylist()
    first_arrival = pc.cast(arrival, pa.int64()).to_numpy()[order[firsts]].tolist()
    bounds = np.append(firsts, len(k)).tolist()
    windows = list(map(Window, s[firsts].tolist(), e[firsts].tolist()))
    groups = [WindowGroup(w, values[a:b], t) for w, (a, b), t in zip(windows, pairwise(bounds), first_arrival,
                                                                       strict=True)]
    # each formed key's windows: a slice of ``groups`` (keys ascending, each key's windows by start)
    per_key = np.searchsorted(k[firsts], np.arange(len(counts) + 1)).tolist()
    by_key = [groups[per_key[i]:per_key[i + 1]] if f else None for i, f in enumerate(formed.tolist())]
    return by_key, formed


def _current_rows(panes: list[tuple], gone: list[tuple[str, int, int]], discarding: bool) -> list[tuple]:
    """The current view's rows for whole keys: latest value per (key, window) (every value pane when
    discarding); merged-away sessions deleted. Panes are (key, start, end, value, index, timing, ...) in
    emission order."""
    values = [p for p in panes if p[7] == "value"]
    if discarding:
        rows = [(p[0], p[1], p[2], p[3], p[4], p[5], False) for p in values]
    else:
        latest: dict[tuple[str, int, int], tuple] = {}
        for p in values:
            latest[(p[0], p[1], p[2])] = p
        rows = [(p[0], p[1], p[2], p[3], p[4], p[5], False) for p in latest.values()]
        rows += [(k, s, e, None, -1, "", True) for k, s, e in gone if (k, s, e) not in latest]
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[4]))
    return rows


class _Assembly:
    """The per-key step's output, assembled into Arrow tables chunk by chunk.

    ``add`` takes the rows (``key_rows``) of whole keys, keys ascending from call to call: every batch-wide
    order (panes by key then emission, with ``seq`` numbered batch-wide; state rows and the current view
    by key and window; late rows by key) is then the concatenation of the chunks' orders."""

    def __init__(self, batch: int, clock: BatchClock, value_type: str, pane_type: str, discarding: bool) -> None:
        self.batch, self.clock, self.discarding = batch, clock, discarding
        self.pane_schema, self.late_schema = pane_schema(pane_type), late_schema(value_type)
        self.current_schema = current_schema(pane_type)
        self._parts: dict[str, list[pa.Table]] = {"panes": [], "state": [], "late": [], "current": []}
        self.values = self.retractions = 0

    def _const(self, value: int, n: int, type_: pa.DataType = pa.int64()) -> pa.Array:
        return pa.array(np.full(n, value, np.int64)).cast(type_)

    def add(self, rows: list[tuple[str, str, list]]) -> None:
        panes: list[tuple] = []
        states: dict[tuple[str, int, int], tuple] = {}
        gone: list[tuple[str, int, int]] = []
        late: list[tuple] = []
        for rtype, key, p in rows:
            if rtype == "pane":
                panes.append((key, *p))
            elif rtype == "state":
                states[(key, p[0], p[1])] = (key, p[0], p[1], p[2], p[3], p[4], False)
            elif rtype == "delete":
                # A state row may be both deleted (merged away) and re-created within a batch: keep the upsert.
                states.setdefault((key, p[0], p[1]), (key, p[0], p[1], None, None, None, True))
            elif rtype == "gone":
                gone.append((key, p[0], p[1]))
            elif rtype == "late":
                late.append((p[0], key, *p[1:]))
        panes.sort(key=lambda x: (x[0], x[8]))  # by key, then the order the key emitted them
        if panes:
            n = len(panes)
            col = list(zip(*panes, strict=True))
            kinds = pa.array(col[7], pa.string())
            self.values += pc.sum(pc.equal(kinds, "value")).as_py() or 0
            self.retractions += pc.sum(pc.equal(kinds, "retraction")).as_py() or 0
            ps = self.pane_schema
            self._parts["panes"].append(pa.Table.from_arrays([
                pa.array(col[0], pa.string()), _ts(col[1]), _ts(col[2]), pa.array(col[3], ps.field("value").type),
                pa.array(col[4], pa.int64()), pa.array(col[5], pa.string()), pa.array(col[6], pa.bool_()), kinds,
                self._const(self.batch, n), self._const(self.clock.processing_time, n, TS),
                self._const(self.clock.watermark, n, TS), pa.array(col[8], pa.int64())], schema=ps))
        if states:
            rows_s = [states[k] for k in sorted(states)]
            col = list(zip(*rows_s, strict=True))
            self._parts["state"].append(pa.Table.from_arrays([
                pa.array(col[0], pa.string()), _ts(col[1]), _ts(col[2]), pa.array(col[3], pa.string()), _ts(col[4]),
                _ts(col[5]), self._const(self.batch, len(rows_s)), pa.array(col[6], pa.bool_())],
                schema=WINDOWS_SCHEMA))
        if late:
            col = list(zip(*late, strict=True))
            ls = self.late_schema
            self._parts["late"].append(pa.Table.from_arrays([
                pa.array(col[0], pa.string()), pa.array(col[1], pa.string()), pa.array(col[2], ls.field("value").type),
                _ts(col[3]), _ts(col[4]), pa.array(col[5], pa.string()), self._const(self.batch, len(late))],
                schema=ls))
        current = _current_rows(panes, gone, self.discarding)
        if current:
            col = list(zip(*current, strict=True))
            cs = self.current_schema
            self._parts["current"].append(pa.Table.from_arrays([
                pa.array(col[0], pa.string()), _ts(col[1]), _ts(col[2]), pa.array(col[3], cs.field("value").type),
                pa.array(col[4], pa.int64()), pa.array(col[5], pa.string()), self._const(self.batch, len(current)),
                pa.array(col[6], pa.bool_())], schema=cs))

    def empty_like(self) -> _Assembly:
        """An empty assembly for a range of keys (assembled elsewhere, then ``absorb``-ed in key order)."""
        other = _Assembly.__new__(_Assembly)
        other.__dict__.update(self.__dict__)
        other._parts = {name: [] for name in self._parts}
        other.values = other.retractions = 0
        return other

    def absorb(self, other: _Assembly) -> None:
        """Append another assembly's chunks, which hold keys after this one's."""
        for name, parts in other._parts.items():
            self._parts[name] += parts
        self.values += other.values
        self.retractions += other.retractions

    def finish(self) -> _Assembly:
        """Concatenate the chunks into ``panes``, ``state`` (rows to merge into ``windows``), ``late`` and
        ``current`` tables."""
        def concat(name: str, schema: pa.Schema) -> pa.Table:
            parts, self._parts[name] = self._parts[name], []
            return pa.concat_tables(parts).combine_chunks() if parts else schema.empty_table()

        panes = concat("panes", self.pane_schema)
        self.panes = panes.set_column(panes.schema.get_field_index("seq"), "seq",
                                      pa.array(np.arange(1, panes.num_rows + 1, dtype=np.int64)))
        self.state = concat("state", WINDOWS_SCHEMA)
        self.late = concat("late", self.late_schema)
        self.current = concat("current", self.current_schema)
        return self


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block. The per-key step allocates several objects per
    element and window, which keep the young generations filling up, so the collector keeps rescanning
    the live chunk (a fifth of the step's time) for cycles the step does not make; it runs afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _run_local(spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, sink: _Assembly,
               before_fork: Callable[[], object] | None = None) -> None:
    """The per-key step in the job's process, chunk by chunk; a large chunk's keys are spread over the
    machine's cores (``cores.map_ranges``, which calls ``before_fork`` first), each range made into
    objects and assembled where it runs, then concatenated in key order."""
    layout = _KeyLayout.of(events, state)
    with _gc_paused():
        for lo, hi in layout.chunks():
            def part(a: int, b: int, lo: int = lo) -> _Assembly:
                out = sink.empty_like()
                rows: list[tuple] = []
                for key, els, groups, sts in layout.rows(lo + a, lo + b, _strategy(spec_json), clock):
                    rows += key_rows(spec_json, clock, key, els, sts, groups)
                out.add(rows)
                return out

            for piece in cores.map_ranges(part, layout.weights(lo, hi).tolist(), before_fork=before_fork):
                sink.absorb(piece)


def _run_spark(spark, spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, value_type: str,
               sink: _Assembly) -> None:
    """The per-key step on Spark: elements and state rows hashed by key into partitions, each partition
    processed by one Python call (``mapInArrow``) that lays it out as the driver path does (``_KeyLayout``)
    and runs ``process_group`` key by key."""
    vtype = pa.int64() if value_type == "int" else pa.float64()
    n_ev, n_st = events.num_rows, state.num_rows
    schema = pa.schema([("key", pa.string()), ("id", pa.string()), ("value", vtype), ("event_time", pa.int64()),
                        ("arrival_time", pa.int64()), ("window_start", pa.int64()), ("window_end", pa.int64()),
                        ("state", pa.string())])
    combined = pa.concat_tables([
        pa.table([events.column(c) for c in ("key", "id", "value", "event_time", "arrival_time")]
                 + [pa.nulls(n_ev, f.type) for f in schema][5:], schema=schema),
        pa.table([state.column("key").cast(pa.string())] + [pa.nulls(n_st, f.type) for f in schema][1:5]
                 + [state.column("window_start").cast(pa.int64()), state.column("window_end").cast(pa.int64()),
                    state.column("state").cast(pa.string())], schema=schema),
    ])
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))

    def run(batches):
        batches = list(batches)
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        is_state = table.column("state").is_valid()
        layout = _KeyLayout.of(table.filter(pc.invert(is_state)).select(list(EVENT_COLUMNS)), table.filter(is_state))
        strategy = _strategy(spec_json)
        out: list[tuple] = []
        for lo, hi in layout.chunks():  # the driver path's layout: windows formed on columns where it can
            for key, els, groups, sts in layout.rows(lo, hi, strategy, clock):
                out += process_group(spec_json, clock, key, els, sts, groups)
        yield pa.RecordBatch.from_arrays(
            [pa.array([r[0] for r in out], pa.string()), pa.array([r[1] for r in out], pa.string()),
             pa.array([r[2] for r in out], pa.string())], names=["rtype", "key", "payload"])

    result = (spark.createDataFrame(combined).repartition(partitions, "key")
              .mapInArrow(run, "rtype string, key string, payload string").toArrow())
    del combined
    n = result.num_rows
    if not n:
        return
    # Stable: a key's rows keep the order it emitted them in.
    result = result.take(pc.sort_indices(result.column("key")))
    keys = result.column("key")
    change = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(change) + 1, [n]]).astype(np.int64)
    for lo, hi in _chunks(starts, CHUNK_ELEMENTS):
        part = result.slice(starts[lo], starts[hi] - starts[lo])
        sink.add([(r, k, json.loads(p)) for r, k, p in zip(part.column("rtype").to_pylist(),
                                                           part.column("key").to_pylist(),
                                                           part.column("payload").to_pylist(), strict=True)])


# -- the batch ------------------------------------------------------------------------------------
class MicroBatch:
    """One batch of one pipeline at one processing time."""

    def __init__(self, settings: Settings, spec: PipelineSpec, spark=None, validate: bool = False) -> None:
        self._deferred: list[tuple[str, str, Callable[[], Any]]] | None = None
        #: tables this run has committed to (their snapshots are current: see ``_versions``)
        self._written: set[str] = set()
        #: output tables the last marker found absent: absent still unless this run writes them (see ``_run``)
        self._absent: set[str] = set()
        #: the plan's commit and the batch's upkeep step, running while the planned files are read
        #: (see ``_plan_landed``)
        self._plan_commit: Future | None = None
        self._upkeep: Future | None = None
        #: threads beside the batch (the plan's commit, the upkeep step): made by each ``run``, joined
        #: before its lease goes
        self._background: ThreadPoolExecutor
        self.settings = settings
        self.validate = validate
        self.quality = None
        self.spec = spec
        self.spark = spark
        self.tables = Tables(settings, auto_checkpoint=False)
        self.store = ObjectStore(settings)
        self.name = spec.name

    def txn(self, batch: int) -> Txn:
        return Txn(app_id=f"millpond/{self.name}", version=batch)

    # history -----------------------------------------------------------------------------------
    def committed(self) -> pa.Table:
        return self.tables.read_whole(self.name, "batches", BATCHES_SCHEMA)

    def ingest_log(self) -> pa.Table:
        return self.tables.read_whole(self.name, "ingest_log", PLAN_SCHEMA)

    def plan_of(self, batch: int, log: pa.Table | None = None) -> dict[str, Any] | None:
        log = (self.ingest_log() if log is None else log).filter(pc.field("batch") == batch)
        if not log.num_rows:
            return None
        row = log.to_pylist()[0]
        return {"files": row["files"], "arrivals": row["file_arrivals"], "versions": json.loads(row["versions"])}

    def taken_files(self, log: pa.Table | None = None) -> set[str]:
        log = self.ingest_log() if log is None else log
        return {f for files in log.column("files").to_pylist() for f in files}

    def landing(self) -> list[StoredObject]:
        return list(self.store.list(self.settings.bucket_landing, self.spec.source_prefix))

    def pending_files(self, processing_time: int, log: pa.Table | None = None,
                      listing: list[StoredObject] | None = None) -> tuple[list[LandingFile], int | None]:
        """Finished files to take now, and the arrival of the oldest file still being written."""
        taken = self.taken_files(log)
        out = []
        unfinished: list[int] = []
        for obj in self.landing() if listing is None else listing:
            arrival = file_arrival(obj)
            if arrival >= processing_time:
                continue
            if obj.key.endswith(INPROGRESS):
                unfinished.append(arrival)
            elif obj.key not in taken and obj.key.endswith((".jsonl", ".json")):
                out.append(LandingFile(obj.key, arrival, obj.size, obj.etag))
        return sorted(out, key=lambda f: (f.arrival, f.key)), min(unfinished, default=None)

    # the run -----------------------------------------------------------------------------------
    def run(self, processing_time: datetime | int | str, watermark: datetime | int | str | None = None) -> BatchResult:
        self.lease = Lease.acquire(self.settings, self.name)
        self._background = ThreadPoolExecutor(max_workers=2)
        try:
            return self._run(processing_time, watermark)
        finally:
            self._background.shutdown(wait=True)  # no commit left running behind an error or the lease
            self._plan_commit = self._upkeep = None
            self.lease.release()

    def _step(self, name: str, write: Callable[[], Any], table: str | None = None) -> None:
        """One commit: only while this run still holds the lease; a crash point after it.

        Between the plan and the marker, commits are deferred and then run concurrently, one thread
        per table (see ``_flush``)."""
        if self._deferred is not None:
            self._deferred.append((name, table or name, write))
            return
        self._commit_now(name, write, table or name)

    def _commit_now(self, name: str, write: Callable[[], Any], table: str) -> None:
        self.lease.check()
        write()
        self._written.add(table)
        crash_point(name, self.batch)

    def _flush(self, tables: Sequence[str] = ()) -> dict[str, int | None]:
        """Run the deferred commits: each table's in order, different tables in parallel. They are
        independent (each is idempotent by the batch's transaction id, and readers only trust versions
        named by the marker), so their order does not matter; a crash leaves a subset, which the rerun
        completes. The first failure is raised after every started commit has finished.

        Meanwhile the versions of ``tables`` that this run does not write are read, for the marker."""
        deferred, self._deferred = self._deferred or [], None
        by_table: dict[str, list[tuple[str, str, Callable[[], Any]]]] = {}
        for name, table, write in deferred:
            by_table.setdefault(table, []).append((name, table, write))
        probe = [n for n in tables if n not in by_table and n not in self._written and n not in self._absent]

        def run(steps: list[tuple[str, str, Callable[[], Any]]]) -> None:
            for name, table, write in steps:
                self._commit_now(name, write, table)

        with ThreadPoolExecutor(max_workers=max(1, len(by_table) + len(probe))) as pool:
            futures = [pool.submit(run, steps) for steps in by_table.values()]
            probes = {n: pool.submit(self.tables.version, self.name, n) for n in probe}
        for f in futures:
            f.result()
        return {**{n: None for n in tables if n in self._absent and n not in self._written},
                **{n: f.result() for n, f in probes.items()}}

    def _run(self, processing_time: datetime | int | str, watermark: datetime | int | str | None) -> BatchResult:
        P = to_us(processing_time)
        t = _Timer()
        self._written = set()
        # What the plan may need, read at once: the history, the landing files, the state versions
        # (a rerun of a crashed batch uses its plan's versions instead).
        state_tables = {f"version:{name}": (lambda name=name: self.tables.version(self.name, name))
                        for name in self.state_tables}
        found = _concurrently({"done": self.committed, "log": self.ingest_log, "landing": self.landing,
                               **state_tables})
        done = found["done"]
        prior = done.filter(pc.field("processing_time") == pa.scalar(P, pa.int64()).cast(TS))
        if prior.num_rows:
            row = prior.to_pylist()[0]
            return BatchResult(self.name, row["batch"], to_datetime(P), row["watermark"], skipped=True,
                               reason="already committed")
        last = max(done.column("batch").to_pylist(), default=0)
        prev = done.filter(pc.field("batch") == last).to_pylist()[0] if last else None
        if prev and to_us(prev["processing_time"]) > P:
            # Batches commit in processing-time order: a later batch already took this interval's files,
            # so re-running it (an overlapping backfill, a late retry) has nothing left to do.
            return BatchResult(self.name, last, to_datetime(P), prev["watermark"], skipped=True,
                               reason=f"a later batch ({prev['processing_time'].isoformat()}) is already committed")
        batch = self.batch = last + 1
        txn = self.txn(batch)
        w_in = to_us(prev["watermark"]) if prev else MIN_TS
        max_et_prev = to_us(prev["max_event_time"]) if prev and prev["max_event_time"] is not None else None

        # Plan: committed first; a rerun of a crashed batch finds it and redoes exactly the same work.
        # Its commit runs while the planned files are read and deduplicated (nothing else commits
        # before it has landed, and forked workers never start beside it).
        plan = self.plan_of(batch, found["log"])
        # Output tables the last marker found absent need no probe for this one (~10 ms each, more beside
        # the commits): only a batch creates them, holding the lease, and its marker follows all its
        # commits; before the first marker, only the plan's table can exist. Not on a rerun: the
        # crashed attempt may have created one.
        self._absent = set()
        if plan is None:
            self._absent = ({n for n, v in json.loads(prev["versions"] or "{}").items() if v is None} if prev
                            else set(self.output_tables) - {"ingest_log"})
        if plan is None:
            files, oldest_pending = self.pending_files(P, found["log"], found["landing"])
            versions = {name: found[f"version:{name}"] for name in self.state_tables}
            versions["oldest_pending"] = oldest_pending
            plan = {"files": [f.key for f in files], "arrivals": [f.arrival for f in files], "versions": versions}
            log_row = pa.Table.from_arrays([
                pa.array([batch], pa.int64()), _ts([P]), pa.array([plan["files"]], pa.list_(pa.string())),
                pa.array([plan["arrivals"]], pa.list_(pa.int64())),
                pa.array([json.dumps(versions, sort_keys=True)])], schema=PLAN_SCHEMA)
            self._plan_commit = self._background.submit(self._commit_now, "ingest_log", lambda: self.tables.append(
                self.name, "ingest_log", log_row, txn=txn), "ingest_log")
        # Table upkeep (one step a batch) runs while the batch reads and computes, after the plan has
        # pinned its versions; the batch's own commits wait for it (``_upkeep_landed``), and a step on
        # ingest_log waits for the plan's commit.
        turns = self.upkeep_turns()
        turn = turns[batch % len(turns)]
        first = self._plan_commit if turn[1] == "ingest_log" else None
        self._upkeep = self._background.submit(self._maintain, batch, turn, first)
        t.lap("plan")

        # Ingest: read and parse the planned files (in parallel), quarantine bad rows.
        good, bad = self._read(plan, P)
        t.lap("ingest")

        # Dedup: within the batch, then against ids seen by earlier batches; ``kept``: the earlier ids
        # within the dedup horizon, when this batch's commit is to replace seen_ids' files (see _dedup).
        seen_version = plan["versions"].get("seen_ids")
        accepted, kept = self._dedup(good, seen_version, w_in)
        duplicates = good.num_rows - accepted.num_rows
        del good
        t.lap("dedup")

        # Watermark: the policy's candidate, never moving backwards.
        event_times = accepted.column("event_time")
        max_et = max(([pc.max(event_times).as_py()] if accepted.num_rows else [])
                     + ([max_et_prev] if max_et_prev is not None else []), default=None)
        if watermark is not None:
            candidate = to_us(watermark)
        else:
            policy = self.spec.watermark_policy
            # arrival - event time per element: only the percentile policy reads them
            delays = (pc.subtract(accepted.column("arrival_time"), event_times).to_pylist()
                      if policy.kind == "percentile" else None)
            candidate = policy.candidate(
                batch_index=batch - 1, processing_time=P, max_event_time=max_et,
                oldest_pending=plan["versions"].get("oldest_pending"), delays=delays)
            del delays
        w_new = advance(w_in, candidate)
        clock = BatchClock(batch=batch, processing_time=P, input_watermark=w_in, watermark=w_new)
        t.lap("watermark")

        self._deferred = []
        outputs = self.process(batch, txn, clock, accepted, plan, t)
        name = self.name
        if bad:
            self._step("quarantine", lambda: self.tables.append(name, "quarantine", pa.table(
                {"source_file": [b[0] for b in bad], "line": pa.array([b[1] for b in bad], pa.int64()),
                 "raw": [b[2] for b in bad], "reason": [b[3] for b in bad],
                 "batch": pa.array([batch] * len(bad), pa.int64())}, schema=QUARANTINE_SCHEMA), txn=txn))
        if accepted.num_rows:
            own = pa.table({"id": accepted.column("id"), "event_time": event_times.cast(TS),
                            "batch": pa.array(np.full(accepted.num_rows, batch, np.int64))}, schema=SEEN_SCHEMA)
            if kept is None:
                self._step("seen_ids", lambda: self.tables.append(name, "seen_ids", own, txn=txn, unique=["id"]))
            else:  # ids expire here: older ones are dropped with the files that held them
                rows = pa.concat_tables([kept.select(SEEN_SCHEMA.names).cast(SEEN_SCHEMA), own]).sort_by("event_time")
                self._step("seen_ids", lambda: self.tables.replace(name, "seen_ids", rows, own, seen_version, txn=txn,
                                                                   unique=["id"]))
        self._plan_landed()
        t.lap("commit")
        self._upkeep_landed()
        t.lap("maintain")  # what the batch waited for its upkeep step
        probed = self._flush(self.output_tables)
        t.lap("commit")
        counts = {"files": len(plan["files"]), "input": accepted.num_rows + duplicates + len(bad),
                  "accepted": accepted.num_rows, "duplicates": duplicates, "quarantined": len(bad),
                  "late": 0, "panes": 0, "retractions": 0, "state_rows_read": 0, **outputs}
        marker = {"batch": batch, "processing_time": P, "watermark": w_new, "input_watermark": w_in,
                  "max_event_time": max_et, **counts,
                  "phases": json.dumps({k: round(v, 4) for k, v in t.phases.items()}),
                  "versions": json.dumps(self._versions(self.output_tables, probed), sort_keys=True)}
        arrays = [(_ts([marker[f.name]]) if f.type == TS else pa.array([marker[f.name]], f.type))
                  for f in BATCHES_SCHEMA]
        row = pa.Table.from_arrays(arrays, schema=BATCHES_SCHEMA)
        self._step("batches", lambda: self.tables.append(name, "batches", row, txn=txn))
        t.lap("commit")
        return BatchResult(self.name, batch, to_datetime(P), to_datetime(w_new), counts, t.phases)

    def _versions(self, names: Sequence[str], probed: dict[str, int | None]) -> dict[str, int | None]:
        """The tables' latest versions for the marker. A table this run committed to is at the version
        of its own snapshot (this run holds the lease: no one else commits); the others were read while
        the commits ran (``probed``) or are asked for now, all at once."""
        versions = {n: self.tables.known_version(self.name, n) if n in self._written else probed[n]
                    for n in names if n in self._written or n in probed}
        unknown = [n for n in names if n not in versions or (n in self._written and versions[n] is None)]
        versions |= _concurrently({n: (lambda n=n: self.tables.version(self.name, n)) for n in unknown})
        return {n: versions[n] for n in names}

    def _plan_landed(self) -> None:
        """Wait for the plan's commit (raising its error): before anything else commits, and before the
        per-key step forks workers."""
        if self._plan_commit is not None:
            future, self._plan_commit = self._plan_commit, None
            future.result()

    def _upkeep_landed(self) -> None:
        """Wait for the upkeep step: before the batch's commits, and before the per-key step forks."""
        if self._upkeep is not None:
            future, self._upkeep = self._upkeep, None
            future.result()

    def upkeep_turns(self) -> list[tuple[str, str]]:
        """The cycle of upkeep steps, one per batch: compact each of COMPACTED_TABLES (if it has more
        than COMPACT_OVER_FILES files), checkpoint each table. One cycle bounds both what a batch pays
        and how long a table waits: a table's log tail and a compacted table's file count stay under a
        cycle's length. (Compactions and checkpoints on separate rotations collided: every 8 batches
        a compaction took the turn of the same checkpoint, and those tables were never checkpointed.)"""
        tables = sorted(set(self.output_tables) | set(self.state_tables) | set(BOOKKEEPING_TABLES))
        return [("compact", t) for t in COMPACTED_TABLES] + [("checkpoint", t) for t in tables]

    def _maintain(self, batch: int, turn: tuple[str, str], first: Future | None = None) -> None:
        """Table upkeep, one step of ``upkeep_turns`` per batch, so that no batch pays for every table
        at once (with delta-rs's own every-10-commits checkpoints, every table wrote one in the same
        batch, every 10th batch). It changes no rows a reader sees, so it runs beside the batch, which
        has pinned the versions it reads. (``seen_ids`` is compacted by the batches' own commits to it, see
        ``_seen_keep_from``.) Best-effort: a failed step waits for its next turn. ``first``: a commit to
        the same table that must land before (one writer per table at a time)."""
        if first is not None:
            wait([first])
        name = self.name
        op, table = turn
        try:
            if op == "compact":
                done = self.tables.compact(name, table, over_files=COMPACT_OVER_FILES,
                                           target_size=COMPACT_TARGET_BYTES.get(table))
                if done:
                    return
            # (a compaction turn with nothing to compact checkpoints; a log of a few commits needs none)
            self.tables.checkpoint(name, table, min_version=CHECKPOINT_FROM_VERSION)
        except MillpondError as exc:
            logger.warning("%s: table upkeep skipped in batch %d: %s", name, batch, exc)

    # the windowing step ------------------------------------------------------------------------
    output_tables: tuple[str, ...] = OUTPUT_TABLES
    #: tables whose versions the plan pins (reads of state use them); a subclass adds its own
    state_tables: tuple[str, ...] = STATE_TABLES

    def process(self, batch: int, txn: Txn, clock: BatchClock, accepted: pa.Table, plan: dict[str, Any],
                t: _Timer) -> dict[str, int]:
        """Windows, triggers and panes for the batch's elements (``accepted``: a table of EVENT_COLUMNS);
        commits its own outputs (a MillWheel computation replaces this step, see ``millpond.runtime.computation``).
        Returns counts for the marker."""
        state = self._state(plan["versions"].get("windows"), accepted, clock)
        self._plan_landed()
        spec_json = json.dumps(self.spec.raw, sort_keys=True, default=str)
        out = _Assembly(batch, clock, self.spec.value_type, self.spec.pane_value_type,
                        self.spec.mode.value == "discarding")
        if self.spark is not None and accepted.num_rows >= LOCAL_THRESHOLD:
            _run_spark(self.spark, spec_json, clock, accepted, state, self.spec.value_type, out)
        else:
            _run_local(spec_json, clock, accepted, state, out, before_fork=self._upkeep_landed)
        out.finish()
        t.lap("windowing")
        counts = self._commit(batch, txn, clock, out, accepted, t)
        counts["state_rows_read"] = state.num_rows
        return counts

    def _read(self, plan: dict[str, Any], P: int) -> tuple[pa.Table, list[tuple]]:
        """The planned files' elements as one table (files in key order, each in line order: a stable
        sort by arrival then orders by (arrival, file, line)) and the quarantined rows."""
        def one(item: tuple[str, int]) -> tuple[pa.Table, list[tuple]]:
            key, arrival = item
            data = self.store.get_bytes(self.settings.bucket_landing, key)
            return parse_file_table(key, data, value_type=self.spec.value_type, file_arrival_us=arrival,
                                    processing_time=P)

        parts: dict[str, pa.Table] = {}
        bad: list[tuple] = []
        with ThreadPoolExecutor(max_workers=8) as pool:
            for key, (g, b) in zip(plan["files"], pool.map(one, zip(plan["files"], plan["arrivals"], strict=True)),
                                   strict=True):
                parts[key] = g
                bad += b
        if not parts:
            return event_schema(self.spec.value_type).empty_table(), bad
        return pa.concat_tables([parts[k] for k in sorted(parts)]), bad

    def _seen_keep_from(self, w_in: int, seen_version: int | None) -> int | None:
        """Whether this batch replaces seen_ids' files (it has more than SEEN_FOLD_OVER_FILES at the
        pinned version), and if so from which event time on earlier ids are kept: those within the dedup
        horizon of the input watermark (a re-delivery older than that is beyond allowed lateness anyway)."""
        horizon = self.dedup_horizon()
        if seen_version is None or horizon is None or w_in - horizon <= 0:
            return None
        files = self.tables.file_count(self.name, "seen_ids", version=seen_version)
        return w_in - horizon if files > SEEN_FOLD_OVER_FILES else None

    def _dedup(self, good: pa.Table, seen_version: int | None, w_in: int) -> tuple[pa.Table, pa.Table | None]:
        """Within the batch the first by (arrival, file, line) of each id wins; ids accepted by earlier
        batches are duplicates. The accepted elements, in (arrival, file, line) order; and, when the
        batch is to replace seen_ids' files (``_seen_keep_from``), the earlier ids it keeps (else None),
        taken by the same read."""
        n = good.num_rows
        if not n:
            return good, None
        order = pc.sort_indices(good.column("arrival_time")).to_numpy()  # stable (see _read)
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n, dtype=np.int64)
        firsts = pa.table({"id": good.column("id"), "rank": rank}).group_by("id").aggregate([("rank", "min")])
        del rank
        keep = order if firsts.num_rows == n else order[np.sort(firsts.column("rank_min").to_numpy())]
        del firsts, order
        accepted = good.take(keep)
        del keep
        if seen_version is None:  # no earlier batch has accepted anything
            return accepted, None
        seen: set[str] = set()
        kept = None
        ids, event_times = accepted.column("id"), accepted.column("event_time")
        keep_from = self._seen_keep_from(w_in, seen_version)
        if keep_from is not None:
            seen, kept = self._seen_and_kept(seen_version, ids, event_times, keep_from)
        else:
            for lo in range(0, accepted.num_rows, SEEN_PROBE_CHUNK):
                seen |= self._seen(seen_version, ids.slice(lo, SEEN_PROBE_CHUNK).to_pylist(),
                                   event_times.slice(lo, SEEN_PROBE_CHUNK).to_pylist())
        if not seen:
            return accepted, kept
        return accepted.filter(pc.invert(pc.is_in(ids, value_set=pa.array(sorted(seen), pa.string())))), kept

    def _seen_and_kept(self, version: int, ids: pa.ChunkedArray, event_times: pa.ChunkedArray,
                       keep_from: int) -> tuple[set[str], pa.Table]:
        """``_seen`` from one read that also holds the earlier ids from ``keep_from`` on: every row from
        the earlier of the batch's first event time and ``keep_from`` on."""
        first, last = pc.min(event_times).as_py(), pc.max(event_times).as_py()
        ts = pc.field("event_time")
        t = self.tables.read_arrow(self.name, "seen_ids", version=version, schema=SEEN_SCHEMA,
                                   filters=ts >= pa.scalar(min(first, keep_from), pa.int64()).cast(TS))
        kept = t.filter(ts >= pa.scalar(keep_from, pa.int64()).cast(TS))
        t = t.filter((ts >= pa.scalar(first, pa.int64()).cast(TS)) & (ts <= pa.scalar(last, pa.int64()).cast(TS)))
        hits = t.column("id").filter(pc.is_in(t.column("id"), value_set=pc.cast(ids, pa.string()).combine_chunks()))
        return set(hits.to_pylist()), kept

    def _seen(self, version: int | None, ids: list[str], event_times: list[int]) -> set[str]:
        """Ids already accepted by earlier batches. A record id names one event, whose event time does
        not change: only files whose event-time range overlaps the batch's are read (file statistics)."""
        if version is None or not ids:
            return set()
        if len(ids) <= SMALL_IN_LIST:
            where = (f"event_time >= {sql_ts(min(event_times))} AND event_time <= {sql_ts(max(event_times))} AND "
                     + sql_in("id", ids))
            t = self.tables.select(self.name, "seen_ids", where, columns=["id"], version=version)
        else:
            # A long IN list costs more than reading the range's ids (file statistics prune by event time)
            # and probing them in Arrow.
            lo, hi = (pa.scalar(v, pa.int64()).cast(TS) for v in (min(event_times), max(event_times)))
            t = self.tables.read_arrow(self.name, "seen_ids", columns=["id"], version=version,
                                       filters=(pc.field("event_time") >= lo) & (pc.field("event_time") <= hi))
        hits = t.column("id").filter(pc.is_in(t.column("id"), value_set=pa.array(ids, pa.string())))
        return set(hits.to_pylist())

    def dedup_horizon(self) -> int | None:
        """How far behind the watermark a record id must be remembered: past it, a re-delivery is late
        anyway (its window is beyond allowed lateness) and is dropped and counted as late."""
        cfg = self.spec.raw.get("dedup") or {}
        if "horizon" in cfg:
            return parse_duration(cfg["horizon"])
        window = self.spec.window
        span = {"fixed": window.get("size"), "sliding": window.get("size"), "sessions": window.get("gap")}.get(
            window.get("type", "global"))
        return None if span is None else self.spec.allowed_lateness + parse_duration(span)

    def _state(self, version: int | None, accepted: pa.Table, clock: BatchClock) -> pa.Table:
        """The stored windows this batch can change: those whose timers are due, and those of touched
        keys that the key's new elements can reach. Reading every window of a touched key would make
        a batch's cost grow with the live state (all sessions still within allowed lateness)."""
        if version is None:
            return WINDOWS_SCHEMA.empty_table()
        due = f"event_timer <= {sql_ts(clock.watermark)} OR ptime_timer <= {sql_ts(clock.processing_time)}"
        keys = pc.unique(accepted.column("key"))
        if len(keys) <= SMALL_IN_LIST:
            t = self.tables.select(self.name, "windows", f"({due}) OR {sql_in('key', keys.to_pylist())}",
                                   version=version)
        else:
            # Many keys: MERGE-written files hold keys of every range, so statistics cannot prune them and
            # the scan reads the same files either way; probing in Arrow beats a long SQL IN list.
            t = self.tables.select(self.name, "windows", version=version)
        return t.filter(self._reachable(t, accepted, clock))

    def _reachable(self, t: pa.Table, accepted: pa.Table, clock: BatchClock) -> pa.Array:
        """Which stored windows the batch must look at (row order kept): due timers, or a window that
        an element of its key can fall into or merge with. An element at ``e`` reaches the windows
        intersecting ``[e, e + reach]`` (``reach``: the session gap; 0 for fixed and sliding windows,
        which an element reaches only if it lies inside them). A custom window function may merge in ways
        this cannot bound: every window of its touched keys is read."""
        def ints(col: pa.ChunkedArray | pa.Array) -> pa.Array:
            return pc.cast(col, pa.int64())

        due = pc.or_(pc.fill_null(pc.less_equal(ints(t.column("event_timer")), clock.watermark), False),
                     pc.fill_null(pc.less_equal(ints(t.column("ptime_timer")), clock.processing_time), False))
        if not accepted.num_rows:
            return due
        ranges = accepted.group_by("key").aggregate([("event_time", "min"), ("event_time", "max")])
        at = pc.index_in(t.column("key"), value_set=ranges.column("key"))
        kind = self.spec.window.get("type", "global")
        if kind not in ("global", "fixed", "sliding", "sessions"):  # a custom WindowFn: its reach is unknown
            return pc.or_(due, pc.is_valid(at))
        reach = parse_duration(self.spec.window["gap"]) if kind == "sessions" else 0
        lo = ranges.column("event_time_min").take(at)
        hi = pc.add(ranges.column("event_time_max").take(at), reach)
        near = pc.and_(pc.greater_equal(ints(t.column("window_end")), lo),
                       pc.less_equal(ints(t.column("window_start")), hi))
        return pc.or_(due, pc.fill_null(near, False))

    def _commit(self, batch: int, txn: Txn, clock: BatchClock, out: _Assembly, accepted: pa.Table,
                t: _Timer) -> dict[str, int]:
        t.lap("assemble")
        if self.validate:
            self._validate(batch, clock, accepted, out.panes, out.state)
            t.lap("validation")

        name = self.name
        late, panes, state = out.late, out.panes, out.state
        if late.num_rows:
            self._step("late", lambda: self.tables.append(name, "late", late, txn=txn))
        if panes.num_rows:
            self._step("panes", lambda: self.tables.append(name, "panes", panes, txn=txn))
        self._commit_current(batch, txn, out.current)
        if state.num_rows:
            self._step("windows", lambda: self.tables.merge(name, "windows", state,
                on=["key", "window_start", "window_end"], delete_when="s.deleted", txn=txn,
                stats_columns=["key", "window_start", "window_end", "event_timer", "ptime_timer"]))
        return {"late": late.num_rows, "panes": out.values, "retractions": out.retractions}

    def _validate(self, batch: int, clock: BatchClock, accepted: pa.Table, panes: pa.Table, state: pa.Table
                  ) -> None:
        """Great Expectations on what this batch read, will emit and will keep; critical stops it here,
        before anything is published."""
        import pandas as pd

        from millpond.quality.validation import validate_batch

        def col(table: pa.Table, name: str) -> list[Any]:
            return table.column(name).to_pylist()

        def times(table: pa.Table, name: str) -> pd.DatetimeIndex:
            return pd.to_datetime(_us_column(table, name), unit="us", utc=True)

        raw = pd.DataFrame({"id": col(accepted, "id"), "key": col(accepted, "key"), "value": col(accepted, "value"),
                            "event_time": times(accepted, "event_time")})
        pane_df = panes.to_pandas()
        live = state.filter(pc.invert(state.column("deleted")))
        state_df = pd.DataFrame({
            "key": col(live, "key"), "state": col(live, "state"),
            "window_start": times(live, "window_start"), "window_end": times(live, "window_end"),
            "event_timer": times(live, "event_timer"), "ptime_timer": times(live, "ptime_timer"),
            "batch": [batch] * live.num_rows})
        retractions = panes.filter(pc.equal(panes.column("kind"), "retraction"))
        prior = None
        if retractions.num_rows:
            # Only the retracted windows' earlier panes matter: bounding window_start lets file statistics
            # skip old pane files, so this read does not grow with the pane log.
            where = (f"window_start >= {sql_ts(min(_us_column(retractions, 'window_start')))} AND "
                     + sql_in("key", sorted(set(col(retractions, "key")))))
            prior = self.tables.select(self.name, "panes", where, schema=pa.schema([("key", pa.string())])).to_pandas()
        report = validate_batch(self.settings, self.name, batch, raw=raw, panes=pane_df, state=state_df,
                                prior_panes=prior, processing_time=to_datetime(clock.processing_time),
                                window_type=self.spec.window.get("type"))
        self.quality = report
        if not report.ok:
            where = f"; see {report.result_urls[0]}" if report.result_urls else ""
            raise MillpondError(
                f"{self.name} batch {batch} failed critical data-quality checks, nothing was published: "
                + "; ".join(report.critical_failures[:3]) + where
            )

    def _commit_current(self, batch: int, txn: Txn, table: pa.Table) -> None:
        """The current view: latest value per (key, window); merged-away sessions deleted (rows made by
        ``_current_rows``)."""
        if self.spec.mode.value == "discarding":
            on = ["key", "window_start", "window_end", "pane_index"]
        else:
            on = ["key", "window_start", "window_end"]
        if not table.num_rows:
            return

        def merge() -> None:
            existing = self.tables.open(self.name, "current")
            # A view created under an earlier layout (unpartitioned, or by day only) keeps it.
            parts = CURRENT_PARTITIONS if existing is None else tuple(existing.metadata().partition_columns)
            rows, target = _time_partitions(table, parts)
            self.tables.merge(self.name, "current", rows, on=[*parts, *on], delete_when="s.deleted", txn=txn,
                              partition_by=list(parts), target_filter=target)

        self._step("current", merge)  # with the other tables' commits, so the open waits beside them


def _time_partitions(table: pa.Table, parts: Sequence[str]) -> tuple[pa.Table, str | None]:
    """Adds the view's partition columns and the MERGE's target filter naming the partitions the rows
    fall in. By the UTC day and hour of ``window_end``: a batch can only change windows that are still
    live (end + allowed lateness not yet passed by the watermark), so it rewrites the last hours, while a
    partition by ``window_start`` is pinned open by every long session (a hot key's session spans the
    whole stream) and the MERGE rewrote a day that grows batch by batch."""
    if not parts:
        return table, None
    end = table.column("window_end")
    values = {"window_day": pc.cast(table.column("window_start"), pa.date32()),  # views made before end partitions
              "window_end_day": pc.cast(end, pa.date32()), "window_end_hour": pc.hour(end).cast(pa.int32())}
    for name in parts:
        table = table.append_column(name, values[name])
    combos = pa.table({name: table.column(name) for name in parts}).group_by(list(parts)).aggregate([])
    if combos.num_rows > MAX_PARTITION_CLAUSES:  # a long replay: name the days (a superset) instead
        day = parts[0]
        parts, combos = [day], pa.table({day: pc.unique(table.column(day))})
    clauses = []
    for row in sorted(combos.to_pylist(), key=lambda r: tuple(r[n] for n in parts)):
        conds = [f"t.{n} = '{row[n].isoformat()}'" if n.endswith("_day") else f"t.{n} = {row[n]}" for n in parts]
        clauses.append("(" + " AND ".join(conds) + ")")
    return table, " OR ".join(clauses)


def run_batch(settings: Settings, spec: PipelineSpec, processing_time: datetime | int | str, *,
              watermark: datetime | int | str | None = None, spark=None, validate: bool = False) -> BatchResult:
    """One micro-batch of ``spec`` at ``processing_time`` (idempotent; see module docstring).

    ``validate`` runs the Great Expectations suites before anything is committed (the DAGs and
    `millpond run` do; replays skip it unless asked).
    """
    job_cls: type[MicroBatch] = MicroBatch
    if spec.raw.get("computation"):  # a MillWheel computation replaces windowing and triggers
        from millpond.runtime.computation import ComputationBatch

        job_cls = ComputationBatch
    job = job_cls(settings, spec, spark, validate=validate)
    result = job.run(processing_time, watermark)
    result.quality = job.quality
    return result
