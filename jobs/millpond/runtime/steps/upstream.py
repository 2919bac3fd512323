"""Upstream: a stage's input (``source: {pipeline: NAME, stream: panes}``, ``model.stages``), the panes its
upstream pipelines committed since those it consumed last.

The plan records, per upstream, the range of its ``panes`` versions the batch consumes: from the version
the earlier batches consumed up to (exclusive) to the version named by the upstream's last committed
marker (inclusive), and that marker's watermark. A retried batch finds its plan and reads the same range;
a panes commit of an upstream batch whose marker has not landed yet lies beyond the range and waits for
the next batch. Only the rows the range's commits added are read (``Tables.read_added``: the Delta change
feed, which skips compactions). Each pane becomes one element (``model.stages`` says how); its id names
the upstream, key, window, pane index and kind, unique by construction: a range is consumed once, so a stage
does not deduplicate by id (``steps.dedup.by_id``). The batch's
input watermark is the least of the upstreams' recorded watermarks (``input_watermark``).

A version names the upstream's panes as they were then (None: none). What a stage has consumed is always the
content of the version its last plan names, and a batch consumes the difference to the version its upstream's
marker names now: usually the rows the commits in between appended; across an upstream reprocess (a RESTORE or
DELETE in between, or a marker behind what was consumed) the rows one version holds and the other does not,
above the batches both still share: the added ones count, the removed ones are taken back. So a stage that lags
its upstream, two rewinds inside one range, or a marker that a rewind moved back are all the same case.
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
from millpond.runtime.upkeep import beyond_retention

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: up to this many keys a SQL IN list when looking up an accumulating upstream's previous panes
SMALL_IN_LIST = 200


def upstream_marks(job: BatchContext, processing_time: int) -> dict[str, dict[str, Any]]:
    """Each upstream's last committed marker at or before the stage's processing time: its batch, watermark
    (us), panes version and semantic spec (None each: no such batch), and the upstream's epoch. Bounded by the
    processing time, a stage's batch reads the same upstream batches whenever it runs (live, late, or in a
    backfill), as long as its upstreams have committed them."""
    out: dict[str, dict[str, Any]] = {}
    for name in job.spec.upstream.pipelines:
        epoch, done = _marks_in_one_epoch(job, name, processing_time)
        if not done:  # none yet, or a reprocess rewound the upstream to before its first batch
            out[name] = {"batch": None, "watermark": None, "panes": None, "spec": None, "epoch": epoch}
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
    """The upstream panes version whose content this stage's earlier batches consumed (None: nothing): the one
    its last plan names. Every plan of an earlier batch belongs to a committed batch (a batch plans after the
    previous marker), and a rewind of the stage takes the later plans away with the batches."""
    return (last_plan(log, batch) or {}).get(f"upstream:{upstream}")


def last_plan(log: pa.Table, batch: int) -> dict[str, Any] | None:
    """The versions of the last plan before ``batch`` (None: it is the first)."""
    latest: tuple[int, str] | None = None
    for b, text in zip(log.column("batch").to_pylist(), log.column("versions").to_pylist(), strict=True):
        if b < batch and text and (latest is None or b > latest[0]):
            latest = (b, text)
    return None if latest is None else json.loads(latest[1])


def plan_upstreams(job: BatchContext, log: pa.Table, batch: int, marks: dict[str, dict[str, Any] | None]
                   ) -> dict[str, Any]:
    """The plan's entries for the upstreams: ``upstream:NAME`` (the panes version consumed up to) and
    ``upstreams`` ({NAME: from, to, watermark, batch, accumulation})."""
    out: dict[str, Any] = {"upstreams": {}}
    last = last_plan(log, batch) or {}
    for name, mark in marks.items():
        before = last.get(f"upstream:{name}")
        upto = mark["panes"]
        if before is not None and (upto is None or upto < before):
            latest = job.tables.version(name, "panes")
            if latest is None or latest < before or not job.tables.rewinds(name, "panes", upto, latest):
                # Versions only go back when the table is made anew: not a rewind (which commits), a reset.
                raise MillpondError(f"{job.name}: upstream {name}'s panes are at version {latest}, behind version "
                                    f"{before} this pipeline consumed, with no reprocess in between: {name} was "
                                    f"reset. Reset {job.name} too (`millpond reset {job.name}`), then backfill it")
        check_history(job, name, before, upto)
        spec = json.loads(mark["spec"]) if mark.get("spec") else {}
        if spec:
            check_upstream(job.name, name, spec, job.spec.value_type)
        # With no marker left (rewound to before its first batch), the panes taken back were read as the last
        # plan read them: an upstream's accumulation changes only with a reset.
        was = (last.get("upstreams") or {}).get(name) or {}
        out[f"upstream:{name}"] = upto
        out["upstreams"][name] = {"from": before, "to": upto, "watermark": mark["watermark"], "batch": mark["batch"],
                                  "accumulation": spec.get("accumulation", was.get("accumulation", "accumulating")),
                                  "epoch": mark["epoch"]}
    return out


def check_history(job: BatchContext, name: str, before: int | None, upto: int | None) -> None:
    """A batch that would read upstream versions beyond the upstream's retention (a stage that lagged longer, a
    backfill of a stage far in the past) is refused before its plan is written: the files those versions need
    may have been vacuumed, and the change feed would fail half-way."""
    if before == upto:
        return
    # the oldest content read: ``before``'s (a later version was replaced later), or ``upto``'s when it is older
    for version in (before, upto) if before is None or upto is None or upto < before else (before,):
        why = "" if version is None else beyond_retention(job.tables, name, "panes", version)
        if why:
            raise MillpondError(
                f"{job.name}: this batch reads upstream {name}'s panes from version {before} to {upto}, but {why}: "
                f"reset {job.name} (`millpond reset {job.name}`) and run it from a processing time within that "
                f"retention (its first batch reads {name}'s panes whole); nothing was written")
    check_expired(job, name, before, upto)


def check_expired(job: BatchContext, name: str, before: int | None, upto: int | None) -> None:
    """A stage whose range spans an upstream rewind compares two versions' contents (``changed_panes``); if the
    upstream's ``expire:`` deleted, in between, panes of batches the stage had not taken yet, the later content
    lacks them, and reading on would lose them without a word: refused before the plan is written. (Without a
    rewind the stage reads the rows the range's commits added, expired since or not: their files are kept for
    the retention, which ``check_history`` checks.)"""
    if before is None or upto is None or before == upto:
        return
    lo, hi = sorted((before, upto))
    rewinds = job.tables.rewinds(name, "panes", lo, hi)
    expiries = job.tables.table(name, "panes").expiries(lo, hi) if rewinds else []
    if not expiries:
        return
    shared = shared_batch(job, name, before, upto, rewinds)
    lost = [e for e in expiries if e["last_batch"] > shared]
    if lost:
        raise MillpondError(
            f"{job.name}: upstream {name} expired panes of its batch {lost[0]['last_batch']} (panes version "
            f"{lost[0]['version']}, `expire:` in {name}'s pipeline file) across a reprocess of {name}, after "
            f"batch {shared}, the last this pipeline's range shares: lengthen {name}'s expire, or reset {job.name} "
            f"(`millpond reset {job.name}`) and backfill it; nothing was written")


def shared_batch(job: BatchContext, name: str, before: int | None, upto: int | None, rewinds: list[int]) -> int:
    """The last upstream batch that the contents of ``before``, ``upto`` and the rewinds between all hold."""
    return min([_last_batch(job, name, before), _last_batch(job, name, upto)]
               + [_last_batch(job, name, v) for v in rewinds])


def input_watermark(plan: dict[str, Any]) -> int:
    """The least of the upstreams' committed watermarks (the start of time while one has none)."""
    marks = plan["versions"].get("upstreams") or {}
    return min((MIN_TS if m["watermark"] is None else m["watermark"] for m in marks.values()), default=MIN_TS)


def read_upstreams(job: BatchContext, plan: dict[str, Any]) -> pa.Table:
    """The planned upstream panes as elements (``event_schema``): per upstream, the panes taken back, then
    the panes added, each in (batch, seq) order."""
    parts = []
    schema = pane_schema(job.spec.value_type)
    for name, rng in (plan["versions"].get("upstreams") or {}).items():
        removed, added = changed_panes(job, name, rng["from"], rng["to"], schema)
        if removed.num_rows:
            parts.append(pane_elements(job, name, _ordered(removed), {**rng, "to": rng["from"]}, undo=True))
        if added.num_rows:
            parts.append(pane_elements(job, name, _ordered(added), rng))
    if not parts:
        return event_schema(job.spec.value_type).empty_table()
    return pa.concat_tables(parts)


def _ordered(rows: pa.Table) -> pa.Table:
    return rows.sort_by([("batch", "ascending"), ("seq", "ascending"), ("key", "ascending"),
                         ("window_start", "ascending"), ("kind", "ascending")])


def changed_panes(job: BatchContext, name: str, before: int | None, upto: int | None, schema: pa.Schema
                  ) -> tuple[pa.Table, pa.Table]:
    """(removed, added): the upstream panes that the content of version ``before`` holds and that of ``upto``
    does not, and the other way round (None: no panes). Without a rewind in between, the rows the commits
    appended (the change feed); across one, the two contents compared above the batches they share."""
    empty = schema.empty_table()
    if before == upto:
        return empty, empty
    if before is None:
        return empty, job.tables.read_added(name, "panes", before, upto, schema)
    lo, hi = sorted(-1 if v is None else v for v in (before, upto))
    rewinds = job.tables.rewinds(name, "panes", lo, hi)  # one history read for the check and the comparison
    if upto is not None and upto > before and not rewinds:
        return empty, job.tables.read_added(name, "panes", before, upto, schema)
    shared = shared_batch(job, name, before, upto, rewinds)
    old, new = (_panes_after(job, name, v, shared, schema) for v in (before, upto))
    old_ids, new_ids = _row_ids(old), _row_ids(new)
    return old.filter(pc.invert(pc.is_in(old_ids, value_set=new_ids))), new.filter(
        pc.invert(pc.is_in(new_ids, value_set=old_ids)))


def _last_batch(job: BatchContext, name: str, version: int | None) -> int:
    """The upstream's last batch in its panes at ``version`` (0: none). A rewind goes back to the end of an
    earlier batch and batches append, so two contents share every batch up to the least of these."""
    if version is None:
        return 0
    rows = job.tables.read_arrow(name, "panes", version=version, columns=["batch"])
    return int(pc.max(rows.column("batch")).as_py() or 0) if rows.num_rows else 0


def _panes_after(job: BatchContext, name: str, version: int | None, batch: int, schema: pa.Schema) -> pa.Table:
    if version is None:
        return schema.empty_table()
    rows = job.tables.select(name, "panes", f"batch > {int(batch)}", version=version, schema=schema)
    return rows.select(schema.names).cast(schema)


def _row_ids(rows: pa.Table) -> pa.Array:
    """Each pane row as one string of all its columns: two versions hold the same pane when all agree."""
    if not rows.num_rows:
        return pa.array([], pa.string())
    cols = [pc.fill_null(pc.cast(rows.column(c), pa.string()), "\\N") for c in rows.column_names]
    return pc.binary_join_element_wise(*cols, "\x1f")


def pane_elements(job: BatchContext, name: str, rows: pa.Table, rng: dict[str, Any], undo: bool = False
                  ) -> pa.Table:
    """One element per pane: what the pane changed in its window's value (``model.stages``). ``undo``: the
    panes were taken away by an upstream reprocess, so each element takes back what the pane gave. Ids name
    the upstream's epoch (its rewinds so far: a reprocessed pane is a new pane, not a duplicate of the one it
    replaces); an undo is marked as one, and a pane is taken back at most once per epoch (taking it back
    needs a rewind after it was taken)."""
    up = job.spec.upstream
    value = rows.column("value")
    retraction = pc.equal(rows.column("kind"), "retraction")
    if rng["accumulation"] == "accumulating_and_retracting":
        value = pc.if_else(retraction, pc.negate(value), value)
    elif rng["accumulation"] == "accumulating":
        value = pc.subtract(value, previous_values(job, name, rows, rng["to"]))
    if undo:
        value = pc.negate(value)
    epoch = rng.get("epoch") or 0
    tag = ("undo|" if undo else "") + (name if not epoch else f"{name}#{epoch + 1}")
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
