"""Upstream: a stage's input (``source: {pipeline: NAME, stream: panes}``, ``model.stages``), the panes its
upstream pipelines committed since those it consumed last.

The plan records, per upstream, the range of its ``panes`` versions the batch consumes: from the version
the earlier batches consumed up to (exclusive) to the version named by the upstream's last committed
marker (inclusive), and that marker's watermark. A retried batch finds its plan and reads the same range;
a panes commit of an upstream batch whose marker has not landed yet lies beyond the range and waits for
the next batch. Only the rows the range's commits added are read (``Tables.read_added``: the Delta change
feed, which skips compactions). Each pane becomes one element (``model.stages`` says how); its id names
the upstream, key, window, pane index and kind, so the dedup step drops a pane taken twice. The batch's
input watermark is the least of the upstreams' recorded watermarks (``input_watermark``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.errors import MillpondError
from millpond.lake.landing import event_schema
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.lake.sql import sql_in, sql_ts
from millpond.model.panes import pane_schema
from millpond.model.stages import ALL_KEY, check_upstream
from millpond.model.timeutil import MIN_TS, to_us
from millpond.runtime import rewind

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: up to this many keys a SQL IN list when looking up an accumulating upstream's previous panes
SMALL_IN_LIST = 200


def upstream_marks(job: BatchContext, processing_time: int) -> dict[str, dict[str, Any] | None]:
    """Each upstream's last committed marker at or before the stage's processing time: its batch, watermark
    (us), panes version and semantic spec (None: no such batch yet). Bounded by the processing time, a stage's
    batch reads the same upstream batches whenever it runs (live, late, or in a backfill), as long as its
    upstreams have committed them."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in job.spec.upstream.pipelines:
        epoch, done = _marks_in_one_epoch(job, name, processing_time)
        if not done:
            out[name] = None
            continue
        last = max(done, key=lambda r: r["batch"])
        out[name] = {"batch": last["batch"], "watermark": to_us(last["watermark"]) if last["watermark"] else None,
                     "panes": json.loads(last["versions"] or "{}").get("panes"), "spec": last.get("spec"),
                     "epoch": epoch}
    return out


def _marks_in_one_epoch(job: BatchContext, name: str, processing_time: int) -> tuple[int, list[dict[str, Any]]]:
    """The upstream's markers up to the processing time, and the epoch (rewinds so far) they belong to: the
    epoch is read before and after them, so a rewind that lands in between is not half seen."""
    while True:
        epoch = rewind.epoch(job.tables, name)
        done = [r for r in job.tables.read_whole(name, "batches", BATCHES_SCHEMA).to_pylist()
                if to_us(r["processing_time"]) <= processing_time]
        if rewind.epoch(job.tables, name) == epoch:
            return epoch, done


def consumed(log: pa.Table, batch: int, upstream: str) -> int | None:
    """The upstream panes version that this stage's earlier batches consumed up to (None: nothing yet).
    Every plan of an earlier batch belongs to a committed batch (a batch plans after the previous marker)."""
    done = [json.loads(text).get(f"upstream:{upstream}") for b, text in
            zip(log.column("batch").to_pylist(), log.column("versions").to_pylist(), strict=True)
            if b < batch and text]
    return max((v for v in done if v is not None), default=None)


def plan_upstreams(job: BatchContext, log: pa.Table, batch: int, marks: dict[str, dict[str, Any] | None]
                   ) -> dict[str, Any]:
    """The plan's entries for the upstreams: ``upstream:NAME`` (the panes version consumed up to) and
    ``upstreams`` ({NAME: from, to, watermark, batch, accumulation})."""
    out: dict[str, Any] = {"upstreams": {}}
    for name, mark in marks.items():
        before = consumed(log, batch, name)
        upto = mark["panes"] if mark and mark["panes"] is not None else before
        if before is not None and upto is not None and upto < before and (
                (latest := job.tables.version(name, "panes")) is not None and latest > before):
            # The upstream was rewound to a batch before those consumed: its last marker names the version
            # that batch wrote, and the rewind's commit holds the same rows again. Read up to that commit.
            upto = job.tables.rewound(name, "panes", before, latest) or upto
        if before is not None and (upto is None or upto < before):
            raise MillpondError(f"{job.name}: upstream {name}'s panes are at version {upto}, behind version {before} "
                                f"this pipeline consumed: was {name} reset? Reset {job.name} too (`millpond reset "
                                f"{job.name}`), then backfill it")
        spec = json.loads(mark["spec"]) if mark and mark.get("spec") else {}
        if spec:
            check_upstream(job.name, name, spec, job.spec.value_type)
        out[f"upstream:{name}"] = upto
        out["upstreams"][name] = {"from": before, "to": upto, "watermark": mark["watermark"] if mark else None,
                                  "batch": mark["batch"] if mark else None,
                                  "accumulation": spec.get("accumulation", "accumulating"),
                                  "epoch": mark["epoch"] if mark else 0}
    return out


def input_watermark(plan: dict[str, Any]) -> int:
    """The least of the upstreams' committed watermarks (the start of time while one has none)."""
    marks = plan["versions"].get("upstreams") or {}
    return min((MIN_TS if m["watermark"] is None else m["watermark"] for m in marks.values()), default=MIN_TS)


def read_upstreams(job: BatchContext, plan: dict[str, Any]) -> pa.Table:
    """The planned upstream panes as elements (``event_schema``), in (upstream, batch, seq) order."""
    parts = []
    schema = pane_schema(job.spec.value_type)
    for name, rng in (plan["versions"].get("upstreams") or {}).items():
        start = rng["from"]
        while (rewound := job.tables.rewound(name, "panes", start, rng["to"])) is not None:
            # a reprocess of the upstream: undo what the stage took from the panes it took away
            undone = removed_panes(job, name, start, rewound, schema)
            if undone.num_rows:
                parts.append(pane_elements(job, name, _ordered(undone), {**rng, "to": start}, undo=rewound))
            start = rewound
        rows = job.tables.read_added(name, "panes", start, rng["to"], schema)
        if rows.num_rows:
            parts.append(pane_elements(job, name, _ordered(rows), rng))
    if not parts:
        return event_schema(job.spec.value_type).empty_table()
    return pa.concat_tables(parts)


def _ordered(rows: pa.Table) -> pa.Table:
    return rows.sort_by([("batch", "ascending"), ("seq", "ascending"), ("key", "ascending"),
                         ("window_start", "ascending"), ("kind", "ascending")])


def removed_panes(job: BatchContext, name: str, consumed_to: int, rewound: int, schema: pa.Schema) -> pa.Table:
    """The upstream panes this stage consumed (up to version ``consumed_to``) that its rewind at version
    ``rewound`` took away: a rewind goes back to the end of an earlier batch, so those are the rows of the
    batches after the last one still there."""
    kept = job.tables.read_arrow(name, "panes", version=rewound, columns=["batch"])
    last = pc.max(kept.column("batch")).as_py() if kept.num_rows else None
    rows = job.tables.select(name, "panes", f"batch > {int(last or 0)}", version=consumed_to, schema=schema)
    return rows.select(schema.names).cast(schema)


def pane_elements(job: BatchContext, name: str, rows: pa.Table, rng: dict[str, Any], undo: int | None = None
                  ) -> pa.Table:
    """One element per pane: what the pane changed in its window's value (``model.stages``). ``undo``: the
    panes were taken away by the upstream's rewind at that version, so each element takes back what the
    pane gave. Ids name the upstream's epoch (its rewinds so far: a reprocessed pane is a new pane, not a
    duplicate of the one it replaces), and an undo names its rewind."""
    up = job.spec.upstream
    value = rows.column("value")
    retraction = pc.equal(rows.column("kind"), "retraction")
    if rng["accumulation"] == "accumulating_and_retracting":
        value = pc.if_else(retraction, pc.negate(value), value)
    elif rng["accumulation"] == "accumulating":
        value = pc.subtract(value, previous_values(job, name, rows, rng["to"]))
    if undo is not None:
        value = pc.negate(value)
    epoch = rng.get("epoch") or 0
    tag = (f"undo@{undo}|" if undo is not None else "") + (name if not epoch else f"{name}#{epoch + 1}")
    start, end = (pc.cast(rows.column(c), pa.int64()) for c in ("window_start", "window_end"))
    ids = pc.binary_join_element_wise(
        pa.array(np.full(rows.num_rows, tag, object), pa.string()), rows.column("key"),
        *(pc.cast(c, pa.string()) for c in (start, end, rows.column("pane_index"))), rows.column("kind"), "|")
    key = rows.column("key") if up.key == "keep" else pa.array(np.full(rows.num_rows, ALL_KEY, object), pa.string())
    event_time = start if up.event_time == "window_start" else pc.subtract(end, 1)
    schema = event_schema(job.spec.value_type)
    return pa.Table.from_arrays([ids, key, value, event_time, pc.cast(rows.column("processing_time"), pa.int64())],
                                schema=schema)


def previous_values(job: BatchContext, name: str, rows: pa.Table, upto: int) -> pa.Array:
    """Over an accumulating upstream: each pane's window's previous pane value (0 for a window's first),
    from the upstream's value panes of the same windows as of the planned version."""
    keys = pc.unique(rows.column("key")).to_pylist()
    lo, hi = pc.min(rows.column("window_start")).as_py(), pc.max(rows.column("window_start")).as_py()
    where = f"kind = 'value' AND window_start >= {sql_ts(to_us(lo))} AND window_start <= {sql_ts(to_us(hi))}"
    if len(keys) <= SMALL_IN_LIST:
        where += " AND " + sql_in("key", keys)
    cols = ["key", "window_start", "window_end", "pane_index", "value"]
    hist = job.tables.select(name, "panes", where, columns=cols, version=upto).sort_by(
        [("key", "ascending"), ("window_start", "ascending"), ("window_end", "ascending"),
         ("pane_index", "ascending")])
    before: dict[tuple, Any] = {}
    last: dict[tuple, Any] = {}
    for k, ws, we, i, v in zip(*(hist.column(c).to_pylist() for c in cols), strict=True):
        before[(k, ws, we, i)] = last.get((k, ws, we), 0)
        last[(k, ws, we)] = v
    wanted = zip(*(rows.column(c).to_pylist() for c in cols[:4]), strict=True)
    return pa.array([before.get(w, 0) for w in wanted], rows.schema.field("value").type)
