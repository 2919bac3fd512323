"""A one-key batch's per-key step and its writes in one Spark task, at the end of the batch's one job.

A stage that puts every upstream pane under one key (``key: all``) runs its per-key step in one task whatever the
width (``spark_batch.key_tasks``), over its lifted elements (``spark_lift``): about one row per window, plus the
late ones. On the rest of the multi-stage plan that step's output is kept on the server, counted by a job of its
own, and written by another: three actions the server plans for a handful of rows (about 0.6 s of a stage batch
over 780k upstream pane rows that took 2.3 s). Here the step's task writes its tables' files itself, as a small
batch's one task does (``spark_task.write_tables``: the local engine's tables, as files), and returns their add
actions and the counts. So the batch's read, lift, step and writes are one Spark job, and the client commits each
table's files under the batch's transaction (``spark_task.queue_commits``).

Only the step moves: the elements are read, made and lifted on executors as before, in as many tasks as before,
and nothing row-sized reaches the client.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.lake import spark_io
from millpond.lake.spark_frames import collected
from millpond.lake.tables import Txn
from millpond.model.clock import BatchClock
from millpond.runtime.assembly import Assembly
from millpond.runtime.engines import spark_keys
from millpond.runtime.engines.spark_keys import RANGE, step_input, step_rows
from millpond.runtime.engines.spark_lift import lift_for
from millpond.runtime.engines.spark_task import (
    TaskBatch,
    TaskInput,
    current_files,
    current_view,
    queue_commits,
    read_result,
    task_result,
    write_tables,
)

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: ``write_tables``' accepted elements: a stage keeps no ids (``steps.dedup.by_id``), so none
_NO_IDS = pa.table({"id": pa.array([], pa.string())})


def one_key(job: BatchContext) -> bool:
    """Whether the batch's step and writes run as one task here: a stage of one key (``key: all``) whose batch is
    not validated (a validated batch's suites read its panes and state on Spark, ``spark_batch.validate_batch``)."""
    up = job.spec.upstream
    return up is not None and up.key != "keep" and not job.validate


# on the executor ------------------------------------------------------------------------------------------------
def step_task(given: TaskInput, spec_json: str, clock: BatchClock, columnar: bool,
              batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in the executor: the batch's elements and stored windows (``spark_keys.step_input``, one partition)
    through the per-key step, every output table's data files written; one row per file (``spark_io.WRITTEN``),
    then one row (table "") with the counts, the tables changed and the current view's partitions touched."""
    job = TaskBatch(given)
    spec = job.spec
    got = [b for b in batches if b.num_rows]
    if got:
        sink, state_read, last = step_rows(spec_json, clock, spec.value_type, spec.pane_value_type,
                                           spec.mode.value == "discarding", columnar,
                                           pa.Table.from_batches(got).drop_columns([RANGE]))
    else:  # nothing new and no stored window in reach: nothing fires
        sink = Assembly(clock.batch, clock, spec.value_type, spec.pane_value_type,
                        spec.mode.value == "discarding").finish()
        state_read, last = 0, None
    written, changed, touched = write_tables(job, given, sink, [], _NO_IDS, None)
    meta = {"max_event_time": last, "changed": sorted(changed), "touched": sorted(touched), "seen_replaced": False,
            "counts": {"late": sink.late.num_rows, "panes": sink.values, "retractions": sink.retractions,
                       "state_rows_read": state_read}}
    yield task_result(written, meta)


# on the client --------------------------------------------------------------------------------------------------
def step_and_write(job: BatchContext, txn: Txn, the_plan: dict[str, Any], prev: dict[str, Any] | None,
                   w_in: int, explicit_watermark: Any, clock: BatchClock, accepted, state, rows: int,
                   biggest: float | None) -> dict[str, int | None]:
    """The batch's per-key step and writes as the last task of one Spark job, its commits queued with the
    batch's others; the marker's counts of the step (late, panes, retractions, stored windows read) and the
    elements' greatest event time (``max_event_time``, None without elements), as ``spark_batch.write_outputs``
    gives them. ``accepted``: the batch's elements; ``state``: the stored windows it can change (or None);
    ``rows``: the elements' count; ``biggest``: their values' largest magnitude (None: not known)."""
    current = current_view(job)
    given = TaskInput(job.settings, job.spec.raw, clock.batch, the_plan, prev, w_in, clock.processing_time,
                      explicit_watermark, *current_files(current))
    lift = lift_for(job.strategy, job.spec.value_type, clock.input_watermark, True, biggest, rows)
    combined, columns = step_input(accepted, state, job.spec.value_type, lift)
    spec_json = json.dumps(job.spec.raw, sort_keys=True, default=str)
    task = functools.partial(step_task, given, spec_json, clock, job.settings.columnar_windows)
    one = spark_keys.key_ranges(combined, 1, rows, 1)  # one task: no sample of key ranges
    got = collected(spark_io.map_arrow(one, task, spark_io.spark_schema(spark_io.WRITTEN), [*columns, RANGE]))
    written, meta, _frames = read_result(got)
    meta = meta or {"max_event_time": None, "changed": [], "touched": [], "seen_replaced": False,  # an empty task
                    "counts": {"late": 0, "panes": 0, "retractions": 0, "state_rows_read": 0}}
    job.commits.defer()
    queue_commits(job, txn, the_plan, written, meta, current)
    return {**meta["counts"], "max_event_time": meta["max_event_time"]}
