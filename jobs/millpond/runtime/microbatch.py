"""The micro-batch: one Airflow run = one batch, from landing files to panes in Delta.

The steps (``runtime.steps``), each timed into the marker's ``phases``: plan (which files, which state
versions; committed first so a rerun after a crash recomputes the same batch), read + quarantine, dedup,
watermark, compute (windows, triggers and accumulation per key, over the new elements and the state of
the keys they touch or whose timers are due, on the batch's engine), validate, then the commits, each
tagged with the application transaction (pipeline, batch) so a retried batch never applies anything
twice, with the ``batches`` row last as the commit marker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake import catalog
from millpond.lake.delta_options import fence_app, store_failure
from millpond.lake.landing import list_landing
from millpond.lake.lease import Lease
from millpond.lake.objectstore import ObjectStore, StoredObject
from millpond.lake.schemas import BATCHES_SCHEMA, OUTPUT_TABLES, PLAN_SCHEMA, STATE_TABLES
from millpond.lake.sql import sql_ts
from millpond.lake.tables import Tables, Txn
from millpond.model.clock import BatchClock
from millpond.model.spec import PipelineSpec
from millpond.model.timeutil import MIN_TS, to_datetime, to_us
from millpond.runtime import rewind
from millpond.runtime.commits import Commits, PhaseTimer
from millpond.runtime.engines import create_engine
from millpond.runtime.engines.base import BatchWork, Outputs
from millpond.runtime.failure import batch_failed
from millpond.runtime.steps import commit, compute, plan, validate, versions
from millpond.runtime.upkeep import expire_rows, expiry_horizon


def committed_versions(tables: Tables, pipeline: str) -> dict[str, int]:
    """Table versions as of the last committed batch: read at these, a reader never sees half a batch."""
    return catalog.committed_versions(tables, pipeline)


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
    #: how the batch ran where it differs from what was asked (a retry redoing its plan at the planned time)
    note: str = ""
    #: the engine and strategy that ran the batch (``engines.create_engine`` chose; e.g. spark/plan); empty if skipped
    engine: str = ""

    def summary(self) -> str:
        if self.skipped:
            return f"{self.pipeline}: batch at {self.processing_time.isoformat()} skipped: {self.reason}"
        c = self.counts
        return (
            f"{self.pipeline} batch {self.batch} @ {self.processing_time.isoformat()}: watermark "
            f"{self.watermark.isoformat() if self.watermark else '-'}; input {c.get('input', 0)}, accepted "
            f"{c.get('accepted', 0)}, duplicates {c.get('duplicates', 0)}, late {c.get('late', 0)}, "
            f"quarantined {c.get('quarantined', 0)}, panes {c.get('panes', 0)}"
            + (f", skipped {c['skipped']} (see `millpond history {self.pipeline}`)" if c.get("skipped") else "") + "; "
            + (f"engine {self.engine}; " if self.engine else "")
            + ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
            + (f" ({self.note})" if self.note else "")
        )


class MicroBatch:
    """One batch of one pipeline at one processing time: the context every step works on."""

    #: the pipeline's per-key step: ``windows`` (windowing, triggers, accumulation) or ``computation``
    kind = "windows"

    #: the tables this batch writes (the marker names their versions); a MillWheel computation has its own
    output_tables: tuple[str, ...] = OUTPUT_TABLES
    #: tables whose versions the plan pins (reads of state use them); a subclass adds its own
    state_tables: tuple[str, ...] = STATE_TABLES
    #: render the validation's Data Docs pages before the commits (a DAG run renders them after, when it publishes)
    render_docs: bool = True

    def __init__(self, settings: Settings, spec: PipelineSpec, spark=None, validate: bool = False,
                 owner: str | None = None) -> None:
        self.settings, self.spec, self.spark, self.validate = settings, spec, spark, validate
        self.owner = owner
        self.quality = None
        self.name = spec.name
        #: the pipeline and batch, as the task log names them (``runtime.progress``)
        self.label = spec.name
        self.strategy = spec.strategy()
        self.tables = Tables(settings, auto_checkpoint=False)
        self.store = ObjectStore(settings)
        #: threads beside the batch (the plan's commit, the upkeep step): made by each ``run``, joined
        #: before its lease goes
        self.background: ThreadPoolExecutor
        self.commits: Commits

    #: the rewinds the pipeline went through (``runtime.rewind``): part of its commits' application id
    epoch: int = 0
    #: the marker of the last batch committed before this one (None: the pipeline's first batch)
    previous: dict[str, Any] | None = None

    def txn(self, batch: int) -> Txn:
        """The batch's application transaction, fenced by this run's lease token (``lake.delta_options.Txn``)."""
        return Txn(app_id=rewind.app_id(self.name, self.epoch), version=batch,
                   fence=(fence_app(self.name), self.lease.token))

    # history the plan reads ----------------------------------------------------------------------
    def committed(self) -> pa.Table:
        return self.tables.read_whole(self.name, "batches", BATCHES_SCHEMA)

    def ingest_log(self) -> pa.Table:
        return self.tables.read_whole(self.name, "ingest_log", PLAN_SCHEMA)

    def plans_since(self, arrival: int) -> pa.Table:
        """The plans of the batches after ``arrival`` (and the operator's holds): all a listing from
        there needs to know which of its files are taken."""
        rows = self.tables.select(self.name, "ingest_log", f"processing_time >= {sql_ts(arrival)} OR "
                                  "processing_time IS NULL", schema=PLAN_SCHEMA)
        return pa.Table.from_arrays([rows.column(f.name).cast(f.type) if f.name in rows.column_names
                                     else pa.nulls(rows.num_rows, f.type) for f in PLAN_SCHEMA], schema=PLAN_SCHEMA)

    def landing(self, since: int | None) -> list[StoredObject]:
        """The landing listing (``lake.landing.list_landing``): whole, or from ``since`` on."""
        return list_landing(self.store, self.settings.bucket_landing, self.spec.source_prefix, since)

    # the run -------------------------------------------------------------------------------------
    def run(self, processing_time: datetime | int | str, watermark: datetime | int | str | None = None) -> BatchResult:
        """The batch, under the pipeline's lease (renewed while it runs, released at the end)."""
        self.lease = Lease.acquire(self.settings, self.name, owner=self.owner)
        self.background = ThreadPoolExecutor(max_workers=2)
        try:
            with self.lease.keep() as keeper:
                self.commits = Commits(self.tables, self.name, keeper.check, batch=0)
                try:
                    return self._run(to_us(processing_time), watermark)
                except MillpondError:
                    raise
                except Exception as exc:  # a bug, or input no rule covers: one line, the way forward
                    raise (store_failure(exc, self.settings) or batch_failed(
                        self.name, getattr(self, "batch", None), to_us(processing_time), exc)) from exc
        finally:
            # No commit left running behind an error or the lease; a step not yet started is dropped. Every
            # call these threads make is bounded (object_store.timeout), so this wait is too.
            self.background.shutdown(wait=True, cancel_futures=True)
            self.lease.release()

    def _run(self, P: int, explicit_watermark: datetime | int | str | None) -> BatchResult:
        t = PhaseTimer(self.label)
        t.begin("plan", at=to_datetime(P).isoformat())
        found = plan.read_history(self, P)
        prev, skip = plan.previous_batch(found["done"], P)
        if skip:
            t.lap("plan", nothing_to_do=skip)
            return BatchResult(self.name, prev["batch"], to_datetime(P), prev["watermark"], skipped=True, reason=skip)
        versions.check_spec(self, prev)  # a changed spec stops here, before anything is written
        self.previous = prev
        self.epoch = rewind.epoch(self.tables, self.name)  # batch numbers restart after a rewind: new txn ids
        batch = self.batch = self.commits.batch = (prev["batch"] if prev else 0) + 1
        t.label = self.label = f"{self.name} batch {batch}"
        txn = self.txn(batch)
        w_in = to_us(prev["watermark"]) if prev else MIN_TS
        explicit = to_us(explicit_watermark) if explicit_watermark is not None else None
        the_plan = plan.plan_batch(self, batch, txn, found, prev, P, explicit)
        P, explicit, note = plan.pinned_clock(the_plan, P, explicit)
        explicit_watermark = None if explicit is None else to_datetime(explicit)
        plan.start_upkeep(self, batch)
        t.lap("plan", files=len(the_plan["files"]), held=len(the_plan["held"]) or None,
              skipped=len(the_plan["skipped"]) or None)
        work = BatchWork(batch, txn, the_plan, prev, w_in, P, explicit_watermark,
                         self._planned_bytes(found["landing"], the_plan))
        out = create_engine(self, work).run(self, work, t)
        counts = {**out.counts, "skipped": len(the_plan["skipped"])}
        self._finish(txn, out, counts, t)
        return BatchResult(self.name, batch, to_datetime(P), to_datetime(out.clock.watermark), counts, t.phases,
                           note=note, engine=out.label)

    @staticmethod
    def _planned_bytes(listing: list[StoredObject], the_plan: dict[str, Any]) -> int:
        """The bytes of the batch's planned landing files (as listed)."""
        sizes = {o.key: o.size for o in listing}
        return sum(sizes.get(key, 0) for key in the_plan["files"])

    def _finish(self, txn: Txn, out: Outputs, counts: dict[str, Any], t: PhaseTimer) -> None:
        """The deferred commits (after the plan's commit and the upkeep step have landed), then the marker, which
        names the engine and strategy that ran the batch."""
        self.commits.plan_landed()
        t.lap("commit", quiet=True)
        self.commits.upkeep_landed()
        t.lap("maintain")  # what the batch waited for its upkeep step
        t.begin("commit", tables=len({table for _, table, _ in self.commits.deferred or ()}))
        probed = self.commits.flush(self.output_tables)
        t.lap("commit", quiet=True)
        commit.commit_marker(self, txn, out.clock, out.max_event_time,
                             {**counts, "engine": out.engine, "strategy": out.strategy}, t, probed)
        t.lap("commit", input=counts.get("input"), panes=counts.get("panes"))
        horizon = expiry_horizon(self.spec.expire, out.clock.watermark) if self.spec.expire else None
        if horizon is not None and horizon > expiry_horizon(self.spec.expire, out.clock.input_watermark):
            # after the marker: no commit of the batch is under way (a MERGE of ``current`` beside a deletion from
            # it would conflict), and a kill here loses nothing: the next expiry removes below a later horizon
            expired = expire_rows(self.tables, self.name, self.batch, horizon)
            t.lap("maintain", expired=sum(expired.values()) or None)

    def process(self, batch: int, txn: Txn, clock: BatchClock, accepted: pa.Table, plan: dict[str, Any],
                t: PhaseTimer, delivered: pa.Table | None = None) -> dict[str, int]:
        """Windows, triggers and panes for the batch's elements (a table of EVENT_COLUMNS), validated, then
        committed (a MillWheel computation replaces this step, see ``runtime.computation``). Returns counts
        for the marker."""
        t.begin("windowing", elements=accepted.num_rows)
        out, state_rows = compute.compute(self, batch, clock, accepted, plan)
        t.lap("windowing", state_rows_read=state_rows)
        t.lap("assemble", quiet=True)
        if self.validate:
            t.begin("validation")
            validate.validate(self, batch, clock, accepted if delivered is None else delivered, out.panes, out.state)
            t.lap("validation")
        counts = commit.commit_outputs(self, txn, out)
        counts["state_rows_read"] = state_rows
        return counts

    # for MillWheel computations, which commit their own tables (see ``runtime.computation``)
    def _step(self, name: str, write: Any, table: str | None = None) -> None:
        self.commits.step(name, write, table)
