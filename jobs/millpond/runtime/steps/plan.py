"""Plan: which landing files a batch takes and which state versions it reads, committed before anything
else, so that a rerun after a crash finds it and redoes exactly the same work."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.landing import LandingFile, file_arrival
from millpond.lake.objectstore import StoredObject
from millpond.lake.schemas import PLAN_SCHEMA
from millpond.lake.tables import Txn
from millpond.model.panes import TS
from millpond.model.timeutil import to_us
from millpond.runtime.assembly import ts_array
from millpond.runtime.commits import concurrently
from millpond.runtime.upkeep import maintain, upkeep_turns

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

INPROGRESS = ".inprogress"


def read_history(job: BatchContext) -> dict[str, Any]:
    """What the plan may need, read at once: the committed batches, the plan log, the landing listing and
    the state tables' versions (a rerun of a crashed batch uses its plan's versions instead)."""
    state = {f"version:{name}": (lambda name=name: job.tables.version(job.name, name)) for name in job.state_tables}
    return concurrently({"done": job.committed, "log": job.ingest_log, "landing": job.landing, **state})


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
    log = log.filter(pc.field("batch") == batch)
    if not log.num_rows:
        return None
    row = log.to_pylist()[0]
    return {"files": row["files"], "arrivals": row["file_arrivals"], "versions": json.loads(row["versions"])}


def taken_files(log: pa.Table) -> set[str]:
    return {f for files in log.column("files").to_pylist() for f in files}


def pending_files(listing: list[StoredObject], log: pa.Table, processing_time: int
                  ) -> tuple[list[LandingFile], int | None]:
    """Finished files to take now, and the arrival of the oldest file still being written."""
    taken = taken_files(log)
    out = []
    unfinished: list[int] = []
    for obj in listing:
        arrival = file_arrival(obj)
        if arrival >= processing_time:
            continue
        if obj.key.endswith(INPROGRESS):
            unfinished.append(arrival)
        elif obj.key not in taken and obj.key.endswith((".jsonl", ".json")):
            out.append(LandingFile(obj.key, arrival, obj.size, obj.etag))
    return sorted(out, key=lambda f: (f.arrival, f.key)), min(unfinished, default=None)


def plan_batch(job: BatchContext, batch: int, txn: Txn, found: dict[str, Any], prev: dict[str, Any] | None,
               processing_time: int) -> dict[str, Any]:
    """This batch's plan: the one a crashed attempt committed, or a new one, whose commit then runs while
    the planned files are read (nothing else commits before it has landed)."""
    plan = plan_of(found["log"], batch)
    # Output tables the last marker found absent need no probe for this one (~10 ms each): only a batch
    # creates them, holding the lease, and its marker follows all its commits; before the first marker,
    # only the plan's table can exist. Not on a rerun: the crashed attempt may have created one.
    if plan is not None:
        return plan
    job.commits.absent = ({n for n, v in json.loads(prev["versions"] or "{}").items() if v is None} if prev
                          else set(job.output_tables) - {"ingest_log"})
    files, oldest_pending = pending_files(found["landing"], found["log"], processing_time)
    versions = {name: found[f"version:{name}"] for name in job.state_tables}
    versions["oldest_pending"] = oldest_pending
    plan = {"files": [f.key for f in files], "arrivals": [f.arrival for f in files], "versions": versions}
    row = pa.Table.from_arrays([
        pa.array([batch], pa.int64()), ts_array([processing_time]), pa.array([plan["files"]], pa.list_(pa.string())),
        pa.array([plan["arrivals"]], pa.list_(pa.int64())), pa.array([json.dumps(versions, sort_keys=True)])],
        schema=PLAN_SCHEMA)
    job.commits.plan_commit = job.background.submit(
        job.commits.commit_now, "ingest_log", lambda: job.tables.append(job.name, "ingest_log", row, txn=txn),
        "ingest_log")
    return plan


def start_upkeep(job: BatchContext, batch: int) -> None:
    """This batch's upkeep step, beside its reads and per-key step; one on ingest_log waits for the plan."""
    turns = upkeep_turns(job.output_tables, job.state_tables)
    turn = turns[batch % len(turns)]
    first = job.commits.plan_commit if turn[1] == "ingest_log" else None
    job.commits.upkeep = job.background.submit(maintain, job.tables, job.name, batch, turn, first)
