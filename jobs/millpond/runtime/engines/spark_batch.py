"""The Spark engine for a whole batch: a PySpark job on the warm Spark, from landing files to Delta commits.

Executors read and parse the planned landing files, deduplicate them against each other and against the
ids earlier batches accepted, run the per-key step (windows, triggers, accumulation: the model's own code)
over each key's new elements together with its stored windows, and write every output table's data files.
The batch's process (a Spark Connect client, holding the pipeline's lease) only plans, reads small
aggregates (counts, event-time bounds, the partitions touched) and commits each table's files in one Delta
commit under the batch's application transaction. Tables kept by MERGE on the local engine (``windows``,
``current``) are rewritten copy-on-write: the files a batch changes are replaced, in the same commit.

Every read and write is a ``mapInArrow`` over files the client planned (``lake.spark_io``), not a Python data
source: no planner processes start on the server per batch, and every table's files are written in one job.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.config import Settings
from millpond.lake import spark_io, spark_ranged
from millpond.lake.file_commits import commit_files, live_files
from millpond.lake.schemas import (
    CURRENT_PARTITIONS,
    QUARANTINE_SCHEMA,
    SEEN_SCHEMA,
    WINDOWS_STATS_COLUMNS,
    current_file_schema,
    late_schema,
)
from millpond.lake.spark_frames import collected, local_frame
from millpond.lake.tables import Txn
from millpond.model.clock import BatchClock
from millpond.model.panes import pane_schema
from millpond.model.stages import ALL_KEY
from millpond.model.state import WINDOW_KEY, WINDOWS_SCHEMA
from millpond.runtime.engines.base import BatchWork
from millpond.runtime.engines.spark_counts import output_counts
from millpond.runtime.engines.spark_keep import keep, release
from millpond.runtime.engines.spark_keys import per_key_step
from millpond.runtime.engines.spark_lift import lift_for
from millpond.runtime.engines.spark_one_key import one_key, step_and_write
from millpond.runtime.engines.spark_state import FILE_ROWS, StateFiles, ranged, state_files
from millpond.runtime.engines.spark_upstream import Tally, stage_tally
from millpond.runtime.engines.spark_values import batch_values, with_values
from millpond.runtime.engines.spark_watchdog import watched
from millpond.runtime.engines.spark_width import ShuffleWidth
from millpond.runtime.steps.dedup import by_id, seen_keep_from
from millpond.runtime.steps.read import held_rows
from millpond.runtime.steps.validate import first_retracted

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext


#: rows one task of a batch's shuffles takes (the per-key step's partitions)
ROWS_PER_TASK = 250_000
#: rows one task of a batch's landing read parses (``read_tasks``)
READ_ROWS_PER_TASK = 50_000
#: a batch of fewer rows broadcasts its ids to the ``seen_ids`` scan (``marked_firsts``): about 40 bytes an id
SEEN_PROBE_BELOW = 1_000_000


def ts_column(column: str):
    from pyspark.sql import functions as F

    return F.timestamp_micros(F.col(column)).alias(column)


def batch_column():
    """The tables' ``batch`` column, from the batch's values row (``runtime.spark_values``)."""
    from pyspark.sql import functions as F

    return F.col("_batch").cast("int").alias("batch")


def batch_partitions(settings: Settings, rows: int) -> int:
    """The batch's shuffle partitions: one task per ``ROWS_PER_TASK`` rows, at most ``spark.shuffle_partitions``.
    A small batch then runs a handful of tasks (each costs a Python worker round trip and, when it writes,
    a file per table) instead of the deployment's full width; the tables do not depend on it."""
    return max(1, min(settings.spark_shuffle_partitions, -(-rows // ROWS_PER_TASK)))


def read_tasks(settings: Settings, partitions: int, rows: int | None) -> int:
    """The landing read's tasks: at least the batch's ``partitions``, and one per ``READ_ROWS_PER_TASK`` of its
    about ``rows`` (None: not known) up to the deployment's width. Parsing is the read's cost (about 10 us a
    row), so a batch of 100k rows read in one task left a core idle for a second while its shuffles needed one
    partition. A file is never split, so a batch of one file reads in one task whatever this says."""
    if rows is None:
        return partitions
    return max(partitions, min(settings.spark_shuffle_partitions, -(-rows // READ_ROWS_PER_TASK)))


def read_and_dedup(job: BatchContext, the_plan: dict[str, Any], processing_time: int, w_in: int, seen,
                   partitions: int, rows_planned: int | None = None, tally: Tally | None = None):
    """(the quarantined rows, the accepted elements, counts, max event time, the kept rows, the values' largest
    magnitude or None where not taken (a stage's: ``spark_lift``)): parsed on
    executors (in at most ``partitions`` tasks; a stage's elements: ``stage_elements``), first of each id
    by (arrival, file, line), ids seen by earlier batches (``seen``, the ``seen_ids`` snapshot, or None) dropped
    when their event time is within the batch's range, as on the local engine. Only counts come back.
    ``rows_planned``: about how many rows the batch handles (below SEEN_PROBE_BELOW its ids probe ``seen``,
    ``marked_firsts``); None when not known. ``tally``: a stage's elements counted already (``stage_tally``)."""
    from pyspark.sql import functions as F

    spark = job.spark
    if job.spec.upstream is not None:  # a stage: its upstreams' panes as elements, in the same columns
        from millpond.runtime.engines.spark_upstream import stage_elements, stage_input

        return stage_elements(spark, stage_input(job, the_plan, partitions), tally)
    rows = spark_io.read_landing(spark, job.settings, list(zip(the_plan["files"], the_plan["arrivals"], strict=True)),
                                 job.spec.value_type, processing_time,
                                 tasks=read_tasks(job.settings, partitions, rows_planned))
    probe = rows_planned is not None and rows_planned < SEEN_PROBE_BELOW  # (None: not known, no probe)
    marked, held = marked_firsts(rows, seen, spark if probe else None)
    marked = keep(spark, marked)
    bad = marked.where(F.col("reason").isNotNull()).select(*rows.columns)
    fresh = F.col("reason").isNull() & F.col("_seen").isNull()
    accepted = marked.where(fresh).select("id", "key", "value", "event_time", "arrival_time")
    # every tally in one Spark job, the one that fills ``marked`` (each action costs a job's round trip)
    tally = collected(marked.agg(
        F.count("reason").alias("bad"),
        F.coalesce(F.sum(F.when(F.col("reason").isNull(), F.col("_c"))), F.lit(0)).alias("good"),
        F.count(F.when(fresh, F.lit(1))).alias("n"), F.max(F.when(fresh, F.col("event_time"))).alias("max_et"),
    ))[0]
    if held is not None:  # ``marked`` holds its rows now
        held.unpersist()
    held = held_rows(the_plan)
    if held:  # files an operator held: one quarantined row each, as on the local engine
        bad = bad.unionByName(spark.createDataFrame([(None,) * 7 + (k, line, raw, why) for k, line, raw, why
                                                     in held], schema=bad.schema))
    counts = {"input": tally["good"] + tally["bad"] + len(held), "accepted": tally["n"],
              "duplicates": tally["good"] - tally["n"], "quarantined": tally["bad"] + len(held)}
    return bad, accepted, counts, tally["max_et"], marked, None


def marked_firsts(rows, seen, probe=None) -> tuple[Any, Any]:
    """The parsed rows (``spark_io.landing_schema``) reduced to what a batch keeps, in one pass over the files:
    every quarantined row, and the first of each id by (arrival, file, line), with ``_c``, how many rows had its
    id, and ``_seen``, true when an earlier batch accepted it (``seen``: the ``seen_ids`` snapshot, or None; only
    its ids within the batch's event-time range count, as on the local engine). The files are read once: the
    counts come from these rows, not from a second read or a cache of every parsed row. ``probe`` (the batch's
    session, or None): the firsts are kept, and their ids broadcast to the ``seen_ids`` scan, whose matches alone
    meet the rows (a batch below SEEN_PROBE_BELOW rows); else every stored id in range is shuffled to the rows
    (``seen_ids`` holds up to two dedup horizons of ids: a later batch of a 1M-event sequence shuffled 0.9M of
    them to find 1k). Returns (the marked rows, the kept firsts to release once those are kept, or None)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    is_bad = F.col("reason").isNotNull()
    # a quarantined row has no id: a group of its own per (file, line), so bad rows spread over the tasks too; an
    # element sorts first in its group whatever (a bad row is kept anyway), and only elements count in ``_c``
    group = F.coalesce(F.col("id"), F.concat(F.lit("\u0000"), F.col("source_file"), F.lit(":"),
                                             F.col("line").cast("string")))
    first = Window.partitionBy("_g").orderBy(is_bad, "arrival_time", "file_rank", "pos")
    every = first.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    firsts = (rows.withColumn("_g", group).withColumn("_n", F.row_number().over(first))
              .withColumn("_c", F.count(F.when(~is_bad, F.lit(1))).over(every))
              .where(is_bad | (F.col("_n") == 1)).drop("_n"))
    if seen is None:
        return firsts.drop("_g").withColumn("_seen", F.lit(None).cast("boolean")), None
    held = None
    if probe is not None:  # read by the bounds, the ids and the rows: the files are read once
        firsts = held = keep(probe, firsts, now=True)
    # the batch's event-time range joined in the plan (a one-row broadcast), not collected first
    bounds = firsts.where(~is_bad).agg(F.min("event_time").alias("_lo"), F.max("event_time").alias("_hi"))
    known = (seen.select(F.col("id").alias("_k"), F.unix_micros("event_time").alias("_et"))
             .crossJoin(F.broadcast(bounds)).where(F.col("_et").between(F.col("_lo"), F.col("_hi"))))
    if probe is not None:
        ids = firsts.where(~is_bad).select(F.col("_g").alias("_b"))
        known = known.join(F.broadcast(ids), F.col("_k") == F.col("_b"), "left_semi")
    known = known.select("_k").dropDuplicates(["_k"]).withColumn("_seen", F.lit(True))
    # on the window's own partitioning (``_g``): the rows are not shuffled again for the join (with ``probe``,
    # the few matches are broadcast to them)
    marked = firsts.join(F.broadcast(known) if probe is not None else known, F.col("_g") == F.col("_k"), "left")
    return marked.select(*rows.columns, "_c", F.when(~is_bad, F.col("_seen")).alias("_seen")), held


def delays(accepted) -> list[int]:
    """arrival - event time per element, for the percentile watermark policy (the one policy that needs
    more than an aggregate)."""
    return [r[0] for r in accepted.selectExpr("arrival_time - event_time").orderBy(1).collect()]


def stored_windows(job: BatchContext, files: StateFiles | None, accepted, clock: BatchClock,
                   tally: Tally | None = None):
    """The stored windows this batch can change (due timers, or reachable by a new element of its key), with
    times as microseconds: only those rows of the ``windows`` files the batch reads (``files``), read and
    filtered file by file on executors (``lake.spark_ranged.read_touched``); None without any. ``tally``: a
    one-key stage's elements counted (``stage_tally``), whose range is the key's where it was counted (the elements
    are not read for it: ``Tally.timed``)."""
    from pyspark.sql import functions as F

    if files is None or not files.files:
        return None
    if tally is not None and tally.timed:
        ranges = tally.ranges(job.spark, ALL_KEY)
    else:
        ranges = accepted.groupBy("key").agg(F.min("event_time").alias("lo"), F.max("event_time").alias("hi"))
    return spark_ranged.read_touched(job.spark, ranges, files.files, files.always, job.settings, WINDOWS_SCHEMA,
                                     clock.watermark, clock.processing_time, job.strategy.window_fn.reach(),
                                     job.settings.spark_shuffle_partitions)


def compute(job: BatchContext, clock: BatchClock, accepted, state, partitions: int, rows: int,
            now: bool = False, biggest: float | None = None):
    """The per-key step on executors (``spark_keys.per_key_step``); the output rows of every table, tagged.
    ``now``: run here (a validated batch: so that its validation phase holds validation, not the step); else
    by the output's tally. ``rows``: the batch's elements (it sizes the sample of the step's key ranges);
    ``biggest``: their values' largest magnitude, or None (a batch's elements may be lifted, ``spark_lift``)."""
    spec_json = json.dumps(job.spec.raw, sort_keys=True, default=str)
    lift = lift_for(job.strategy, job.spec.value_type, clock.input_watermark, key_tasks(job, 2) == 1, biggest,
                    rows)
    return keep(job.spark, per_key_step(spec_json, clock, accepted, state, job.spec.value_type,
                                        job.spec.pane_value_type, job.spec.mode.value == "discarding",
                                        job.settings.columnar_windows, key_tasks(job, partitions), rows,
                                        key_tasks(job, job.settings.spark_shuffle_partitions), lift), now=now)


def key_tasks(job: BatchContext, partitions: int) -> int:
    """The per-key step's tasks. A stage that puts every upstream pane under one key (``key: all``) has one
    key, which one task runs whatever the width: one task, and no sampling job for key ranges that could not
    split it. (The tables do not depend on the number of tasks.)"""
    up = job.spec.upstream
    return 1 if up is not None and up.key != "keep" else partitions


def write_outputs(job: BatchContext, txn: Txn, values, bad, accepted, out, panes, versions: dict[str, Any],
                  seen, partitions: int, keep_from: int | None, quarantined: int,
                  accepted_rows: int, stored_files: StateFiles | None = None) -> dict[str, int | None]:
    """Every output table's files from the executors in one Spark job, each table one commit; counts for the marker,
    and ``max_event_time``: the per-key step's elements' greatest event time (None: none). ``values``: the batch's
    (``spark_values``: ``_batch``, ``_keep_from``); ``panes``: a validated batch's numbered panes (``panes_frame``),
    or None (numbered here from the counts the writes take); ``stored_files``: the ``windows`` files the batch read
    at ``versions["windows"]`` (None without one, ``spark_state``); ``seen``: the ``seen_ids`` table at
    ``versions["seen_ids"]`` (None without one); ``keep_from``: as ``steps.dedup.seen_keep_from``; ``quarantined``:
    ``bad``'s rows (none: no quarantine write, whose tasks would only scan the landing rows for nothing);
    ``accepted_rows``: ``accepted``'s (none: no ``seen_ids`` write, not even its fold, as on the local engine,
    ``steps.commit.commit_inputs``: a quiet batch that expired ids here left them on the other engines, and an old
    id re-delivered after it was a late row here and a duplicate there)."""
    from pyspark.sql import functions as F

    batch = batch_column()
    groups = output_counts(out)
    if panes is None:  # numbered from the counts just taken: no job of its own
        panes = panes_frame(out, values, task_offsets({r["p"]: r["m"] for r in groups if r["tbl"] == "read"}))
    tally: dict[str, int] = {}
    for r in groups:
        tally[r["tbl"] + ":" + (r["kind"] or "")] = tally.get(r["tbl"] + ":" + (r["kind"] or ""), 0) + r["n"]
    touched = {(r["d"].isoformat(), str(r["h"])) for r in groups if r["tbl"] == "current"}
    last = max((r["e"] for r in groups if r["tbl"] == "read" and r["e"] is not None), default=None)
    state_changes = sum(r["n"] for r in groups if r["tbl"] == "state")
    state_read = sum(r["n"] for r in groups if r["tbl"] == "read")
    pane_type, value_type = job.spec.pane_value_type, job.spec.value_type
    late = with_values(out.where("tbl = 'late'"), values).select(
        "id", "key", F.col("late_value").alias("value"), ts_column("event_time"), ts_column("arrival_time"),
        "reason", batch)
    # at most ``partitions`` tasks (files) per table: ``bad`` has one partition per landing file
    quarantine = with_values(bad, values).select("source_file", "line", "raw", "reason", batch).coalesce(partitions)
    own = with_values(accepted, values).select("id", ts_column("event_time"), batch)
    appends = [("late", late, late_schema(value_type)), ("panes", panes, pane_schema(pane_type)),
               ("quarantine", quarantine, QUARANTINE_SCHEMA)]
    writes: list[tuple[str, Any, Callable[[list[dict]], Any]]] = []
    for table, df, schema in appends:
        if tally.get(f"{table}:", 0) or (table == "quarantine" and quarantined) or tally.get(f"{table}:value") \
                or tally.get(f"{table}:retraction"):
            writes.append(append_write(job, txn, table, df, schema))
    if accepted_rows and by_id(job):
        writes.append(append_write(job, txn, "seen_ids", own, SEEN_SCHEMA) if keep_from is None
                      else rewrite_seen(job, txn, seen, own, values, versions["seen_ids"], partitions))
    if state_changes:
        writes.append(_rewrite_windows(job, txn, values, out, stored_files, partitions, state_changes))
    if touched:
        writes.append(_rewrite_current(job, txn, values, out, touched, partitions))
    # the Spark job runs now, on this thread; the Delta commits wait with the batch's others, in this order
    written = spark_io.collect_writes([w for _t, w, _c in writes])
    for table, _w, commit in writes:
        job.commits.step(table, functools.partial(commit, written.get(table, [])))
    return {"late": tally.get("late:", 0), "panes": tally.get("panes:value", 0),
            "retractions": tally.get("panes:retraction", 0), "state_rows_read": state_read, "max_event_time": last}


def task_offsets(panes: dict[int, int]) -> list[tuple[int, int]]:
    """(task, the panes of the tasks before it), from each of the per-key step's tasks' panes."""
    offsets, before = [], 0
    for part in sorted(panes):
        offsets.append((part, before))
        before += panes[part] or 0
    return offsets


def panes_frame(out, values, offsets: list[tuple[int, int]] | None = None):
    """The ``panes`` rows, numbered batch-wide by key then emission order (the local engine's ``seq``);
    ``values``: the batch's (``spark_values``: ``_batch``, ``_processing_time``, ``_watermark``).
    The per-key step's tasks hold ranges of keys in order and number their own panes (``spark_keys``): a pane's
    ``seq`` is its task's number plus the panes of the tasks before it, from their ``read`` rows (one per task,
    joined in as a broadcast), so no step sees every pane in one task and the panes stay in the step's tasks.
    ``offsets``: those sums (``task_offsets``) where the client has counted the rows already (a batch's writes,
    ``write_outputs``): one small local row per task, where summing them on executors takes jobs of their own
    before the write's."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    if offsets is not None:
        offsets = local_frame(out.sparkSession, offsets, StructType([StructField("_p", IntegerType()),
                                                                     StructField("_off", LongType())]))
    else:
        counts = out.where("tbl = 'read'").select(F.col("part").alias("_p"), F.col("seq").alias("_n"))
        before = counts.select(F.col("_p").alias("_q"), F.col("_n").alias("_m"))
        offsets = counts.join(before, F.col("_q") < F.col("_p"), "left").groupBy("_p").agg(
            F.coalesce(F.sum("_m"), F.lit(0)).cast("long").alias("_off"))
    rows = out.where("tbl = 'panes'").join(F.broadcast(offsets), F.col("part") == F.col("_p"))
    return with_values(rows, values).select(
        "key", ts_column("window_start"), ts_column("window_end"), F.col("pane_value").alias("value"),
        "pane_index", "timing",
        "is_last", "kind", batch_column(),
        F.timestamp_micros("_processing_time").alias("processing_time"),
        F.timestamp_micros("_watermark").alias("watermark"),
        (F.col("_off") + F.col("seq")).cast("long").alias("seq"))


def validate_batch(job: BatchContext, clock: BatchClock, values, parsed, out, panes, lo: int | None) -> None:
    """The quality suites on the batch's input, panes and live state, validated on Spark (Great Expectations'
    Spark engine on these DataFrames): only aggregates and a few unexpected examples reach the client.
    ``parsed``: ``read_and_dedup``'s kept rows, whose firsts the raw suite judges (``steps.validate.delivered``)."""
    from millpond.runtime.steps.validate import delivered, validate_spark

    raw = delivered(parsed, job.spec.upstream is None)
    state = with_values(out.where("tbl = 'state' AND NOT deleted"), values).select(
        "key", ts_column("window_start"), ts_column("window_end"), "state", ts_column("event_timer"),
        ts_column("ptime_timer"), batch_column())
    validate_spark(job, clock, raw, panes, state, lo)


Write = tuple[str, Any, Callable[[list[dict]], Any]]


def append_write(job: BatchContext, txn: Txn, table: str, df, schema: pa.Schema) -> Write:
    """(table, its lazy write, its commit given the files written)."""
    write = spark_io.write_files(df, job.settings, table, job.settings.table_uri(job.name, table),
                                 columns=schema.names)
    return table, write, lambda files: commit_files(job.tables, job.name, table, files, schema, txn)


def rewrite_seen(job: BatchContext, txn: Txn, seen, own, values, version: int, partitions: int) -> Write:
    """``seen_ids`` replaced by the earlier ids still within the dedup horizon plus this batch's (the local
    engine's fold, ``steps.dedup.seen_keep_from``): ids expire, so the table dedup reads stays bounded."""
    from pyspark.sql import functions as F

    kept = with_values(seen, values).where(F.unix_micros("event_time") >= F.col("_keep_from")).select(
        *SEEN_SCHEMA.names)
    removes = live_files(job.tables, job.name, "seen_ids", version)
    rows = kept.unionByName(own).coalesce(partitions).sortWithinPartitions("event_time")
    write = spark_io.write_files(rows, job.settings, "seen_ids", job.settings.table_uri(job.name, "seen_ids"),
                                 columns=SEEN_SCHEMA.names)
    return "seen_ids", write, lambda files: commit_files(job.tables, job.name, "seen_ids", files, SEEN_SCHEMA, txn,
                                                         removes=removes)


def _rewrite_windows(job: BatchContext, txn: Txn, values, out, files: StateFiles | None, partitions: int,
                     changes_n: int) -> Write:
    """``windows`` copy-on-write (the local engine's MERGE, on executors). With stored files the batch read
    (``files``), each of them a changed window may be in is replaced file by file in Arrow, without its rows
    passing through Spark (``lake.spark_ranged``); the others stay. Without, the upserts are written as ranges
    of keys (``spark_state.ranged``). ``changes_n``: the upserts and deletes."""
    from pyspark.sql import functions as F

    changes = with_values(out.where("tbl = 'state'"), values).select(
        "key", ts_column("window_start"), ts_column("window_end"), "state", ts_column("event_timer"),
        ts_column("ptime_timer"), batch_column(), "deleted")
    uri = job.settings.table_uri(job.name, "windows")
    if files is not None and files.files:
        write = spark_ranged.rewrite_files(
            changes, files.files, job.settings, "windows", uri, WINDOWS_SCHEMA, WINDOW_KEY, WINDOW_KEY, FILE_ROWS,
            job.settings.spark_shuffle_partitions)

        def commit(actions: list[dict]) -> bool:
            added, removes = spark_ranged.split_written(actions)
            return commit_files(job.tables, job.name, "windows", added, WINDOWS_SCHEMA, txn, removes=removes,
                                stats_columns=WINDOWS_STATS_COLUMNS)

        return "windows", write, commit
    new = changes.where("NOT deleted").withColumn("deleted", F.lit(False))
    write = spark_io.write_files(ranged(new, changes_n, partitions), job.settings, "windows", uri,
                                 columns=WINDOWS_SCHEMA.names)
    return "windows", write, lambda files: commit_files(
        job.tables, job.name, "windows", files, WINDOWS_SCHEMA, txn, stats_columns=WINDOWS_STATS_COLUMNS)


def _rewrite_current(job: BatchContext, txn: Txn, values, out, parts: set[tuple[str, str]],
                     partitions: int) -> Write:
    """The current view copy-on-write over the (day, hour) partitions of ``window_end`` the batch touches
    (``parts``: ISO day, hour), each rewritten as one file: the rows are spread by partition over at most
    ``partitions`` tasks, and no more than the partitions touched (read file by file, the old rows would otherwise
    keep one task, and so one new file, per old file, and a partition touched by every batch would gain a file per
    batch)."""
    from pyspark.sql import functions as F

    rows = out.where("tbl = 'current'")
    on = ["key", "window_start", "window_end"] + (["pane_index"] if job.spec.mode.value == "discarding" else [])
    pane_type = job.spec.pane_value_type
    current = with_values(rows, values).select(
        "key", ts_column("window_start"), ts_column("window_end"), F.col("pane_value").alias("value"),
        "pane_index", "timing",
        batch_column(), "deleted")
    current = current.withColumn("window_end_day", F.to_date("window_end")).withColumn(
        "window_end_hour", F.hour("window_end").cast("int"))
    dt = job.tables.open(job.name, "current")
    removes = [] if dt is None else [a for a in live_files(job.tables, job.name, "current", dt.version())
                                     if (a["partition_values"].get("window_end_day"),
                                         a["partition_values"].get("window_end_hour")) in parts]
    if dt is not None and tuple(dt.metadata().partition_columns) != CURRENT_PARTITIONS:
        raise NotImplementedError("the Spark engine rewrites only current views partitioned by window_end")
    keep = current.where("NOT deleted")
    if removes:  # only the touched partitions' files are read
        files = [(uri, pv) for uri, pv in spark_io.table_files(job.tables, job.name, "current", dt.version())
                 if (str(pv.get("window_end_day")), str(pv.get("window_end_hour"))) in parts]
        old = spark_io.read_table(job.spark, job.tables, job.name, "current", dt.version(), only=files,
                                  tasks=partitions)
        keep = old.join(current.select(*on), on, "left_anti").unionByName(keep)
    schema = current_file_schema(pane_type)
    tasks = min(partitions, len(parts))  # a task with no partition of its own would start a Python worker for none
    rows = keep.withColumn("deleted", F.lit(False)).repartition(tasks, *CURRENT_PARTITIONS)
    write = spark_io.write_files(rows, job.settings, "current", job.settings.table_uri(job.name, "current"),
                                 partition_by=list(CURRENT_PARTITIONS), columns=schema.names)
    return "current", write, lambda files: commit_files(job.tables, job.name, "current", files, schema, txn,
                                                        partition_by=CURRENT_PARTITIONS, removes=removes)


def step_partitions(job: BatchContext, width: ShuffleWidth, read: int, accepted: int,
                    files: StateFiles | None) -> int:
    """The per-key step's and the writes' tasks (and shuffles): by the batch's accepted elements and the stored
    windows it reads (``StateFiles.may_read``), not by the stored windows it leaves alone, and never fewer than its
    read's (``read``). The tables do not depend on it."""
    n = max(read, batch_partitions(job.settings, accepted + (files.may_read(accepted) if files else 0)))
    width.set(n)
    return n


def run_on_spark(job: BatchContext, work: BatchWork, inputs: int, timer
                 ) -> tuple[dict[str, int], BatchClock, int | None]:
    """The batch's read, dedup, watermark, per-key step and writes as Spark jobs; counts, clock, max event time.
    ``inputs``: about how many rows the batch reads (``engines.spark.input_rows``), which sizes its read; the
    per-key step and the writes are sized once it knows its elements and the stored files it reads
    (``step_partitions``). A Connect server that stops answering meanwhile fails the batch within
    ``spark.timeout``."""
    if job.validate:
        from millpond.quality.context import warm_context

        warm_context(job.settings)  # loaded while this thread waits on the batch's Spark jobs
    width = ShuffleWidth(job.spark)  # the session's, put back after (a shared session's peers)
    with watched(job.spark, job.settings.spark_connect_url, job.settings.spark_timeout_s):
        result = _run_on_spark(job, work.txn, work.plan, inputs, work.prev, work.w_in, work.processing_time,
                               work.watermark, timer, width)
    # only after a batch that ran: a failed one's error stands (a frozen server's session takes no more calls),
    # and the next batch sets its own width anyway
    width.restore()
    return result


def _run_on_spark(job: BatchContext, txn: Txn, the_plan: dict[str, Any], inputs: int,
                  prev: dict[str, Any] | None, w_in: int, processing_time: int, explicit_watermark, timer,
                  width: ShuffleWidth) -> tuple[dict[str, int], BatchClock, int | None]:
    from millpond.runtime.steps.watermark import clock_for

    version, seen_version = the_plan["versions"].get("windows"), the_plan["versions"].get("seen_ids")
    partitions = batch_partitions(job.settings, inputs)
    width.set(partitions)
    seen = None if seen_version is None else spark_io.read_table(  # a scan: as many tasks as files, up to the width
        job.spark, job.tables, job.name, "seen_ids", seen_version, tasks=job.settings.spark_shuffle_partitions)
    tally = None if job.spec.upstream is None else stage_tally(job, the_plan, partitions)
    bad, accepted, counts, max_et, parsed, biggest = read_and_dedup(job, the_plan, processing_time, w_in, seen,
                                                                    partitions, inputs, tally)
    timer.lap("ingest", partitions=partitions)
    policy = job.spec.watermark_policy
    clock, max_et = clock_for(job, job.batch, processing_time, w_in, prev, max_et, the_plan, explicit_watermark,
                              delays(accepted) if policy.kind == "percentile" and explicit_watermark is None else None)
    timer.lap("watermark")
    keep_from = seen_keep_from(job, w_in, seen_version)
    values = batch_values(job.spark, batch=clock.batch, processing_time=clock.processing_time,
                          watermark=clock.watermark, keep_from=keep_from)
    # only the files that can hold a window the batch may change (``spark_state``), and of those only the rows it
    # can change (the rewrite reads the files it replaces itself, ``lake.spark_ranged``)
    stored_files = None if version is None else state_files(job, version, clock)
    partitions = step_partitions(job, width, partitions, counts["accepted"], stored_files)
    state = stored_windows(job, stored_files, accepted, clock, tally)
    if state is not None:
        state = keep(job.spark, state)
    job.commits.plan_landed()
    out = panes = None  # numbered by the writes, from their counts (``write_outputs``)
    if one_key(job):  # the step's one task writes its tables too: one Spark job (``spark_one_key``)
        timer.lap("windowing")
        outputs = step_and_write(job, txn, the_plan, prev, w_in, explicit_watermark, clock, accepted, state,
                                 counts["accepted"], biggest)
    else:
        out = compute(job, clock, accepted, state, partitions, counts["accepted"], now=job.validate,
                      biggest=biggest)
        if job.validate:  # validated and written: numbered once, here (the validation phase holds validation only)
            panes = keep(job.spark, panes_frame(out, values))
            lo = first_retracted(panes)  # the job that computes the kept panes
        timer.lap("windowing")
        if job.validate:
            validate_batch(job, clock, values, parsed, out, panes, lo)
            timer.lap("validation")
        job.commits.defer()
        outputs = write_outputs(job, txn, values, bad, accepted, out, panes, the_plan["versions"], seen,
                                partitions, keep_from, counts["quarantined"], counts["accepted"], stored_files)
    last = outputs.pop("max_event_time")  # the per-key step's tasks' greatest event time
    if tally is not None and not tally.timed and last is not None:  # counted from statistics, without times
        max_et = max(last, max_et if max_et is not None else last)
    counts = {"files": len(the_plan["files"]), **counts, "late": 0, "panes": 0, "retractions": 0, **outputs}
    # a warm server keeps cached frames until told (``accepted`` is a projection of the kept ``parsed``; with a
    # tally nothing kept them), each a round trip: at once
    release((parsed if tally is None else None, state, out, panes if job.validate else None))
    return counts, clock, max_et
