"""Plan: which landing files a batch takes and which state versions it reads, committed before anything
else, so that a rerun after a crash finds it and redoes exactly the same work."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.landing import INPROGRESS, LandingFile, file_arrival, not_input
from millpond.lake.objectstore import StoredObject
from millpond.lake.schemas import PLAN_SCHEMA
from millpond.lake.tables import Txn
from millpond.model.listing import FULL
from millpond.model.panes import TS
from millpond.model.timeutil import iso, to_us
from millpond.runtime.assembly import ts_array
from millpond.runtime.commits import concurrently
from millpond.runtime.steps import dedup
from millpond.runtime.steps.upstream import plan_upstreams, upstream_marks
from millpond.runtime.upkeep import maintain, retention_of, upkeep_turns

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext


def read_history(job: BatchContext, processing_time: int) -> dict[str, Any]:
    """What the plan may need, read at once: the committed batches, the plan log, the landing listing and
    the state tables' versions (a rerun of a crashed batch uses its plan's versions instead). A landing
    source listed incrementally (``model.listing``) reads its listing and the plans it needs once the last
    marker is known."""
    state = {f"version:{name}": (lambda name=name: job.tables.version(job.name, name)) for name in job.state_tables}
    if job.spec.upstream is not None:  # a stage: its upstreams' last markers instead of a landing listing
        state["upstreams"] = lambda: upstream_marks(job, processing_time)
        return concurrently({"done": job.committed, "log": job.ingest_log, "landing": list, **state})
    if job.spec.listing.mode == FULL:
        return concurrently({"done": job.committed, "log": job.ingest_log, "landing": lambda: job.landing(None),
                             **state})
    found = concurrently({"done": job.committed, **state})
    return found | listed(job, found["done"], processing_time)


def listed(job: BatchContext, done: pa.Table, processing_time: int) -> dict[str, Any]:
    """The landing listing from the cursor on, and the plans that may have taken what it lists: a listed
    file was taken, if at all, by a batch whose processing time is after the file's arrival, so the plans
    since the earliest arrival listed say which are taken. Neither read grows with the pipeline's history
    (unless its prefix holds files without an arrival tag: those are listed, and their plans read, always)."""
    last = max(done.column("batch").to_pylist(), default=0)
    marker = done.filter(pc.field("batch") == last).to_pylist()[0] if last else None
    previous = to_us(marker["processing_time"]) if marker else None
    cursor = job.spec.listing.cursor(previous, None, processing_time)
    if cursor is None:  # the first batch, a full-listing period's first, or before
        return concurrently({"log": job.ingest_log, "landing": lambda: job.landing(None)})
    found = concurrently({"log": lambda: job.plans_since(cursor), "landing": lambda: job.landing(cursor)})
    before = plan_of(found["log"], last)
    pending = (before or {}).get("versions", {}).get("oldest_pending")
    held_back = job.spec.listing.cursor(previous, pending, processing_time)
    if held_back is not None and held_back < cursor:  # a file being written since before the cursor
        found["landing"] = job.landing(held_back)
    earliest = min((file_arrival(o) for o in found["landing"]), default=cursor)
    if earliest < cursor:
        found["log"] = job.plans_since(earliest)
    return found


def previous_batch(done: pa.Table, processing_time: int) -> tuple[dict[str, Any] | None, str]:
    """The last committed batch's marker row, and why this batch has nothing to do ('' if it has)."""
    prior = done.filter(pc.field("processing_time") == pa.scalar(processing_time, pa.int64()).cast(TS))
    if prior.num_rows:
        return prior.to_pylist()[0], "already committed"
    last = max(done.column("batch").to_pylist(), default=0)
    prev = done.filter(pc.field("batch") == last).to_pylist()[0] if last else None
    if prev and to_us(prev["processing_time"]) > processing_time:
        # Batches commit in processing-time order: a later batch already took this interval's files, so
        # re-running it (an overlapping backfill, a late retry) has nothing left to do.
        return prev, f"a later batch ({prev['processing_time'].isoformat()}) is already committed"
    return prev, ""


def plan_of(log: pa.Table, batch: int) -> dict[str, Any] | None:
    """The batch's committed plan (None if it has none yet), with the files an operator has since held
    (``millpond quarantine-file``: rows of the same batch without versions) moved out of its files."""
    rows = log.filter(pc.field("batch") == batch).to_pylist()
    planned = [r for r in rows if r["versions"] is not None]
    if not planned:
        return None
    row, held = planned[0], holds(rows)
    pairs = [(f, a) for f, a in zip(row["files"], row["file_arrivals"], strict=True) if f not in held]
    return {"files": [f for f, _ in pairs], "arrivals": [a for _, a in pairs], "versions": json.loads(row["versions"]),
            "skipped": json.loads(row.get("skipped") or "{}"), "held": held,
            "processing_time": to_us(row["processing_time"]) if row.get("processing_time") is not None else None}


def holds(rows: list[dict[str, Any]]) -> dict[str, str]:
    """{file: reason} of the operator's holds among a batch's plan-log rows (the plan's own and later ones)."""
    out: dict[str, str] = {}
    for r in rows:
        out.update(json.loads(r.get("held") or "{}"))
    return out


def taken_files(log: pa.Table) -> set[str]:
    """Every file a plan has taken, held or reported as skipped: none is planned again."""
    taken = {f for files in log.column("files").to_pylist() for f in files or ()}
    for name in ("held", "skipped"):
        if name in log.column_names:
            taken.update(k for text in log.column(name).to_pylist() if text and text != "{}" for k in json.loads(text))
    return taken


def pending_files(listing: list[StoredObject], log: pa.Table, processing_time: int
                  ) -> tuple[list[LandingFile], int | None, dict[str, str]]:
    """Finished files to take now, the arrival of the oldest file still being written, and the objects
    under the prefix that are not input ({key: reason}, reported once, by the first batch that lists them)."""
    taken = taken_files(log)
    out = []
    unfinished: list[int] = []
    skipped: dict[str, str] = {}
    for obj in listing:
        if obj.key in taken:
            continue
        arrival = file_arrival(obj)
        if arrival >= processing_time:
            continue
        reason = not_input(obj.key)
        if reason:
            skipped[obj.key] = reason
        elif obj.key.lower().endswith(INPROGRESS):
            unfinished.append(arrival)
        else:
            out.append(LandingFile(obj.key, arrival, obj.size, obj.etag))
    return sorted(out, key=lambda f: (f.arrival, f.key)), min(unfinished, default=None), skipped


def plan_batch(job: BatchContext, batch: int, txn: Txn, found: dict[str, Any], prev: dict[str, Any] | None,
               processing_time: int, explicit_watermark: int | None = None) -> dict[str, Any]:
    """This batch's plan: the one a crashed attempt committed, or a new one, whose commit then runs while
    the planned files are read (nothing else commits before it has landed). A plan pins the batch's clock
    too (its processing time, an explicit watermark): a retry at another time redoes the same batch, whose
    commits that landed before the crash were computed with that clock."""
    plan = plan_of(found["log"], batch)
    # Output tables the last marker found absent need no probe for this one (~10 ms each): only a batch
    # creates them, holding the lease, and its marker follows all its commits; before the first marker,
    # only the plan's table can exist. Not on a rerun: the crashed attempt may have created one.
    if plan is not None:
        return plan
    job.commits.absent = ({n for n, v in json.loads(prev["versions"] or "{}").items() if v is None} if prev
                          else set(job.output_tables) - {"ingest_log"})
    files, oldest_pending, skipped = pending_files(found["landing"], found["log"], processing_time)
    # a stage keeps no seen_ids (``dedup.by_id``): its plan pins none, so no engine reads one
    versions = {name: found[f"version:{name}"] for name in job.state_tables if name != "seen_ids" or dedup.by_id(job)}
    versions["oldest_pending"] = oldest_pending
    versions["explicit_watermark"] = explicit_watermark
    if job.spec.upstream is not None:
        versions |= plan_upstreams(job, found["log"], batch, found["upstreams"])
    held = holds(found["log"].filter(pc.field("batch") == batch).to_pylist())
    plan = {"files": [f.key for f in files], "arrivals": [f.arrival for f in files], "versions": versions,
            "skipped": skipped, "held": held, "processing_time": processing_time}
    row = plan_row(batch, processing_time, plan)
    job.commits.plan_commit = job.background.submit(
        job.commits.commit_now, "ingest_log", lambda: job.tables.append(job.name, "ingest_log", row, txn=txn),
        "ingest_log")
    return plan


def plan_row(batch: int, processing_time: int | None, plan: dict[str, Any]) -> pa.Table:
    """The plan log's row of a plan (``versions`` None: an operator's hold for the batch, see ``holds``)."""
    versions = plan.get("versions")
    return pa.Table.from_arrays([
        pa.array([batch], pa.int64()), ts_array([processing_time]), pa.array([plan["files"]], pa.list_(pa.string())),
        pa.array([plan["arrivals"]], pa.list_(pa.int64())),
        pa.array([None if versions is None else json.dumps(versions, sort_keys=True)], pa.string()),
        pa.array([json.dumps(plan.get("skipped") or {}, sort_keys=True)], pa.string()),
        pa.array([json.dumps(plan.get("held") or {}, sort_keys=True)], pa.string())], schema=PLAN_SCHEMA)


def start_upkeep(job: BatchContext, batch: int) -> None:
    """This batch's upkeep step, beside its reads and per-key step; one on ingest_log waits for the plan."""
    turns = upkeep_turns(job.output_tables, job.state_tables)
    turn = turns[batch % len(turns)]
    first = job.commits.plan_commit if turn[1] == "ingest_log" else None
    job.commits.upkeep = job.background.submit(maintain, job.tables, job.name, batch, turn, first,
                                               retention_of(job.settings, job.name, job.spec),
                                               job.spec.expire, time.time())


def pinned_clock(the_plan: dict[str, Any], asked: int, explicit: int | None) -> tuple[int, int | None, str]:
    """The batch's processing time and explicit watermark as its plan pinned them, and a note for the summary
    line when they differ from what this run asked for. A plan from before the clock was pinned keeps the
    asked-for explicit watermark."""
    planned = the_plan.get("processing_time")
    versions = the_plan["versions"]
    pinned = versions["explicit_watermark"] if "explicit_watermark" in versions else explicit
    at = asked if planned is None else planned
    notes = []
    if at != asked:
        notes.append(f"re-run of the plan made at {iso(at)}, not at {iso(asked)} as asked: a retry redoes the "
                     "batch its first attempt planned")
    if pinned != explicit:
        notes.append(f"explicit watermark {iso(pinned) if pinned is not None else 'none'} as planned")
    return at, pinned, "; ".join(notes)
