"""Compute: the stored windows a batch can change, and the per-key step over them and the batch's elements
(windows, triggers, accumulation: ``model.step``) on the batch's engine."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.sql import sql_in, sql_ts
from millpond.model.clock import BatchClock
from millpond.model.state import WINDOWS_SCHEMA
from millpond.runtime.assembly import Assembly
from millpond.runtime.engines.local import KeysOnCores

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: up to this many ids/keys a SQL IN list (file pruning); above, a scan probed in Arrow
SMALL_IN_LIST = 200


def compute(job: BatchContext, batch: int, clock: BatchClock, accepted: pa.Table, plan: dict[str, Any]
            ) -> tuple[Assembly, int]:
    """The batch's panes, state changes, late rows and current-view rows; and how many state rows it read."""
    state = stored_state(job, plan["versions"].get("windows"), accepted, clock)
    job.commits.plan_landed()
    spec_json = json.dumps(job.spec.raw, sort_keys=True, default=str)
    out = Assembly(batch, clock, job.spec.value_type, job.spec.pane_value_type, job.spec.mode.value == "discarding")
    KeysOnCores(job.settings, before_fork=job.commits.upkeep_landed).run(spec_json, clock, accepted, state, out)
    return out.finish(), state.num_rows


def stored_state(job: BatchContext, version: int | None, accepted: pa.Table, clock: BatchClock) -> pa.Table:
    """The stored windows this batch can change: those whose timers are due, and those of touched
    keys that the key's new elements can reach. Reading every window of a touched key would make
    a batch's cost grow with the live state (all sessions still within allowed lateness)."""
    if version is None:
        return WINDOWS_SCHEMA.empty_table()
    due = f"event_timer <= {sql_ts(clock.watermark)} OR ptime_timer <= {sql_ts(clock.processing_time)}"
    keys = pc.unique(accepted.column("key"))
    if len(keys) <= SMALL_IN_LIST:
        t = job.tables.select(job.name, "windows", f"({due}) OR {sql_in('key', keys.to_pylist())}",
                               version=version)
    else:
        # Many keys: MERGE-written files hold keys of every range, so statistics cannot prune them and
        # the scan reads the same files either way; probing in Arrow beats a long SQL IN list.
        t = job.tables.select(job.name, "windows", version=version)
    return t.filter(reachable(job, t, accepted, clock))

def reachable(job: BatchContext, t: pa.Table, accepted: pa.Table, clock: BatchClock) -> pa.Array:
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
    reach = job.strategy.window_fn.reach()
    if reach is None:  # a window function whose reach is unknown: every window of a touched key
        return pc.or_(due, pc.is_valid(at))
    lo = ranges.column("event_time_min").take(at)
    hi = pc.add(ranges.column("event_time_max").take(at), reach)
    near = pc.and_(pc.greater_equal(ints(t.column("window_end")), lo),
                   pc.less_equal(ints(t.column("window_start")), hi))
    return pc.or_(due, pc.fill_null(near, False))
