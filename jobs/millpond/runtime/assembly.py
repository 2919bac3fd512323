"""The per-key step's output rows, assembled into the batch's Arrow tables chunk by chunk.

``key_rows`` runs one key and returns typed rows (pane, state, delete, gone, late); ``Assembly`` turns whole
keys' rows into the ``panes``, ``windows`` (state), ``late`` and ``current`` tables, keys ascending from call to
call, so every batch-wide order is the concatenation of the chunks' orders."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.schemas import current_schema, late_schema
from millpond.model.clock import BatchClock
from millpond.model.panes import TS, pane_schema
from millpond.model.spec import pipeline_from_dict
from millpond.model.state import WINDOWS_SCHEMA, WindowState
from millpond.model.step import Element, WindowGroup, process_key, timers
from millpond.model.step_columns import Fired
from millpond.model.windows import Window


class FiredKeys(NamedTuple):
    """Keys of a range whose windows fired on columns (``model.step_columns``): each window's key and bounds, in the
    order ``process_key`` fires them (by key, then window), and what the step did with them (``Fired``)."""

    keys: pa.Array
    start: np.ndarray
    end: np.ndarray
    fired: Fired


def ts_array(values: Iterable[int | None] | np.ndarray) -> pa.Array:
    if isinstance(values, np.ndarray):
        return pa.array(values.astype(np.int64, copy=False)).cast(TS)
    return pa.array(list(values), pa.int64()).cast(TS)


def us_column(table: pa.Table, name: str) -> list[int]:
    return table.column(name).cast(pa.int64()).to_pylist()


@lru_cache(maxsize=8)
def strategy_of(spec_json: str):
    return pipeline_from_dict(json.loads(spec_json)).strategy()


def key_rows(
    spec_json: str, clock: BatchClock, key: str, elements: list[Element], state_rows: list[tuple[int, int, str]],
    groups: list[WindowGroup] | None = None,
) -> list[tuple[str, str, list]]:
    """Run one key; return its (row type, key, payload fields) rows for an ``Assembly``."""
    strategy = strategy_of(spec_json)
    stored = [WindowState.from_json(Window(s, e), st) for s, e, st in state_rows]
    try:
        res = process_key(key, stored, elements, clock, strategy, groups)
    except Exception as exc:
        exc.add_note(f"millpond: key {key!r}")  # for the batch's one-line failure (``runtime.failure``)
        raise
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


def _current_rows(panes: list[tuple], gone: list[tuple[str, int, int]], discarding: bool) -> list[tuple]:
    """The current view's rows for whole keys: latest value per (key, window) (every value pane when
    discarding); merged-away sessions deleted: when merged without retractions, or when their retraction is
    emitted (a session retracted with no new value of its own), so that the view is always what the panes
    told a consumer. Panes are (key, start, end, value, index, timing, ...) in emission order."""
    values = [p for p in panes if p[7] == "value"]
    if discarding:
        rows = [(p[0], p[1], p[2], p[3], p[4], p[5], False) for p in values]
    else:
        latest: dict[tuple[str, int, int], tuple] = {}
        for p in values:
            latest[(p[0], p[1], p[2])] = p
        rows = [(p[0], p[1], p[2], p[3], p[4], p[5], False) for p in latest.values()]
        retracted = {(p[0], p[1], p[2]) for p in panes if p[7] == "retraction"}
        dropped = set(gone) | retracted
        rows += [(k, s, e, None, -1, "", True) for k, s, e in sorted(dropped) if (k, s, e) not in latest]
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[4]))
    return rows


class Assembly:
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

    def add(self, rows: list[tuple[str, str, list]], fired: list[FiredKeys] = ()) -> None:
        """Whole keys' rows (``key_rows``), keys ascending from call to call; ``fired``: more keys of the same range,
        whose windows fired on columns (``FiredKeys``), merged in key order."""
        tables = self._row_tables(rows)
        for keys in fired:
            for name, table in self._fired_tables(keys).items():
                got = tables.get(name)
                if got is None:
                    tables[name] = table
                elif table.num_rows:  # the keys are apart: a stable sort by key keeps each key's own order
                    both = pa.concat_tables([got, table])
                    tables[name] = both.take(pc.sort_indices(both, [("key", "ascending")]))
        for name in ("panes", "state", "late", "current"):
            if name in tables:
                self._parts[name].append(tables[name])

    def _row_tables(self, rows: list[tuple[str, str, list]]) -> dict[str, pa.Table]:
        out: dict[str, pa.Table] = {}
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
            out["panes"] = (pa.Table.from_arrays([
                pa.array(col[0], pa.string()), ts_array(col[1]), ts_array(col[2]),
                pa.array(col[3], ps.field("value").type),
                pa.array(col[4], pa.int64()), pa.array(col[5], pa.string()), pa.array(col[6], pa.bool_()), kinds,
                self._const(self.batch, n), self._const(self.clock.processing_time, n, TS),
                self._const(self.clock.watermark, n, TS), pa.array(col[8], pa.int64())], schema=ps))
        if states:
            rows_s = [states[k] for k in sorted(states)]
            col = list(zip(*rows_s, strict=True))
            out["state"] = (pa.Table.from_arrays([
                pa.array(col[0], pa.string()), ts_array(col[1]), ts_array(col[2]), pa.array(col[3], pa.string()),
                ts_array(col[4]),
                ts_array(col[5]), self._const(self.batch, len(rows_s)), pa.array(col[6], pa.bool_())],
                schema=WINDOWS_SCHEMA))
        if late:
            col = list(zip(*late, strict=True))
            ls = self.late_schema
            out["late"] = (pa.Table.from_arrays([
                pa.array(col[0], pa.string()), pa.array(col[1], pa.string()), pa.array(col[2], ls.field("value").type),
                ts_array(col[3]), ts_array(col[4]), pa.array(col[5], pa.string()), self._const(self.batch, len(late))],
                schema=ls))
        current = _current_rows(panes, gone, self.discarding)
        if current:
            col = list(zip(*current, strict=True))
            cs = self.current_schema
            out["current"] = (pa.Table.from_arrays([
                pa.array(col[0], pa.string()), ts_array(col[1]), ts_array(col[2]),
                pa.array(col[3], cs.field("value").type),
                pa.array(col[4], pa.int64()), pa.array(col[5], pa.string()), self._const(self.batch, len(current)),
                pa.array(col[6], pa.bool_())], schema=cs))
        return out

    def _fired_tables(self, part: FiredKeys) -> dict[str, pa.Table]:
        """The panes, state rows and current-view rows of windows fired on columns (``model.step_columns``), in the
        order ``key_rows`` gives: by key, then window; a window's retraction before its value pane."""
        f = part.fired
        emitted = np.flatnonzero(f.emitted)
        retract = f.retract[emitted]
        # each emitted window's panes: its retraction (where one is owed), then its value
        rows = np.repeat(emitted, 1 + retract)
        is_value = np.ones(len(rows), bool)
        is_value[(np.cumsum(1 + retract) - 1 - retract)[retract]] = False
        m = len(rows)
        ps, cs = self.pane_schema, self.current_schema
        value_type = ps.field("value").type
        at = rows.tolist()
        values = pa.array([f.value[i] if v else f.retracted[i] for i, v in zip(at, is_value.tolist(), strict=True)],
                          value_type)
        timing = pa.array(f.timing[rows].tolist(), pa.string())
        n_values = len(emitted)
        self.values += n_values
        self.retractions += m - n_values
        panes = pa.Table.from_arrays([
            part.keys.take(pa.array(rows)), ts_array(part.start[rows]), ts_array(part.end[rows]), values,
            pa.array(f.pane_index[rows] - (~is_value).astype(np.int64)), timing, pa.array(f.is_last[rows] & is_value),
            pa.array(np.where(is_value, "value", "retraction").tolist(), pa.string()), self._const(self.batch, m),
            self._const(self.clock.processing_time, m, TS), self._const(self.clock.watermark, m, TS),
            self._const(0, m)], schema=ps)
        shown = pa.array(np.flatnonzero(is_value))
        current = pa.Table.from_arrays([
            panes.column("key").take(shown), panes.column("window_start").take(shown),
            panes.column("window_end").take(shown), values.take(shown).cast(cs.field("value").type),
            panes.column("pane_index").take(shown), timing.take(shown), self._const(self.batch, n_values),
            pa.array(np.zeros(n_values, bool))], schema=cs)
        changed = np.flatnonzero(f.upsert | f.delete)
        kept = f.upsert[changed]
        has_ptime = kept & f.has_ptime_timer[changed]
        state = pa.Table.from_arrays([
            part.keys.take(pa.array(changed)), ts_array(part.start[changed]), ts_array(part.end[changed]),
            f.state.take(pa.array(changed)),
            pa.array(np.where(kept, f.event_timer[changed], 0), mask=~kept).cast(TS),
            pa.array(np.where(has_ptime, f.ptime_timer[changed], 0), mask=~has_ptime).cast(TS),
            self._const(self.batch, len(changed)), pa.array(f.delete[changed])], schema=WINDOWS_SCHEMA)
        return {"panes": panes, "state": state, "current": current}

    def empty_like(self) -> Assembly:
        """An empty assembly for a range of keys (assembled elsewhere, then ``absorb``-ed in key order)."""
        other = Assembly.__new__(Assembly)
        other.__dict__.update(self.__dict__)
        other._parts = {name: [] for name in self._parts}
        other.values = other.retractions = 0
        return other

    def absorb(self, other: Assembly) -> None:
        """Append another assembly's chunks, which hold keys after this one's."""
        for name, parts in other._parts.items():
            self._parts[name] += parts
        self.values += other.values
        self.retractions += other.retractions

    def finish(self) -> Assembly:
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

