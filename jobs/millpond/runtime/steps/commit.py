"""Commit: the batch's outputs, each table once under the batch's application transaction, then the
marker (the ``batches`` row naming every table's version) last."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.schemas import (
    BATCHES_SCHEMA,
    CURRENT_PARTITIONS,
    QUARANTINE_SCHEMA,
    SEEN_SCHEMA,
    WINDOWS_STATS_COLUMNS,
)
from millpond.lake.tables import Txn
from millpond.model.clock import BatchClock
from millpond.model.panes import TS
from millpond.model.versions import STATE_FORMAT
from millpond.runtime.assembly import Assembly, ts_array
from millpond.runtime.commits import PhaseTimer
from millpond.runtime.steps import dedup
from millpond.runtime.steps.versions import spec_record

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: above this many (day, hour) partitions in one batch, its MERGE filter names whole days
MAX_PARTITION_CLAUSES = 48


def commit_outputs(job: BatchContext, txn: Txn, out: Assembly) -> dict[str, int]:
    """Late rows, panes, the current view and the window state; counts for the marker."""
    name, step = job.name, job.commits.step
    late, panes, state = out.late, out.panes, out.state
    if late.num_rows:
        step("late", lambda: job.tables.append(name, "late", late, txn=txn))
    if panes.num_rows:
        step("panes", lambda: job.tables.append(name, "panes", panes, txn=txn))
    commit_current(job, txn, out.current)
    if state.num_rows:
        step("windows", lambda: job.tables.merge(
            name, "windows", state, on=["key", "window_start", "window_end"], delete_when="s.deleted", txn=txn,
            stats_columns=WINDOWS_STATS_COLUMNS))
    return {"late": late.num_rows, "panes": out.values, "retractions": out.retractions}


def commit_inputs(job: BatchContext, batch: int, txn: Txn, bad: list[tuple], accepted: pa.Table,
                  kept: pa.Table | None, seen_version: int | None) -> None:
    """The quarantined rows, and the accepted ids for later batches' dedup (replacing seen_ids' files,
    with the earlier ids still within the horizon, when the dedup step decided so)."""
    name = job.name
    if bad:
        job.commits.step("quarantine", lambda: job.tables.append(name, "quarantine", quarantine_rows(bad, batch),
                                                                 txn=txn))
    if not accepted.num_rows or not dedup.by_id(job):
        return
    own = seen_rows(accepted, batch)
    if kept is None:
        job.commits.step("seen_ids", lambda: job.tables.append(name, "seen_ids", own, txn=txn, unique=["id"]))
    else:  # ids expire here: older ones are dropped with the files that held them
        rows = seen_rows_kept(kept, own)
        job.commits.step("seen_ids", lambda: job.tables.replace(name, "seen_ids", rows, own, seen_version, txn=txn,
                                                                unique=["id"]))


def quarantine_rows(bad: list[tuple], batch: int) -> pa.Table:
    """The ``quarantine`` rows of the batch's bad lines (file, line, raw text, reason)."""
    return pa.table({"source_file": [b[0] for b in bad], "line": pa.array([b[1] for b in bad], pa.int64()),
                     "raw": [b[2] for b in bad], "reason": [b[3] for b in bad],
                     "batch": pa.array([batch] * len(bad), pa.int64())}, schema=QUARANTINE_SCHEMA)


def seen_rows(accepted: pa.Table, batch: int) -> pa.Table:
    """The ``seen_ids`` rows of the batch's accepted elements."""
    return pa.table({"id": accepted.column("id"), "event_time": accepted.column("event_time").cast(TS),
                     "batch": pa.array(np.full(accepted.num_rows, batch, np.int64))}, schema=SEEN_SCHEMA)


def seen_rows_kept(kept: pa.Table, own: pa.Table) -> pa.Table:
    """``seen_ids`` when the batch replaces its files: the earlier ids within the horizon, then its own."""
    return pa.concat_tables([kept.select(SEEN_SCHEMA.names).cast(SEEN_SCHEMA), own]).sort_by("event_time")


def commit_marker(job: BatchContext, txn: Txn, clock: BatchClock, max_et: int | None, counts: dict[str, Any],
                  timer: PhaseTimer, probed: dict[str, int | None]) -> None:
    """The ``batches`` row, last: the batch's watermark, counts, phase times and every table's version."""
    marker = {"batch": clock.batch, "processing_time": clock.processing_time, "watermark": clock.watermark,
              "input_watermark": clock.input_watermark, "max_event_time": max_et, **counts,
              "phases": json.dumps({k: round(v, 4) for k, v in timer.phases.items()}),
              "versions": json.dumps(job.commits.versions(job.output_tables, probed), sort_keys=True),
              "spec": spec_record(job.spec.raw), "state_format": STATE_FORMAT}
    arrays = [(ts_array([marker[f.name]]) if f.type == TS else pa.array([marker[f.name]], f.type))
              for f in BATCHES_SCHEMA]
    row = pa.Table.from_arrays(arrays, schema=BATCHES_SCHEMA)
    job.commits.step("batches", lambda: job.tables.append(job.name, "batches", row, txn=txn))


def commit_current(job: BatchContext, txn: Txn, table: pa.Table) -> None:
    """The current view: latest value per (key, window); merged-away sessions deleted (rows made by
    ``_current_rows``)."""
    if job.spec.mode.value == "discarding":
        on = ["key", "window_start", "window_end", "pane_index"]
    else:
        on = ["key", "window_start", "window_end"]
    if not table.num_rows:
        return

    def merge() -> None:
        existing = job.tables.open(job.name, "current")
        # A view created under an earlier layout (unpartitioned, or by day only) keeps it.
        parts = CURRENT_PARTITIONS if existing is None else tuple(existing.metadata().partition_columns)
        rows, target = time_partitions(table, parts)
        job.tables.merge(job.name, "current", rows, on=[*parts, *on], delete_when="s.deleted", txn=txn,
                          partition_by=list(parts), target_filter=target)

    job.commits.step("current", merge)  # with the other tables' commits, so the open waits beside them


def time_partitions(table: pa.Table, parts: Sequence[str]) -> tuple[pa.Table, str | None]:
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
