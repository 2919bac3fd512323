"""Rewind: a pipeline's tables made as they were after an earlier batch, the first half of a reprocess.

A reprocess from X recomputes every batch after X (late files landed into the past range, a fixed bug, a
changed spec). Its rewind makes every table the pipeline writes hold what it held after the last batch at or
before X: the versions that batch's marker names are restored as new Delta commits, so history and time
travel keep the old results; a table the batch had not written yet is emptied. The batches from X on then
run as usual and find exactly the state a run that never went past X would have had.

Batch numbers restart after the rewound batch, so the batches' application transactions are made new: each
rewind is an *epoch* (``millpond/P#2`` after the first rewind), recorded as the transaction of the rewind's own
commits. The rewind's restores carry it too, which makes a rewind that stopped half-way idempotent: run it
again and the tables already rewound are skipped. While it runs it holds the pipeline's lease for long (a
week): a rewind cut off half-way keeps the pipeline's batches out until the same reprocess runs again.
A reprocess is recorded in the pipeline's ``operations`` table (never rewound), which ``millpond history P``
shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime

from millpond.config import Settings
from millpond.errors import MillpondError, PipelineChanged
from millpond.lake.delta_options import Txn, fence_app
from millpond.lake.lease import Lease
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.lake.tables import Tables
from millpond.model.spec import PipelineSpec
from millpond.model.timeutil import iso, to_us
from millpond.model.versions import changes
from millpond.runtime.catchup import record, recorded
from millpond.runtime.steps.versions import spec_record
from millpond.runtime.upkeep import beyond_retention

#: how long a rewind holds the lease (released when it ends; only a rewind cut off half-way keeps it)
HOLD_S = 7 * 86400
#: written first to last: the plan log and the markers go last, so a rewind cut off half-way is redone whole
LAST = ("ingest_log", "batches")


def rewind_app(pipeline: str) -> str:
    return f"millpond/{pipeline}/rewind"


def epoch(tables: Tables, pipeline: str) -> int:
    """How many rewinds the pipeline's markers have been through (0: none)."""
    return tables.txn_version(pipeline, "batches", rewind_app(pipeline)) or 0


def app_id(pipeline: str, epoch_no: int) -> str:
    """The application id of a batch's commits: new after each rewind, as batch numbers start again."""
    return f"millpond/{pipeline}" if not epoch_no else f"millpond/{pipeline}#{epoch_no + 1}"


@dataclass
class Rewind:
    """What a rewind does (``plan``) and did (``run``)."""

    pipeline: str
    #: the batch the tables go back to (None: before the first batch), and its processing time
    to_batch: int | None
    to_time: int | None
    #: the last committed batch before the rewind, and its processing time
    last_batch: int
    last_time: int
    #: {table: version restored (None: emptied)}; ``batches`` keeps its rows up to ``to_batch`` instead
    targets: dict[str, int | None] = field(default_factory=dict)

    @property
    def noop(self) -> bool:
        return (self.to_batch or 0) == self.last_batch


def plan(tables: Tables, spec: PipelineSpec, start: int) -> Rewind:
    """The rewind for a reprocess from ``start`` (µs): back to the last batch whose processing time is at or
    before it. A spec that would reinterpret that batch's state is refused: reprocess from the start then. So is
    a table version to restore that is beyond the pipeline's retention (its files may have been vacuumed)."""
    done = tables.read_whole(spec.name, "batches", BATCHES_SCHEMA).sort_by("batch")
    if not done.num_rows:  # nothing committed: nothing to rewind
        return Rewind(spec.name, None, None, 0, 0)
    rows = done.to_pylist()
    last = rows[-1]
    before = [r for r in rows if to_us(r["processing_time"]) <= start]
    to = before[-1] if before else None
    if to is not None and to.get("spec"):
        breaking, _ = changes(json.loads(to["spec"]), json.loads(spec_record(spec.raw)))
        if breaking:
            first = iso(to_us(rows[0]["processing_time"]) - spec.batch_interval)
            raise PipelineChanged(
                f"{spec.name}: the pipeline changed ({', '.join(breaking)}) since the state at "
                f"{iso(to_us(to['processing_time']))} was written, so a reprocess from there would misread it: "
                f"reprocess from the start (--from {first}) to recompute everything under the new spec")
    names = [n for n in json.loads(last["versions"] or "{}") if n not in LAST] + list(LAST)
    kept = json.loads(to["versions"] or "{}") if to else {}
    r = Rewind(spec.name, to["batch"] if to else None, to_us(to["processing_time"]) if to else None,
               last["batch"], to_us(last["processing_time"]), {n: kept.get(n) for n in names})
    if not r.noop:
        for table, version in r.targets.items():  # (``batches`` keeps its rows up to the batch: not restored)
            why = "" if version is None or table == "batches" else beyond_retention(tables, spec.name, table, version,
                                                                                    spec)
            if why:
                first = iso(to_us(rows[0]["processing_time"]) - spec.batch_interval)
                raise MillpondError(
                    f"{spec.name}: a reprocess from {iso(start)} restores the tables as batch {r.to_batch} left them, "
                    f"but {why}: reprocess from a later time, or from the start (--from {first}) to recompute "
                    "everything from the landing files; nothing was rewound")
    return r


def run(settings: Settings, tables: Tables, spec: PipelineSpec, start: int, by: str,
        reprocess: str | None = None) -> Rewind:
    """Rewind ``spec``'s tables for a reprocess from ``start`` (µs), under the pipeline's lease; record it.

    ``reprocess`` names the reprocess the rewind belongs to: a reprocess rewinds once. Its runs carry the
    name, find the rewind recorded and rewind nothing, so a run done again after later runs of the same
    reprocess committed (an Airflow retry of a run marked failed after its batch committed, a run cleared in
    the UI) cannot rewind their batches away: it finds its own batch committed, or a later one, and skips."""
    name = spec.name
    lease = Lease.acquire(settings, name, owner=f"rewind/{name}", ttl_s=HOLD_S, wait=True)
    try:
        if reprocess and recorded(tables, name, "reprocess", reprocess):
            lease.release()
            return Rewind(name, None, None, 0, 0)
        r = plan(tables, spec, start)
    except BaseException:  # refused before anything moved: the pipeline goes on as it was
        lease.release()
        raise
    if r.noop:
        if reprocess:  # nothing to rewind now: neither is there for its runs later
            record(tables, name, "reprocess", by, {"id": reprocess, "from": iso(start), "noop": True})
        lease.release()
        return r
    # every table's commit carries the rewind's fence: a zombie batch still writing is refused from here on
    txn = Txn(app_id=rewind_app(name), version=epoch(tables, name) + 1, fence=(fence_app(name), lease.token))
    for table, version in r.targets.items():
        lease.check()
        t = tables.table(name, table)
        if table == "batches":
            t.clear(None if r.to_batch is None else f"batch > {r.to_batch}", txn=txn)
        elif version is None:
            t.clear(txn=txn)
        else:
            t.restore(version, txn=txn)
    redo = (r.last_time - (r.to_time or start)) // spec.batch_interval + 1
    deadline = datetime.now(UTC).timestamp() + redo * settings.airflow_task_timeout_s
    detail = {"from": iso(start), "to_batch": r.to_batch, "to_time": iso(r.to_time) if r.to_time else None,
              "last_batch": r.last_batch, "last_time": iso(r.last_time), "epoch": txn.version, "tables": r.targets,
              "deadline": iso(int(deadline * 1_000_000))} | ({"id": reprocess} if reprocess else {})
    record(tables, name, "reprocess", by, detail)
    lease.release()
    return r
