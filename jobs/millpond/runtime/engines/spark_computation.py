"""A MillWheel computation's batch on the Spark engine: the per-key code on executors, each key with its stored
state and timers, every table written from the executors and committed by the batch.

Executors read, parse and deduplicate the landing files (``spark_batch.read_and_dedup``). The batch's elements,
the ``comp_state`` rows and the ``timers`` rows (both at the plan's versions) become one DataFrame of tagged rows
hashed by key, and each task runs :func:`run_partition` over its keys: the keys with new records or a due timer
through ``model.computation.run_key`` (the local engine's own per-key code, so both engines give the same
rows), the others' rows passed through. It returns, tagged, the whole ``comp_state`` and ``timers`` as they are
after the batch, the productions (pickled, in each key's order) and one tally per task.

The batch's process only reads small things: the tallies (counts, the earliest timer left due, each stream's
inferred column types: bounded by tasks, never by rows), and the files each write returns. ``comp_state`` and
``timers``, kept by MERGE on the local engine, are rewritten copy-on-write when the batch changed them (the
tasks' rows replace the plan's files in one commit); streams are appended; ``seen_ids`` and ``quarantine`` as
for a windowed batch; the ``watermarks`` row from the tallies. Each commit carries the batch's transaction and
has the local engine's step name, so a crash after any of them is retried as there.

A stream with a committed suite is validated with Great Expectations' Spark engine on its DataFrame.
The computation is pickled to the executors: its class must be importable there (as a custom strategy's is).
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.errors import MillpondError
from millpond.lake import spark_io
from millpond.lake.file_commits import commit_files, live_files
from millpond.lake.schemas import QUARANTINE_SCHEMA, SEEN_SCHEMA
from millpond.lake.snapshot_files import Storage
from millpond.lake.spark_frames import collected
from millpond.lake.tables import Txn
from millpond.model.clock import BatchClock
from millpond.model.computation import EVENT, PROCESSING, Computation, KeyOutcome, Record, Timer, run_key
from millpond.runtime.computation_tables import (
    STATE_SCHEMA,
    STATE_STATS,
    TIMERS_SCHEMA,
    TIMERS_STATS,
    column_types,
    commit_watermark,
    inferred_schema,
    production_table,
    stream_schema,
)

if TYPE_CHECKING:
    from millpond.runtime.commits import PhaseTimer
    from millpond.runtime.context import BatchContext
    from millpond.runtime.engines.base import BatchWork
    from millpond.runtime.engines.spark_width import ShuffleWidth

#: one row of a task's output, tagged by ``tbl``: ``state`` and ``timer`` (the tables after the batch, with the
#: batch that wrote each row), ``prod`` (a production: its stream, its place in its key's, the pickled row),
#: ``stream`` (per task and stream: its first key, its count, and for an inferred stream its first row's names
#: and its column types) and ``tally`` (per task: the marker's counts and the earliest event timer left due)
OUT = pa.schema([
    ("tbl", pa.string()), ("key", pa.string()), ("state", pa.string()), ("batch", pa.int64()), ("tag", pa.string()),
    ("domain", pa.string()), ("fire_at", pa.int64()), ("stream", pa.string()), ("seq", pa.int64()),
    ("record", pa.binary()), ("names", pa.string()), ("late", pa.int64()), ("keys", pa.int64()),
    ("fired", pa.int64()), ("produced", pa.int64()), ("read", pa.int64()), ("state_changes", pa.int64()),
    ("timer_changes", pa.int64()), ("held_by", pa.int64())])
TALLY = ("late", "keys", "fired", "produced", "read", "state_changes", "timer_changes")

log = logging.getLogger(__name__)


# -- on the executors -------------------------------------------------------------------------------------------
def _rows(tbl: str, n: int, **columns: Any) -> pa.Table:
    """``n`` rows of ``OUT`` tagged ``tbl``, from the given columns (lists or arrays); the others null."""
    arrays = [pa.array([tbl] * n, pa.string())]
    for f in list(OUT)[1:]:
        col = columns.get(f.name)
        arrays.append(pa.nulls(n, f.type) if col is None else pa.array(col, f.type) if isinstance(col, list)
                      else col.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=OUT)


def _touched(records: pa.Table, timers: pa.Table, clock: BatchClock) -> list[str]:
    """The keys the batch runs: those with new records, and those with a due timer (as ``_due_keys`` reads)."""
    domain, at = timers.column("domain"), timers.column("fire_at")
    due = pc.or_(pc.and_(pc.equal(domain, EVENT), pc.less_equal(at, clock.watermark)),
                 pc.and_(pc.equal(domain, PROCESSING), pc.less_equal(at, clock.processing_time)))
    return sorted(set(records.column("key").to_pylist()) | set(timers.filter(due).column("key").to_pylist()))


def _stored(states: pa.Table, timers: pa.Table) -> tuple[dict[str, tuple[str, int]], dict[str, dict[str, tuple]]]:
    """The touched keys' stored state (JSON, batch) and timers by tag ((Timer, batch)), in (key, tag) order."""
    state = {k: (s, b) for k, s, b in zip(*(states.column(c).to_pylist() for c in ("key", "state", "batch")),
                                          strict=True)}
    by_key: dict[str, dict[str, tuple]] = defaultdict(dict)
    timers = timers.sort_by([("key", "ascending"), ("tag", "ascending")])
    for k, tag, dom, at, b in zip(*(timers.column(c).to_pylist() for c in ("key", "tag", "domain", "fire_at", "batch")),
                                  strict=True):
        by_key[k][tag] = (Timer(k, tag, dom, at), b)
    return state, by_key


def _after(outcomes: list[KeyOutcome], state: dict[str, tuple[str, int]], timers: dict[str, dict[str, tuple]],
           batch: int) -> list[pa.Table]:
    """The touched keys' ``comp_state`` and ``timers`` rows after the batch: what the local engine's MERGE
    leaves (changed rows with this batch, unchanged ones as stored, deleted ones gone)."""
    st: list[tuple[str, str, int]] = []
    tm: list[tuple[str, str, str, int, int]] = []
    for o in outcomes:
        if not o.state_changed and o.key in state:
            st.append((o.key, *state[o.key]))
        elif o.state_changed and o.state is not None:
            st.append((o.key, o.state, batch))
        kept = {tag: v for tag, v in timers.get(o.key, {}).items() if tag not in o.timer_deletes}
        kept |= {t.tag: (t, batch) for t in o.timer_upserts}
        tm += [(t.key, t.tag, t.domain, t.at, b) for t, b in (kept[tag] for tag in sorted(kept))]
    return [_rows("state", len(st), key=[r[0] for r in st], state=[r[1] for r in st], batch=[r[2] for r in st]),
            _rows("timer", len(tm), **{c: [r[i] for r in tm] for i, c in enumerate(("key", "tag", "domain",
                                                                                    "fire_at", "batch"))})]


def _productions(outcomes: list[KeyOutcome], batch: int, infer: frozenset[str], pipeline: str) -> list[pa.Table]:
    """Each production as a ``prod`` row, and per stream a ``stream`` row (first key, count, inferred types)."""
    by_stream: dict[str, list[tuple[str, int, dict[str, Any]]]] = defaultdict(list)
    for o in outcomes:
        for seq, (stream, rec) in enumerate(o.productions):
            by_stream[stream].append((o.key, seq, {**rec, "batch": batch}))
    out = []
    for stream, prods in sorted(by_stream.items()):
        out.append(_rows("prod", len(prods), key=[p[0] for p in prods], stream=[stream] * len(prods),
                         seq=[p[1] for p in prods], record=[pickle.dumps(p[2], protocol=5) for p in prods]))
        rows = [p[2] for p in prods]
        names, types = ((json.dumps(list(rows[0])), column_types(pipeline, stream, rows).serialize().to_pybytes())
                        if stream in infer else (None, None))
        out.append(_rows("stream", 1, key=[prods[0][0]], stream=[stream], seq=[len(prods)], names=[names],
                         record=[types]))
    return out


def run_partition(comp: Computation, clock: BatchClock, infer: frozenset[str], pipeline: str,
                  table: pa.Table) -> pa.Table:
    """One task's keys (rows tagged ``src``: ``r`` a record, ``s`` a stored state, ``t`` a stored timer) through
    the computation; the tagged ``OUT`` rows. ``infer``: the streams whose schema is inferred."""
    src = table.column("src")
    records, states, timers = (table.filter(pc.equal(src, s)) for s in ("r", "s", "t"))
    keys = _touched(records, timers, clock)
    touched = pa.array(keys, pa.string())

    def split(t: pa.Table) -> tuple[pa.Table, pa.Table]:
        mine = pc.is_in(t.column("key"), value_set=touched)
        return t.filter(mine), t.filter(pc.invert(mine))

    (my_states, other_states), (my_timers, other_timers) = split(states), split(timers)
    state, stored = _stored(my_states, my_timers)
    by_key: dict[str, list[Record]] = defaultdict(list)
    for i, k, v, et, at in zip(*(records.column(c).to_pylist() for c in ("id", "key", "value", "event_time",
                                                                         "arrival_time")), strict=True):
        by_key[k].append(Record(i, k, v, et, at, et < clock.input_watermark))
    outcomes = [run_key(comp, k, by_key.get(k, []), state.get(k, (None, 0))[0],
                        {tag: v[0] for tag, v in stored.get(k, {}).items()}, clock) for k in keys]
    held = min((o.held_by for o in outcomes if o.held_by is not None), default=None)
    tally = _rows("tally", 1, late=[sum(o.late for o in outcomes)], keys=[len(keys)],
                  fired=[sum(o.fired for o in outcomes)], produced=[sum(len(o.productions) for o in outcomes)],
                  read=[my_states.num_rows + my_timers.num_rows],
                  state_changes=[sum(o.state_changed for o in outcomes)],
                  timer_changes=[sum(len(o.timer_upserts) + len(o.timer_deletes) for o in outcomes)], held_by=[held])
    passed = [_rows("state", other_states.num_rows, **{c: other_states.column(c) for c in ("key", "state", "batch")}),
              _rows("timer", other_timers.num_rows,
                    **{c: other_timers.column(c) for c in ("key", "tag", "domain", "fire_at", "batch")})]
    return pa.concat_tables([*passed, *_after(outcomes, state, stored, clock.batch),
                             *_productions(outcomes, clock.batch, infer, pipeline), tally])


def _keys_task(comp: Computation, clock: BatchClock, infer: frozenset[str], pipeline: str,
               batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: the task's keys (``run_partition``)."""
    got = [b for b in batches if b.num_rows]
    if got:
        yield from run_partition(comp, clock, infer, pipeline, pa.Table.from_batches(got)).to_batches()


def _stream_rows(pipeline: str, stream: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> pa.Table:
    rows = [pickle.loads(r) for b in batches for r in b.column("record").to_pylist()]
    return production_table(pipeline, stream, schema, rows)


def _stream_frame_task(pipeline: str, stream: str, schema: pa.Schema,
                       batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: a task's productions to ``stream`` as rows of its ``schema`` (for validation)."""
    yield from _stream_rows(pipeline, stream, schema, batches).to_batches()


def _stream_files_task(storage: Storage, pipeline: str, stream: str, table_uri: str, schema: pa.Schema,
                       batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in an executor: a task's productions to ``stream`` as one data file of its table (Arrow to Parquet
    with the stream's own types, as the local engine appends them); one ``WRITTEN`` row."""
    table = _stream_rows(pipeline, stream, schema, batches)
    if table.num_rows:
        actions = spark_io.write_table(storage, table_uri, table)
        yield pa.RecordBatch.from_arrays([pa.array([stream] * len(actions), pa.string()),
                                          pa.array(actions, pa.string())], schema=spark_io.WRITTEN)


# -- in the batch's process -------------------------------------------------------------------------------------
def run_computation(job: BatchContext, work: BatchWork, rows: int, timer: PhaseTimer
                    ) -> tuple[dict[str, Any], BatchClock, int | None]:
    """The batch's read, dedup, watermark, per-key code and writes as Spark jobs; counts, clock, max event time.
    ``rows``: about how many rows its input has (``engines.spark.batch_rows``; its stored state and timers are
    added here), which sizes its shuffles. A Connect server that stops answering meanwhile fails the batch within
    ``spark.timeout``."""
    from millpond.runtime.engines.spark_watchdog import watched
    from millpond.runtime.engines.spark_width import ShuffleWidth

    if job.validate:
        from millpond.quality.context import warm_context

        warm_context(job.settings)  # loaded while this thread waits on the batch's Spark jobs
    width = ShuffleWidth(job.spark)  # the session's, put back after (a shared session's peers)
    with watched(job.spark, job.settings.spark_connect_url, job.settings.spark_timeout_s):
        result = _run(job, work, rows, timer, width)
    width.restore()
    return result


def _run(job: BatchContext, work: BatchWork, rows: int, timer: PhaseTimer, width: ShuffleWidth
         ) -> tuple[dict[str, Any], BatchClock, int | None]:
    from millpond.runtime.engines.spark_batch import batch_partitions, delays
    from millpond.runtime.engines.spark_keep import keep, release
    from millpond.runtime.steps.watermark import clock_for

    spark, versions = job.spark, work.plan["versions"]
    rows += sum(spark_io.table_rows(job.tables, job.name, t, versions.get(t)) for t in ("comp_state", "timers"))
    partitions = batch_partitions(job.settings, rows)
    width.set(partitions)
    seen = _table(job, "seen_ids", versions, partitions)
    bad, accepted, counts, max_et, parsed = _read(job, work, seen, partitions)
    timer.lap("ingest", partitions=partitions)
    percentile = job.spec.watermark_policy.kind == "percentile" and work.watermark is None
    clock, max_et = clock_for(job, work.batch, work.processing_time, work.w_in, work.prev, max_et, work.plan,
                              work.watermark, delays(accepted) if percentile else None)
    timer.lap("watermark")
    job.commits.plan_landed()
    comp = _computation(job)
    out = keep(spark, per_key(job, comp, clock, keyed_input(job, accepted, versions, partitions)))
    tally, held, streams = _tally(out)
    schemas = stream_schemas(job.name, comp, streams)
    timer.lap("computation", keys=tally["keys"], timers_fired=tally["fired"], productions=tally["produced"])
    if job.validate:
        validate_streams(job, clock, out, schemas)
        timer.lap("validation")
    job.commits.defer()
    _write(job, work, clock, out, bad, accepted, seen, counts, tally, schemas, partitions)
    commit_watermark(job, work.txn, clock, held, versions.get("watermarks"))
    release((parsed, out))  # ``accepted``: a projection of the kept ``parsed``
    return ({"files": len(work.plan["files"]), **counts, "late": tally["late"], "panes": 0, "retractions": 0,
             "state_rows_read": tally["read"], "keys": tally["keys"], "timers_fired": tally["fired"],
             "productions": tally["produced"]}, clock, max_et)


def _read(job: BatchContext, work: BatchWork, seen, partitions: int):
    """``spark_batch.read_and_dedup``'s (quarantined rows, accepted elements, counts, max event time, parsed rows).
    A quiet batch (no planned or held landing file), where only timers can fire, reads nothing: no Spark job."""
    from millpond.runtime.engines.spark_batch import read_and_dedup

    if work.plan["files"] or work.plan["held"] or job.spec.upstream is not None:
        return read_and_dedup(job, work.plan, work.processing_time, work.w_in, seen, partitions)[:5]
    none = job.spark.createDataFrame([], spark_io.spark_schema(spark_io.landing_schema(job.spec.value_type)))
    return (none, none.select("id", "key", "value", "event_time", "arrival_time"),
            {"input": 0, "accepted": 0, "duplicates": 0, "quarantined": 0}, None, none)


def _computation(job: BatchContext) -> Computation:
    from millpond.model.computation import load_computation

    try:
        return load_computation(job.spec.raw["computation"])
    except ValueError as exc:
        raise MillpondError(f"{job.name}: {exc}") from exc


def _table(job: BatchContext, name: str, versions: dict[str, Any], partitions: int):
    """``name`` at the plan's version as a DataFrame read on executors (None: no such table yet)."""
    version = versions.get(name)
    return None if version is None else spark_io.read_table(job.spark, job.tables, job.name, name, version,
                                                            tasks=partitions)


#: the per-key step's input columns besides ``src`` and ``key`` (``value``'s type is the pipeline's)
INPUT = (("id", "string"), ("value", None), ("event_time", "bigint"), ("arrival_time", "bigint"),
         ("state", "string"), ("batch", "bigint"), ("tag", "string"), ("domain", "string"), ("fire_at", "bigint"))


def keyed_input(job: BatchContext, accepted, versions: dict[str, Any], partitions: int):
    """The batch's elements, and the ``comp_state`` and ``timers`` rows at the plan's versions, as one DataFrame of
    tagged rows hashed by key into ``partitions`` tasks."""
    from pyspark.sql import functions as F

    vtype = "bigint" if job.spec.value_type == "int" else "double"

    def shaped(df, src: str, **given):
        return df.select(F.lit(src).alias("src"), "key", *[
            (given[c] if c in given else F.lit(None)).cast(t or vtype).alias(c) for c, t in INPUT])

    frames = [shaped(accepted, "r", **{c: F.col(c) for c in ("id", "value", "event_time", "arrival_time")})]
    state, timers = (_table(job, t, versions, partitions) for t in ("comp_state", "timers"))
    if state is not None:
        frames.append(shaped(state, "s", state=F.col("state"), batch=F.col("batch")))
    if timers is not None:
        frames.append(shaped(timers, "t", batch=F.col("batch"), tag=F.col("tag"), domain=F.col("domain"),
                             fire_at=F.unix_micros("fire_at")))
    return functools.reduce(lambda a, b: a.unionByName(b), frames).repartition(partitions, "key")


def per_key(job: BatchContext, comp: Computation, clock: BatchClock, keyed):
    """The tagged ``OUT`` rows of every task of ``keyed`` (``run_partition``, on executors)."""
    infer = frozenset(s for s, schema in comp.output_streams.items() if schema is None)
    return spark_io.map_arrow(keyed, functools.partial(_keys_task, comp, clock, infer, job.name),
                              spark_io.spark_schema(OUT), ["src", "key", *(c for c, _t in INPUT)])


def _tally(out) -> tuple[dict[str, int], int | None, dict[str, list[tuple]]]:
    """The tasks' tallies summed, the earliest event timer left due, and per stream the tasks' parts (first key,
    count, names, types): one Spark job, which computes (and keeps) ``out``. A computation's own error (a
    ``MillpondError`` raised by ``run_key`` on an executor) is one line here too."""
    from pyspark.sql import functions as F

    try:
        got = collected(out.where(F.col("tbl").isin("tally", "stream")))
    except Exception as exc:  # noqa: BLE001 - Spark wraps the executor's error in its own
        raise _user_error(exc) from exc
    tallies = [r for r in got if r["tbl"] == "tally"]
    tally = {c: sum(r[c] for r in tallies) for c in TALLY}
    held = min((r["held_by"] for r in tallies if r["held_by"] is not None), default=None)
    streams: dict[str, list[tuple]] = defaultdict(list)
    for r in got:
        if r["tbl"] == "stream":
            streams[r["stream"]].append((r["key"], r["seq"], r["names"], r["record"]))
    return tally, held, dict(streams)


def _user_error(exc: Exception) -> Exception:
    """A ``MillpondError`` an executor raised, as its own one line; any other error as it is."""
    text = str(exc)
    marker = "MillpondError: "
    if marker not in text:
        return exc
    return MillpondError(text[text.rindex(marker) + len(marker):].splitlines()[0].strip())


def stream_schemas(pipeline: str, comp: Computation, streams: dict[str, list[tuple]]) -> dict[str, pa.Schema]:
    """The schema of every stream the batch produced to: declared (with ``batch``), or inferred from the tasks'
    parts as the local engine infers it from all rows (``computation_tables.inferred_schema``)."""
    out = {}
    for stream, parts in sorted(streams.items()):
        declared = stream_schema(comp.output_streams.get(stream))
        out[stream] = declared if declared is not None else inferred_schema(pipeline, stream, [
            (key, json.loads(names), pa.ipc.read_schema(pa.py_buffer(bytes(types))))
            for key, _count, names, types in parts])
    return out


def _produced(out, stream: str):
    from pyspark.sql import functions as F

    return out.where((F.col("tbl") == "prod") & (F.col("stream") == stream)).select("record")


def validate_streams(job: BatchContext, clock: BatchClock, out, schemas: dict[str, pa.Schema]) -> None:
    """The streams that have a committed suite, validated by Great Expectations' Spark engine on their DataFrames
    (and the batch's freshness, one row, with pandas), as ``steps.validate.validate_streams`` does with pandas on
    the local engine; a critical failure stops the batch before anything is written."""
    from millpond.quality import suites as qs
    from millpond.runtime.steps.validate import validate_streams as validate

    frames = {s: spark_io.map_arrow(_produced(out, s), functools.partial(_stream_frame_task, job.name, s, schema),
                                    spark_io.spark_schema(schema), ["record"])
        for s, schema in schemas.items() if qs.STREAM_PREFIX + s in qs.SUITES}
    validate(job, clock.batch, frames, clock, on_spark=True)


#: (commit step, table, its lazy write, its commit given the files written)
Step = tuple[str, str, Any, Any]


def _write(job: BatchContext, work: BatchWork, clock: BatchClock, out, bad, accepted, seen, counts: dict[str, int],
           tally: dict[str, int], schemas: dict[str, pa.Schema], partitions: int) -> None:
    """Every table's files from the executors in one Spark job; each table's commit queued (``job.commits``)
    under the batch's transaction, with the local engine's step names."""
    from millpond.runtime.engines.spark_batch import append_write, batch_column, rewrite_seen, ts_column
    from millpond.runtime.engines.spark_values import batch_values, with_values
    from millpond.runtime.steps.dedup import by_id, seen_keep_from

    txn, versions = work.txn, work.plan["versions"]
    keep_from = seen_keep_from(job, work.w_in, versions.get("seen_ids"))
    values = batch_values(job.spark, batch=clock.batch, keep_from=keep_from)
    steps: list[Step] = []
    if counts["quarantined"]:  # at most ``partitions`` files: ``bad`` has a partition per landing file
        rows = with_values(bad, values).select("source_file", "line", "raw", "reason", batch_column())
        quarantine = append_write(job, txn, "quarantine", rows.coalesce(partitions), QUARANTINE_SCHEMA)
        steps.append(("quarantine", *quarantine))
    if counts["accepted"] and by_id(job):  # a batch that accepts nothing leaves seen_ids alone, as locally
        own = with_values(accepted, values).select("id", ts_column("event_time"), batch_column())
        seen_write = (append_write(job, txn, "seen_ids", own, SEEN_SCHEMA) if keep_from is None
                      else rewrite_seen(job, txn, seen, own, values, versions["seen_ids"], partitions))
        steps.append(("seen_ids", *seen_write))
    if tally["state_changes"]:
        steps.append(_rewrite(job, txn, out, "comp_state", versions.get("comp_state")))
    if tally["timer_changes"]:
        steps.append(_rewrite(job, txn, out, "timers", versions.get("timers")))
    storage = Storage.of(job.settings)
    for stream, schema in schemas.items():
        uri = job.settings.table_uri(job.name, stream)
        write = spark_io.map_arrow(_produced(out, stream),
                                   functools.partial(_stream_files_task, storage, job.name, stream, uri, schema),
                                   spark_io.spark_schema(spark_io.WRITTEN), ["record"])
        steps.append((f"produce_{stream}", stream, write, functools.partial(
            commit_files, job.tables, job.name, stream, schema=schema, txn=txn)))
    try:
        written = spark_io.collect_writes([w for _s, _t, w, _c in steps])
    except Exception as exc:  # noqa: BLE001 - a production that does not fit its stream's schema, say
        raise _user_error(exc) from exc
    for step, table, _w, commit in steps:
        job.commits.step(step, functools.partial(commit, written.get(table, [])), table)


def _rewrite(job: BatchContext, txn: Txn, out, table: str, version: int | None) -> Step:
    """``comp_state`` or ``timers`` copy-on-write: the tasks' rows of it after the batch (``run_partition``)
    replace the files of the plan's version in one commit (the local engine's MERGE, on executors)."""
    from pyspark.sql import functions as F

    if table == "comp_state":
        schema, stats, order = STATE_SCHEMA, STATE_STATS, ["key"]
        rows = out.where(F.col("tbl") == "state").select("key", "state", "batch", F.lit(False).alias("deleted"))
    else:
        schema, stats, order = TIMERS_SCHEMA, TIMERS_STATS, ["key", "tag"]
        rows = out.where(F.col("tbl") == "timer").select(
            "key", "tag", "domain", F.timestamp_micros("fire_at").alias("fire_at"), "batch",
            F.lit(False).alias("deleted"))
    removes = live_files(job.tables, job.name, table, version)
    write = spark_io.write_files(rows.sortWithinPartitions(*order), job.settings, table,
                                 job.settings.table_uri(job.name, table), columns=schema.names)
    return table, table, write, lambda files: commit_files(job.tables, job.name, table, files, schema, txn,
                                                           removes=removes, stats_columns=stats)


__all__ = ["OUT", "keyed_input", "per_key", "run_computation", "run_partition", "stream_schemas",
           "validate_streams"]
