"""A small batch as one Spark task: the executor reads the batch's files, runs the local engine's steps over
them, writes every output table's data files, and returns their add actions and the batch's counts; the batch's
process (the Connect client, holding the lease) commits each table's files as for the multi-stage plan.

Why: a batch of a few thousand events spends nearly all of the multi-stage plan's time (``spark_batch``: eight
or so Spark jobs) in per-job round trips (the server's planning, scheduling, a Python worker per stage), not in
its rows. Below ``engine.one_task_below`` rows (the files' events, estimated from their size, plus the stored
windows) the batch is one Spark job of one task instead. Reads and writes stay on the executor; the client
holds the file list and a few counts. Tables kept by MERGE on the local engine (``windows``, ``current``) are
rewritten copy-on-write, as by the plan. Both give the local engine's tables (``tests/test_cores.py``).

A validated batch (every DAG run's) is one task too: the task also returns the rows the suites read (the
accepted elements, the panes, the state; at most about ``engine.one_task_below`` of each), and the client
validates them with the local engine's suites (GX's pandas engine) before it queues a commit. On the plan,
Great Expectations' Spark engine runs 3-6 Spark jobs per suite, seconds whatever the batch's size.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.config import Settings
from millpond.lake import spark_io
from millpond.lake.file_commits import commit_files, live_files
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import (
    CURRENT_PARTITIONS,
    QUARANTINE_SCHEMA,
    SEEN_SCHEMA,
    WINDOWS_STATS_COLUMNS,
    current_file_schema,
    late_schema,
)
from millpond.lake.snapshot_files import Storage, data_files, read_file, table_schema
from millpond.lake.spark_frames import collected
from millpond.lake.tables import Tables, Txn
from millpond.model.clock import BatchClock
from millpond.model.panes import pane_schema
from millpond.model.spec import pipeline_from_dict
from millpond.model.state import WINDOW_KEY, WINDOWS_SCHEMA
from millpond.runtime.engines.base import BatchWork
from millpond.runtime.engines.spark_watchdog import watched

if TYPE_CHECKING:
    from millpond.runtime.commits import PhaseTimer
    from millpond.runtime.context import BatchContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskInput:
    """What the executor needs of the batch: plain values, pickled into the task."""

    settings: Settings
    spec: dict[str, Any]
    batch: int
    plan: dict[str, Any]
    prev: dict[str, Any] | None
    w_in: int
    processing_time: int
    #: the explicit watermark, as given to the batch (``runtime.steps.watermark.clock_for`` reads it)
    watermark: Any
    #: the current view's data files at ``current_version`` (URI, partition values) and its schema
    current: list[tuple[str, dict[str, Any]]]
    current_schema: pa.Schema | None
    #: a validated batch: the task also returns what the suites read (``frame_rows``), for the client to validate
    validate: bool = False


class _NoCommits:
    """The executor commits nothing: the steps' waits for the plan's commit and the upkeep step are the
    client's."""

    def plan_landed(self) -> None:
        return None

    def upkeep_landed(self) -> None:
        return None


class TaskBatch:
    """The batch's context (``runtime.context.BatchContext``) as the steps use it on an executor: reads at the
    plan's versions, no commits, no forked workers (a Spark task is one core)."""

    spark = None
    validate = False
    render_docs = False

    def __init__(self, given: TaskInput) -> None:
        self.settings = given.settings.with_overrides(driver_workers=0)
        self.spec = pipeline_from_dict(given.spec)
        self.strategy = self.spec.strategy()
        self.name = self.spec.name
        self.label = f"{self.name} batch {given.batch}"
        self.tables = Tables(self.settings, auto_checkpoint=False)
        self.store = ObjectStore(self.settings)
        self.commits = _NoCommits()


# on the executor ------------------------------------------------------------------------------------------------
def run_task(given: TaskInput, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in the executor: the whole batch; one row per data file written (``spark_io.WRITTEN``), then one
    row (table "") holding the batch's counts, clock and the phases timed here, as JSON."""
    from millpond.runtime.steps import compute, dedup, read, upstream, watermark

    for _ in batches:  # the one partition's index
        pass
    job = TaskBatch(given)
    phases: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now

    if job.spec.upstream is not None:  # a stage: its upstreams' planned panes as elements, read here
        good, bad = upstream.read_upstreams(job, given.plan), []
    else:
        good, bad = read.read_files(job, given.plan, given.processing_time)
    lap("ingest")
    seen_version = given.plan["versions"].get("seen_ids")
    accepted, kept, delivered = dedup.dedup(job, good, seen_version, given.w_in, copies=given.validate)
    lap("dedup")
    clock, max_et = watermark.advance_watermark(job, given.batch, given.processing_time, given.w_in, given.prev,
                                                accepted, given.plan, given.watermark)
    lap("watermark")
    out, state_read = compute.compute(job, given.batch, clock, accepted, given.plan)
    lap("windowing")
    written, changed, touched = write_tables(job, given, out, bad, accepted, kept)
    lap("write")
    if given.validate:
        written += frame_rows({"accepted": delivered,
                               "panes": out.panes, "state": out.state})
    meta = {"watermark": clock.watermark, "max_event_time": max_et, "changed": sorted(changed),
            "touched": sorted(touched),
            "seen_replaced": kept is not None and accepted.num_rows > 0, "phases": phases,
            "counts": {"input": good.num_rows + len(bad), "accepted": accepted.num_rows,
                       "duplicates": good.num_rows - accepted.num_rows, "quarantined": len(bad),
                       "late": out.late.num_rows, "panes": out.values, "retractions": out.retractions,
                       "state_rows_read": state_read}}
    yield task_result(written, meta)


def task_result(written: list[tuple[str, str]], meta: dict[str, Any]) -> pa.RecordBatch:
    """A task's one result batch (``spark_io.WRITTEN``): a row per file written (table, add action) or frame chunk,
    then one row (table "") holding ``meta``; read back by ``read_result``."""
    rows = [*written, ("", json.dumps(meta))]
    return pa.RecordBatch.from_arrays([pa.array([r[0] for r in rows], pa.string()),
                                       pa.array([r[1] for r in rows], pa.string())], schema=spark_io.WRITTEN)


def write_tables(job: TaskBatch, given: TaskInput, out, bad: list[tuple], accepted: pa.Table,
                 kept: pa.Table | None) -> tuple[list[tuple[str, str]], set[str], set[tuple[str, str]]]:
    """Every output table's data files (the local engine's commits, as files): (table, add action) per file,
    the tables the batch changes (a rewrite may leave no rows, hence no file), and the current view's (day,
    hour) partitions the batch rewrote."""
    from millpond.runtime.steps import dedup
    from millpond.runtime.steps.commit import quarantine_rows, seen_rows, seen_rows_kept, time_partitions

    tables: dict[str, tuple[pa.Table, list[str]]] = {}
    if out.late.num_rows:
        tables["late"] = out.late, []
    if out.panes.num_rows:
        tables["panes"] = out.panes, []
    if bad:
        tables["quarantine"] = quarantine_rows(bad, given.batch), []
    if accepted.num_rows and dedup.by_id(job):
        own = seen_rows(accepted, given.batch)
        tables["seen_ids"] = (own if kept is None else seen_rows_kept(kept, own)), []
    if out.state.num_rows:
        tables["windows"] = _windows(job, given, out.state), []
    touched: set[tuple[str, str]] = set()
    if out.current.num_rows:
        rows, _ = time_partitions(out.current, CURRENT_PARTITIONS)
        touched = {(d.isoformat(), str(h)) for d, h in zip(rows.column("window_end_day").to_pylist(),
                                                             rows.column("window_end_hour").to_pylist(), strict=True)}
        tables["current"] = _current(job, given, rows, touched), list(CURRENT_PARTITIONS)
    storage = Storage.of(job.settings)

    def one(name: str) -> list[tuple[str, str]]:
        rows, partition_by = tables[name]
        if not rows.num_rows:  # a rewrite that leaves nothing (every window closed): its commit only removes
            return []
        uri = job.settings.table_uri(job.name, name)
        return [(name, action) for action in spark_io.write_table(storage, uri, rows, partition_by)]

    with ThreadPoolExecutor(max_workers=max(1, len(tables))) as pool:
        written = [row for rows in pool.map(one, sorted(tables)) for row in rows]
    return written, set(tables), touched


def _windows(job: TaskBatch, given: TaskInput, changes: pa.Table) -> pa.Table:
    """``windows`` after the batch: the stored rows it did not change, plus its upserts (the local engine's
    MERGE, as a rewrite), by key and window."""
    new = changes.filter(pc.invert(changes.column("deleted")))
    version = given.plan["versions"].get("windows")
    if version is not None:
        old = job.tables.read_arrow(job.name, "windows", version=version, schema=WINDOWS_SCHEMA)
        old = old.select(WINDOWS_SCHEMA.names).cast(WINDOWS_SCHEMA)
        unchanged = old.join(changes.select(list(WINDOW_KEY)), keys=list(WINDOW_KEY), join_type="left anti")
        new = pa.concat_tables([unchanged.select(WINDOWS_SCHEMA.names), new])
    return new.sort_by([(k, "ascending") for k in WINDOW_KEY])


def _current(job: TaskBatch, given: TaskInput, rows: pa.Table, touched: set[tuple[str, str]]) -> pa.Table:
    """The touched partitions of the current view after the batch: their stored rows not replaced by the
    batch's, plus its rows that are not deletions (the local engine's MERGE, as a rewrite)."""
    on = [*WINDOW_KEY, *(["pane_index"] if job.spec.mode.value == "discarding" else [])]
    schema = current_file_schema(job.spec.pane_value_type)
    new = rows.filter(pc.invert(rows.column("deleted"))).select(schema.names).cast(schema)
    parts = [(uri, pv) for uri, pv in given.current
             if (str(pv.get("window_end_day")), str(pv.get("window_end_hour"))) in touched]
    if parts and given.current_schema is not None:
        storage = Storage.of(job.settings)
        batches = []
        for uri, pv in parts:
            filesystem, path = storage.filesystem(uri)
            batches += list(read_file(filesystem, path, given.current_schema, pv))
        old = pa.Table.from_batches(batches, schema=given.current_schema).select(schema.names).cast(schema)
        kept = old.join(rows.select(on), keys=on, join_type="left anti")
        new = pa.concat_tables([kept.select(schema.names), new])
    return new.set_column(schema.get_field_index("deleted"), "deleted",
                          pa.array([False] * new.num_rows, pa.bool_())).sort_by(
        [(k, "ascending") for k in (*CURRENT_PARTITIONS, *on)])


#: the tag of a row carrying part of a frame the suites read (``frame_rows``): ``<FRAME><name>``
FRAME = "frame:"
#: the base64 characters of an encoded frame per row (rows, not one cell: each stays within the result's batches)
FRAME_CHUNK = 1 << 20


def frame_rows(frames: dict[str, pa.Table]) -> list[tuple[str, str]]:
    """Tables as ``WRITTEN`` rows: each one's Arrow IPC stream, base64, in chunks of FRAME_CHUNK characters."""
    out = []
    for name, table in frames.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        text = base64.b64encode(sink.getvalue().to_pybytes()).decode()
        out += [(FRAME + name, text[i:i + FRAME_CHUNK]) for i in range(0, max(1, len(text)), FRAME_CHUNK)]
    return out


def read_frames(rows: list[tuple[str, str]]) -> dict[str, pa.Table]:
    """``frame_rows``' tables back (its rows in the order they were made)."""
    parts: dict[str, list[str]] = {}
    for tag, text in rows:
        parts.setdefault(tag[len(FRAME):], []).append(text)
    return {name: pa.ipc.open_stream(base64.b64decode("".join(texts))).read_all() for name, texts in parts.items()}


# on the client --------------------------------------------------------------------------------------------------
def run_one_task(job: BatchContext, work: BatchWork, timer: PhaseTimer
                 ) -> tuple[dict[str, int], BatchClock, int | None]:
    """The batch as one Spark task, then its commits queued with the batch's others; counts, clock, max event
    time. A Connect server that stops answering meanwhile fails the batch within ``spark.timeout``."""
    txn, the_plan, processing_time = work.txn, work.plan, work.processing_time
    current = current_view(job)
    given = TaskInput(job.settings, job.spec.raw, work.batch, the_plan, work.prev, work.w_in, processing_time,
                      work.watermark, *current_files(current), validate=job.validate)
    if job.validate:  # the suites' context loads while this thread waits on the task
        from millpond.quality.context import PANDAS, warm_context

        warm_context(job.settings, PANDAS)
    task = functools.partial(run_task, given)
    with watched(job.spark, job.settings.spark_connect_url, job.settings.spark_timeout_s):
        rows = collected(spark_io.map_arrow(job.spark.range(0, 1, 1, 1), task,
                                            spark_io.spark_schema(spark_io.WRITTEN), ["id"]))
    written, meta, frames = read_result(rows)
    timer.split("spark_task", meta["phases"], tasks=1)
    clock = BatchClock(batch=work.batch, processing_time=processing_time, input_watermark=work.w_in,
                       watermark=meta["watermark"])
    if job.validate:  # the local engine's suites on the task's rows, before any commit is queued
        from millpond.runtime.steps.validate import validate

        got = read_frames(frames)
        timer.begin("validation")
        try:
            validate(job, work.batch, clock, got["accepted"], got["panes"], got["state"])
        except Exception:
            _discard(job, written)
            raise
        timer.lap("validation")
    job.commits.defer()
    queue_commits(job, txn, the_plan, written, meta, current)
    counts = {"files": len(the_plan["files"]), **meta["counts"]}
    return counts, clock, meta["max_event_time"]


def current_view(job: BatchContext):
    """The pipeline's current view (None before its first write), which a task rewrites by partition: only one
    partitioned by ``window_end`` (``CURRENT_PARTITIONS``)."""
    current = job.tables.open(job.name, "current")
    if current is not None and tuple(current.metadata().partition_columns) != CURRENT_PARTITIONS:
        raise NotImplementedError("the Spark engine rewrites only current views partitioned by window_end")
    return current


def current_files(current) -> tuple[list[tuple[str, dict[str, Any]]], pa.Schema | None]:
    """``TaskInput.current`` and ``TaskInput.current_schema`` of the current view ``current`` (None: none yet)."""
    return ([], None) if current is None else (data_files(current), table_schema(current))


def read_result(rows: list) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[tuple[str, str]]]:
    """A task's result rows (``task_result``): each table's add actions, its ``meta`` ({} if it sent none), and
    the chunks of the frames it returned (``frame_rows``)."""
    written: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, Any] = {}
    frames = []
    for r in rows:
        if r["tbl"].startswith(FRAME):
            frames.append((r["tbl"], r["action"]))
        elif r["tbl"]:
            written.setdefault(r["tbl"], []).append(json.loads(r["action"]))
        else:
            meta = json.loads(r["action"])
    return written, meta, frames


def _discard(job: BatchContext, written: dict[str, list[dict[str, Any]]]) -> None:
    """The task's files of a batch its validation stopped: nothing will commit them (a retry writes its own)."""
    for table, files in written.items():
        try:
            job.tables.table(job.name, table).discard([a["path"] for a in files])
        except Exception as exc:  # noqa: BLE001 - the validation's failure is the one to report; a vacuum ends them
            log.warning("%s: the uncommitted files of %s stay until a full vacuum: %s", job.name, table, exc)


def queue_commits(job: BatchContext, txn: Txn, the_plan: dict[str, Any], written: dict[str, list[dict[str, Any]]],
                  meta: dict[str, Any], current) -> None:
    """Each changed table's files as one commit under the batch's transaction, replacing the files its rewrite
    read (``windows`` and a folded ``seen_ids`` at the plan's versions; the touched partitions of ``current``)."""
    versions = the_plan["versions"]
    touched = {tuple(p) for p in meta["touched"]}

    def removes(table: str) -> list[dict[str, Any]]:
        if table == "windows" or (table == "seen_ids" and meta["seen_replaced"]):
            return live_files(job.tables, job.name, table, versions.get(table))
        if table == "current" and current is not None:
            return [a for a in live_files(job.tables, job.name, "current", current.version())
                    if (a["partition_values"].get("window_end_day"),
                        a["partition_values"].get("window_end_hour")) in touched]
        return []

    pane_type = job.spec.pane_value_type
    schemas = {"late": late_schema(job.spec.value_type), "panes": pane_schema(pane_type),
               "quarantine": QUARANTINE_SCHEMA, "seen_ids": SEEN_SCHEMA, "windows": WINDOWS_SCHEMA,
               "current": current_file_schema(pane_type)}
    layout: dict[str, dict[str, Any]] = {"windows": {"stats_columns": WINDOWS_STATS_COLUMNS},
                                         "current": {"partition_by": CURRENT_PARTITIONS}}
    for table in meta["changed"]:
        job.commits.step(table, functools.partial(commit_files, job.tables, job.name, table, written.get(table, []),
                                                  schemas[table], txn, removes=removes(table),
                                                  **layout.get(table, {})))
