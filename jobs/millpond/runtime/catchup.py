"""Catch-up: while a backfill or a reprocess catches up to where a pipeline is, its live runs wait.

A live batch in between would take the files of every interval still to do in one batch, and the
backfill's runs would then find a later batch committed. A hold is a row of the pipeline's ``operations``
table (never rewound) naming the end to reach and a deadline; it ends when the pipeline's batches reach
that end, when the command that started it says so, or at the deadline.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from millpond.config import Settings
from millpond.lake.schemas import BATCHES_SCHEMA, OPERATIONS_SCHEMA
from millpond.lake.tables import Tables
from millpond.model.timeutil import iso, to_us


def record(tables: Tables, pipeline: str, operation: str, by: str, detail: dict[str, Any]) -> None:
    """One row of the pipeline's ``operations`` table (never rewound)."""
    row = pa.Table.from_pylist([{"at": datetime.now(UTC), "operation": operation, "by": by,
                                 "detail": json.dumps(detail, sort_keys=True)}], schema=OPERATIONS_SCHEMA)
    tables.append(pipeline, "operations", row)


def recorded(tables: Tables, pipeline: str, operation: str, op_id: str) -> bool:
    """Whether an ``operation`` row with this id (its detail's ``id``) is in the pipeline's operations."""
    if not tables.exists(pipeline, "operations"):
        return False
    ops = tables.read_arrow(pipeline, "operations", schema=OPERATIONS_SCHEMA).to_pylist()
    return any(o["operation"] == operation and json.loads(o["detail"] or "{}").get("id") == op_id for o in ops)


def hold_live_runs(settings: Settings, tables: Tables, pipeline: str, until: int, batches: int, by: str) -> None:
    """While a backfill catches up to ``until`` (µs), the pipeline's live runs wait (``catching_up``): a live
    run in between would take the files of the intervals still to do in one batch, and the backfill's runs
    would then find a later batch committed. Bounded: batches × the task timeout at the most."""
    deadline = datetime.now(UTC).timestamp() + batches * settings.airflow_task_timeout_s
    record(tables, pipeline, "backfill", by, {"last_time": iso(until), "deadline": iso(int(deadline * 1_000_000))})


def release_live_runs(tables: Tables, pipeline: str, by: str) -> None:
    """The backfill ended (or gave up): live runs go on at once."""
    record(tables, pipeline, "backfill ended", by, {})


def catching_up(tables: Tables, pipeline: str) -> str:
    """Why a live run of ``pipeline`` must leave its files to a later one ('' if it need not): a backfill or
    a reprocess is catching up to where the pipeline is and has not got there, and its deadline (its
    batches × the task timeout) has not passed."""
    if not tables.exists(pipeline, "operations"):
        return ""
    ops = tables.read_arrow(pipeline, "operations", schema=OPERATIONS_SCHEMA).sort_by("at").to_pylist()
    # a reprocess's run that found nothing to rewind (recorded so that a retry of it rewinds nothing) neither
    # holds live runs nor ends a hold: the runs of a reprocess started in the UI record one each
    ops = [o for o in ops if not (o["operation"] == "reprocess" and json.loads(o["detail"] or "{}").get("noop"))]
    last_op = json.loads(ops[-1]["detail"] or "{}") if ops else {}
    if not last_op.get("deadline"):
        return ""
    until, deadline = to_us(last_op["last_time"]), to_us(last_op["deadline"])
    done = tables.read_arrow(pipeline, "batches", schema=BATCHES_SCHEMA, columns=["processing_time"])
    reached = max((to_us(t) for t in done.column("processing_time").to_pylist()), default=0)
    if reached >= until or to_us(datetime.now(UTC)) > deadline:
        return ""
    return (f"{ops[-1]['operation']} of {pipeline} is catching up to {iso(until)} (at {iso(reached)} now; until "
            f"{iso(deadline)} at the latest): this live run leaves its files to the first live run after it")


def upstream_batches_after(tables: Tables, upstreams: list[str], after: int) -> list[int]:
    """The processing times (us) of the upstreams' committed batches after ``after``, in order: what an
    asset-triggered stage run goes on to (an upstream event that arrives while the stage's run is active can
    wait in Airflow's queue until the next one, apache/airflow#56050; its batch is read now, and its own run,
    when it comes, finds the batch committed)."""
    times: set[int] = set()
    for name in upstreams:
        if tables.exists(name, "batches"):
            rows = tables.read_arrow(name, "batches", columns=["processing_time"]).column(0).to_pylist()
            times |= {to_us(t) for t in rows if t is not None and to_us(t) > after}
    return sorted(times)
