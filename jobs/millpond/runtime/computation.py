"""MillWheel computations (paper, sections 4-5) on the micro-batch: per-key user code with persistent
state, event- and processing-time timers, and productions to downstream streams.

A pipeline with ``computation: "module:Class"`` (or ``{class: "module:Class", <options>}``, passed
to the constructor) runs a :class:`Computation` instead of windowing and triggers. The batch
machinery is the same (``MicroBatch``: lease, plan, ingest, dedup, watermark, commit marker); only
the per-key step differs, so exactly-once, the single-writer lease and backfills carry over.

Semantics, per key and batch (deterministic: a rerun of a crashed batch redoes exactly the same work):

1. ``process_record`` for each of the batch's new records of the key, in (event_time, id) order;
2. then ``process_timer`` for each due timer, smallest (fire time, tag) first. An event timer is due
   when the low watermark (after this batch's advance) has reached its time, a processing timer when
   the batch's processing time has. Timers set by the handlers that are already due fire in the same
   batch (at most ``max_timer_firings`` per key and batch; the rest wait for the next batch and hold
   the output watermark).

Keys are independent: code sees only its key's state (``ctx.state``, a JSON-serialisable dict,
written back only when it changed; an empty dict deletes it) and timers (one per tag: setting a tag
again moves it). Timers and state live in the Delta tables ``comp_state`` and ``timers`` (MERGE,
consumed timers deleted; the Spark engine rewrites them copy-on-write to the same rows,
``engines.spark_computation``); a batch reads only the rows of its keys and of keys with due timers, at the
versions its plan recorded. Productions go to Delta tables ``<pipeline>/<stream>`` (declared in
``output_streams``), appended once per batch under the batch's application transaction.

The stage's output low watermark (for downstream consumers) is min(input low watermark, oldest
pending event timer), kept monotonic, one row per batch in ``watermarks``. Every event timer of a
key the batch did not touch is later than the input low watermark (else it would have been due and
its key touched), so only the touched keys' leftover due timers can hold it: no global scan.
"""


from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.schemas import STATE_TABLES
from millpond.lake.tables import Txn, sql_in, sql_ts
from millpond.model.clock import BatchClock
from millpond.model.computation import (
    COMPUTATION_TABLES,
    EVENT,
    KeyOutcome,
    Record,
    Timer,
    load_computation,
    run_key,
)
from millpond.model.spec import PipelineSpec
from millpond.runtime.assembly import ts_array, us_column
from millpond.runtime.commits import PhaseTimer
from millpond.runtime.computation_tables import (
    STATE_SCHEMA,
    STATE_STATS,
    TIMERS_SCHEMA,
    TIMERS_STATS,
    commit_watermark,
    production_table,
    stream_schema,
)
from millpond.runtime.layout import EVENT_COLUMNS
from millpond.runtime.microbatch import MicroBatch, committed_versions
from millpond.runtime.steps.validate import validate_streams


# -- the batch ------------------------------------------------------------------------------------
class ComputationBatch(MicroBatch):
    """A micro-batch whose per-key step is a user :class:`Computation` instead of windowing.

    On the local engine ``process`` runs it in the batch's process; on the Spark engine
    (``engines.spark_computation``) the same ``run_key`` runs on executors, each key with its stored state and
    timers, and the same tables come out (``runtime.computation_tables``). The pane quality suites do not apply;
    with ``validate`` each output stream that has a committed suite (``millpond_stream_<stream>``) is validated
    before the commits. Record ids expire only with ``dedup: {horizon: ...}`` (no window to derive it from).
    """

    state_tables = (*STATE_TABLES, *COMPUTATION_TABLES)
    kind = "computation"

    def __init__(self, settings: Settings, spec: PipelineSpec, spark=None, validate: bool = False,
                 owner: str | None = None) -> None:
        super().__init__(settings, spec, spark, validate=validate, owner=owner)
        try:
            self.computation = load_computation(spec.raw["computation"])
        except ValueError as exc:
            raise MillpondError(f"{spec.name}: {exc}") from exc
        self.streams = dict(self.computation.output_streams)
        self.output_tables = ("quarantine", "seen_ids", "ingest_log", *COMPUTATION_TABLES, *sorted(self.streams))

    def process(self, batch: int, txn: Txn, clock: BatchClock, accepted: pa.Table, plan: dict[str, Any],
                t: PhaseTimer, delivered: pa.Table | None = None) -> dict[str, int]:
        """Run the computation over the batch's keys and the keys with due timers; commit state,
        timers, productions and the output watermark, each under the batch's transaction. (``delivered`` is
        unused: a computation's batch validates its output streams, not its input.)"""
        versions = plan["versions"]
        by_key: dict[str, list[Record]] = defaultdict(list)
        for i, k, v, et, at in zip(*(accepted.column(c).to_pylist() for c in EVENT_COLUMNS), strict=True):
            by_key[k].append(Record(i, k, v, et, at, et < clock.input_watermark))
        v_timers, v_state = versions.get("timers"), versions.get("comp_state")
        keys = sorted(set(by_key) | self._due_keys(v_timers, clock))
        stored_timers, stored_state = self._read_state(keys, v_timers, v_state)
        t.lap("state_read")
        outcomes = [run_key(self.computation, k, by_key.get(k, []), stored_state.get(k), stored_timers.get(k, {}),
                            clock) for k in keys]
        t.lap("computation")
        produced = self._productions(batch, outcomes)
        if self.validate:
            validate_streams(self, batch, produced, clock)
            t.lap("validation")
        self._commit_outcomes(batch, txn, clock, outcomes, produced, versions.get("watermarks"))
        t.lap("commit_state")
        return {"late": sum(o.late for o in outcomes), "panes": 0, "retractions": 0,
                "state_rows_read": len(stored_state) + sum(len(v) for v in stored_timers.values()),
                "keys": len(keys), "timers_fired": sum(o.fired for o in outcomes),
                "productions": sum(len(o.productions) for o in outcomes)}

    def _due_keys(self, version: int | None, clock: BatchClock) -> set[str]:
        if version is None:
            return set()
        where = (f"(domain = 'event' AND fire_at <= {sql_ts(clock.watermark)}) OR "
                 f"(domain = 'processing' AND fire_at <= {sql_ts(clock.processing_time)})")
        got = self.tables.select(self.name, "timers", where, columns=["key"], version=version)
        return set(got.column("key").to_pylist())

    def _read_state(self, keys: list[str], v_timers: int | None, v_state: int | None
                    ) -> tuple[dict[str, dict[str, Timer]], dict[str, str]]:
        """Only the rows of the batch's keys, at the versions the plan recorded."""
        timers: dict[str, dict[str, Timer]] = defaultdict(dict)
        state: dict[str, str] = {}
        if not keys:
            return timers, state
        if v_timers is not None:
            tt = self.tables.select(self.name, "timers", sql_in("key", keys), version=v_timers)
            for k, tag, dom, at in zip(tt.column("key").to_pylist(), tt.column("tag").to_pylist(),
                                       tt.column("domain").to_pylist(), us_column(tt, "fire_at"), strict=True):
                timers[k][tag] = Timer(k, tag, dom, at)
        if v_state is not None:
            st = self.tables.select(self.name, "comp_state", sql_in("key", keys), columns=["key", "state"],
                                    version=v_state)
            state = dict(zip(st.column("key").to_pylist(), st.column("state").to_pylist(), strict=True))
        return timers, state

    def _productions(self, batch: int, outcomes: list[KeyOutcome]) -> dict[str, pa.Table]:
        """The batch's productions as one table per stream, in key order, then each key's own order."""
        produced: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for o in outcomes:
            for stream, rec in o.productions:
                produced[stream].append({**rec, "batch": batch})
        return {stream: self._production_table(stream, rows) for stream, rows in sorted(produced.items())}

    def _commit_outcomes(self, batch: int, txn: Txn, clock: BatchClock, outcomes: list[KeyOutcome],
                         produced: dict[str, pa.Table], v_watermarks: int | None) -> None:
        name = self.name
        states = [o for o in outcomes if o.state_changed]
        if states:
            table = pa.table({"key": [o.key for o in states], "state": pa.array([o.state for o in states], pa.string()),
                              "batch": pa.array([batch] * len(states), pa.int64()),
                              "deleted": pa.array([o.state is None for o in states], pa.bool_())}, schema=STATE_SCHEMA)
            self._step("comp_state", lambda tb=table: self.tables.merge(
                name, "comp_state", tb, on=["key"], delete_when="s.deleted", txn=txn, stats_columns=STATE_STATS))
        rows = [(tm.key, tm.tag, tm.domain, tm.at, False) for o in outcomes for tm in o.timer_upserts]
        rows += [(o.key, tag, EVENT, 0, True) for o in outcomes for tag in o.timer_deletes]
        if rows:
            rows.sort(key=lambda r: (r[0], r[1]))
            table = pa.table({"key": [r[0] for r in rows], "tag": [r[1] for r in rows], "domain": [r[2] for r in rows],
                              "fire_at": ts_array(r[3] for r in rows),
                              "batch": pa.array([batch] * len(rows), pa.int64()),
                              "deleted": pa.array([r[4] for r in rows], pa.bool_())}, schema=TIMERS_SCHEMA)
            self._step("timers", lambda tb=table: self.tables.merge(
                name, "timers", tb, on=["key", "tag"], delete_when="s.deleted", txn=txn, stats_columns=TIMERS_STATS))
        for stream, table in produced.items():
            self._step(f"produce_{stream}", lambda s=stream, tb=table: self.tables.append(name, s, tb, txn=txn),
                       table=stream)
        commit_watermark(self, txn, clock, min((o.held_by for o in outcomes if o.held_by is not None), default=None),
                         v_watermarks)

    def _production_table(self, stream: str, rows: list[dict[str, Any]]) -> pa.Table:
        return production_table(self.name, stream, stream_schema(self.streams.get(stream)), rows)


def output_watermark(tables, pipeline: str) -> int | None:
    """The stage's output low watermark as of its last committed batch (for downstream consumers)."""
    version = committed_versions(tables, pipeline).get("watermarks")
    if version is None:
        return None
    last = tables.select(pipeline, "watermarks", "batch = (SELECT max(batch) FROM t)", columns=["output_watermark"],
                         version=version)
    return us_column(last, "output_watermark")[0] if last.num_rows else None


__all__ = ["ComputationBatch", "output_watermark"]
