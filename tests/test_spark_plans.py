"""No step of a Spark batch funnels the batch's rows through one task: a validated multi-stage batch (several
partitions wide) runs against a Connect server, and its Spark UI (the REST API) is read for every stage's
tasks and records and every SQL execution's physical plan. A stage of one task that handles more than a
handful of rows, or a window function without ``partitionBy`` (Spark's "No Partition Defined for Window
operation!", an ``Exchange SinglePartition`` under a ``Window``), fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from engines import asked_columns, server_asks
from millpond.lake.objectstore import ObjectStore
from session_specs import SESSIONS

from bench.workload import WorkloadSpec, generate, land

#: the rows a one-task stage may handle (final aggregates, the batch's values, the written files' rows)
FEW = 1_000
#: a one-task stage that reads kept rows and only returns this much to the driver samples them: a range
#: exchange's partitioner samples a partition that holds most of its input again, alone (Spark's
#: ``RangePartitioner``, its imbalanced partitions); it hands no rows on
SAMPLE_RESULT_BYTES = 64 * 1024
WORKLOAD = WorkloadSpec(events=24_000, keys=1_200, batches=2, seed=11)
CLIENT = """
import faulthandler, json, sys
faulthandler.dump_traceback_later(600, exit=True)  # a hang says where, in the assertion's stderr
from millpond.config import load_settings
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_datetime
from millpond.runtime.engines import spark_batch
from millpond.runtime.engines.spark_client import connect
from millpond.runtime.job import run_batch
doc, url, times = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
spark_batch.ROWS_PER_TASK = 3_000  # a 12k-row batch as several tasks, as a 1M-row batch is
settings = load_settings().with_overrides(engine="spark", spark_connect=url, engine_one_task_below=0,
                                          engine_local_below=0, spark_shuffle_partitions=4)
spark = connect(settings)
out = [run_batch(settings, pipeline_from_dict(doc), to_datetime(at), validate=True, spark=spark) for at in times]
print(json.dumps([{"engine": r.engine, "panes": r.counts["panes"],
                   "retractions": r.counts["retractions"]} for r in out]))
"""


def _get(ui: str, path: str):
    with urllib.request.urlopen(f"{ui}/api/v1/applications{path}", timeout=30) as resp:
        return json.loads(resp.read())


def funnels(stages: list[dict], plan_of: dict[int, str] | None = None) -> list[str]:
    """Stages of one task that handle more than ``FEW`` rows (read, written, shuffled in or out), each with the
    physical plan of its SQL execution (``plan_of``: by stage id)."""
    out = []
    for s in stages:
        rows = max(s.get(k, 0) for k in ("inputRecords", "outputRecords", "shuffleReadRecords",
                                          "shuffleWriteRecords"))
        sample = (not any(s.get(k, 0) for k in ("outputRecords", "shuffleReadRecords", "shuffleWriteRecords"))
                  and s.get("resultSize", 0) < SAMPLE_RESULT_BYTES)
        if s["numTasks"] == 1 and rows > FEW and not sample:
            plan = (plan_of or {}).get(s["stageId"], "")
            out.append(f"stage {s['stageId']}: 1 task, {rows} rows; plan: {plan[plan.find('== Physical'):][:1500]}")
    return out


def unpartitioned_windows(plan: str) -> list[str]:
    """``Window`` nodes whose input is gathered into one partition (a window function without ``partitionBy``)."""
    lines = plan.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not line.lstrip("+-: ").startswith("Window "):
            continue
        for below in lines[i + 1:]:
            node = below.lstrip("+-: ").lstrip("*()0123456789 ")
            if node.startswith("Sort "):
                continue
            if node.startswith("Exchange SinglePartition"):
                found.append(line.strip()[:160])
            break
    return found


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_validated_batch_never_funnels_its_rows_through_one_task(settings, tables, spark_connect,
                                                                     pipeline_name) -> None:
    """Two validated batches on the session's Connect server (``local[2]``), its jobs, stages and SQL plans read
    from its UI: those after the last job before them, and the log's lines written since."""
    events = generate(WORKLOAD)
    land(ObjectStore(settings), settings.bucket_landing, f"{pipeline_name}/", WORKLOAD, events)
    doc = {"name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"}, **SESSIONS, "allowed_lateness": "1h"}
    times = [WORKLOAD.start_us + (b + 1) * WORKLOAD.interval_us for b in range(WORKLOAD.batches)]
    before, logged = spark_connect.last_job(), spark_connect.log.stat().st_size
    proc = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(doc), spark_connect.url, json.dumps(times)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-12000:]
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["panes"] and r["engine"] == "spark/plan" for r in ran) and ran[-1]["retractions"], ran
    ui, app = spark_connect.ui_url, f"/{spark_connect._app()}"
    jobs = [j for j in _get(ui, f"{app}/jobs") if j["jobId"] > before]
    ours = {st for j in jobs for st in j["stageIds"]}
    stages = [st for st in _get(ui, f"{app}/stages") if st["stageId"] in ours]
    executions = [e for e in _get(ui, f"{app}/sql?details=true&planDescription=true&length=10000")
                  if any(j > before for j in e.get("successJobIds", []) + e.get("failedJobIds", [])
                         + e.get("runningJobIds", []))]
    plans = [e.get("planDescription", "") for e in executions]
    by_job = {j: e.get("planDescription", "") for e in executions
              for j in e.get("successJobIds", []) + e.get("failedJobIds", []) + e.get("runningJobIds", [])}
    plan_of = {st: by_job.get(j["jobId"], "") for j in jobs for st in j["stageIds"]}
    assert jobs and stages and max(s["numTasks"] for s in stages) > 1, "the batch was not several partitions wide"
    assert any("Window" in p for p in plans)  # dedup and the quality checks are window functions
    assert not [w for p in plans for w in unpartitioned_windows(p)], [w for p in plans
                                                                       for w in unpartitioned_windows(p)]
    assert not funnels(stages), funnels(stages, plan_of)
    # a window behind a checkpoint is planned outside any SQL execution: Spark's own warning names it
    with open(spark_connect.log, errors="replace") as log:
        log.seek(logged)
        assert "No Partition Defined for Window operation" not in log.read()


def test_a_file_is_read_for_its_timers_only_when_one_may_be_due() -> None:
    """``spark_state.due`` by a file's statistics: its earliest timer of either kind at or before the batch's
    clock, a timer column without statistics (it may be due), never a column that is null throughout."""
    from datetime import UTC, datetime

    from millpond.model.clock import BatchClock
    from millpond.runtime.engines.spark_state import _key_range, due

    clock = BatchClock(batch=3, processing_time=2_000_000, input_watermark=0, watermark=1_000_000)
    at = lambda us: datetime.fromtimestamp(us / 1e6, UTC)  # noqa: E731
    later = {"num_records": 5, "min.event_timer": at(1_001_000), "null_count.event_timer": 0,
             "null_count.ptime_timer": 5, "min.key": "a", "max.key": "c"}
    assert not due(later, clock)
    assert due({**later, "min.event_timer": at(1_000_000)}, clock)
    assert due({**later, "null_count.ptime_timer": 4}, clock)  # a processing-time timer, no statistic for it
    assert due({**later, "null_count.ptime_timer": 4, "min.ptime_timer": at(2_000_000)}, clock)
    assert not due({**later, "null_count.ptime_timer": 4, "min.ptime_timer": at(2_001_000)}, clock)
    assert _key_range(later) == ("a", "c") and _key_range({**later, "min.key": None}) is None
    assert _key_range({**later, "max.key": "k" * 32}) == ("a", None)  # perhaps cut short: no upper bound


def test_a_batch_is_sized_by_the_stored_windows_it_reads_not_by_the_table() -> None:
    """``StateFiles.may_read``, which sizes the per-key step and the writes (``spark_batch.step_partitions``):
    every row of a file read whatever the batch's keys (a due timer, no statistics), and of the other files at
    most ``READ_PER_ELEMENT`` rows an element, so a small batch over a big table of stored windows stays narrow
    (before, every stored window counted, and a 10k-event batch over 1M windows ran four times as many tasks)."""
    from millpond.lake.spark_ranged import RangedFile
    from millpond.runtime.engines.spark_state import READ_PER_ELEMENT, StateFiles

    def file(rows: int) -> RangedFile:
        return RangedFile("s3://b/t/x.parquet", {}, {}, "a", "b", rows)

    table = StateFiles([file(50_000) for _ in range(20)], frozenset())
    assert table.may_read(10_000) == READ_PER_ELEMENT * 10_000
    assert table.may_read(10_000_000) == 1_000_000  # never more than the table
    assert table.may_read(0) == 0
    due = StateFiles([file(50_000) for _ in range(20)], frozenset({3, 7}))
    assert due.may_read(10_000) == 100_000 + READ_PER_ELEMENT * 10_000
    assert due.may_read(10_000_000) == 1_000_000


def test_a_few_changed_windows_are_written_by_one_task(spark) -> None:
    """The rewrite of ``windows`` spreads its rows over range partitions (``spark_state.ranged``): at least the
    batch's width, a task and a file each. A few changed windows (``FEW_ROWS`` or fewer) are one partition, with no
    sampling job for range bounds: before, two changed windows of a batch four tasks wide ran four tasks, two of
    them without a row, after a sampling job."""
    from millpond.runtime.engines.spark_state import FEW_ROWS, FILE_ROWS, ranged

    def ranges(rows: int, partitions: int) -> int:
        df = spark.range(rows).selectExpr("CAST(id AS STRING) AS key", "id AS window_start", "id AS window_end")
        plan = ranged(df, rows, partitions)._explain_string(mode="formatted")
        if "rangepartitioning(key" not in plan:
            assert "SinglePartition" in plan or "RoundRobinPartitioning(1)" in plan, plan
            return 1
        return int(plan.split("rangepartitioning(key", 1)[1].split(")", 1)[0].rsplit(",", 1)[1])

    assert ranges(2, 4) == 1
    assert ranges(FEW_ROWS, 4) == 1
    assert ranges(FEW_ROWS + 1, 4) == 4
    assert ranges(3 * FILE_ROWS, 1) == 3  # a range a file, whatever the width


def two_batches_each_way(settings, pipeline_name: str):
    """(strategy, batch, settings, spec, at) for two 40-event batches of a sessions pipeline on the multi-stage
    plan and two as one task, each batch's file landed before it is yielded (the second reads stored windows and
    ids)."""
    from millpond.lake.landing import arrival_tag
    from millpond.model.spec import pipeline_from_dict
    from millpond.model.timeutil import US, iso, to_us

    store = ObjectStore(settings)
    t0 = to_us("2026-03-01T12:00:00Z")
    for strategy in ("plan", "one_task"):
        name = f"{pipeline_name}_{strategy}"
        spec = pipeline_from_dict({**SESSIONS, "name": name, "source": {"prefix": f"{name}/"}})
        chosen = settings.with_overrides(engine="spark", engine_local_below=0,
                                         engine_one_task_below=10**9 if strategy == "one_task" else 0)
        for batch in (1, 2):
            at = t0 + batch * 300 * US
            body = "".join(json.dumps({"id": f"{batch}-{i}", "key": f"k{i % 5}", "value": i,
                                       "event_time": iso(at - (i + 1) * 7 * US)}) + "\n" for i in range(40))
            store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(at - 30 * US)}-{batch}.jsonl",
                            body.encode())
            yield strategy, batch, chosen, spec, at


def test_no_read_step_or_write_asks_the_server_for_its_input_s_columns(settings, tables, spark, pipeline_name,
                                                                       monkeypatch) -> None:
    """A Connect client's ``mapInArrow`` first asks the server for its input's columns unless it knows them: a
    round trip in which the server analyses the input's whole plan (15-60 ms, and a batch has one per read, per-key
    step and table written). The engine names them (``lake.spark_io.map_arrow``): two batches of a pipeline, the
    second reading stored windows and ids, on the multi-stage plan and as one task, ask for none."""
    from millpond.model.timeutil import to_datetime
    from millpond.runtime.job import run_batch

    asked = asked_columns(monkeypatch)
    names = set()
    for _strategy, _batch, chosen, spec, at in two_batches_each_way(settings, pipeline_name):
        result = run_batch(chosen, spec, to_datetime(at), spark=spark)
        assert result.counts["accepted"] == 40 and result.engine.startswith("spark/"), result
        names.add(spec.name)
    assert len(names) == 2 and all(tables.read_arrow(name, "panes").num_rows > 0 for name in names)
    assert asked == [], asked


def test_a_batch_asks_the_server_only_what_it_does_not_know(settings, spark_connect, spark, pipeline_name,
                                                            monkeypatch) -> None:
    """Every setting a Connect client reads or writes, and every analysis it asks for, is a round trip (10-40 ms on
    a warm server, several times that under load) before the batch's next job can start. A DAG task's batch, in a
    fresh session: the first and a later batch (which reads stored windows and ids) of a pipeline, on the
    multi-stage plan and as one task. The width is read once and set only where it changes; no frame of the
    batch's own values or ranges, no collected row and no kept frame asks for a setting (Spark's master, read as
    the session connects, the time zone, how binary comes back), and no schema is parsed on the server. Left:
    the width's, pyspark's own once-a-client lookups, and one release per kept frame (those at the end at once).
    Before, the plan's first and later batch asked 15 and 17 times besides their jobs (12 settings each), one task
    twice; since, 7 and 8 (5 and 4 settings).

    Each batch's session is not the process's first (``spark``, this process's active session): pyspark bound a
    kept frame to that one, and the batch failed on its next job (``spark_keep.keep``)."""
    from millpond.model.timeutil import to_datetime
    from millpond.runtime.engines import spark_client
    from millpond.runtime.job import run_batch

    asks: dict[tuple[str, int], list[str]] = {}
    url = settings.with_overrides(spark_connect=spark_connect.url)
    for strategy, batch, chosen, spec, at in two_batches_each_way(url, pipeline_name):
        monkeypatch.setattr(spark_client, "_SESSIONS", {})  # a task's process: a session of its own
        session = spark_client.connect(chosen)
        try:
            asked = server_asks(monkeypatch)
            result = run_batch(chosen, spec, to_datetime(at), spark=session)
            monkeypatch.undo()
        finally:
            session.stop()
        assert result.counts["accepted"] == 40 and result.engine.startswith("spark/"), result
        asks[(strategy, batch)] = asked
    for (strategy, batch), asked in asks.items():
        settings_asked = [a for a in asked if a.startswith("config:")]
        # the plan: the width read, set for the batch and put back, and at most two of pyspark's once-a-client
        # lookups (how big a plan it compresses, whether it records call sites); one task: the latter only
        assert len(settings_asked) <= (5 if strategy == "plan" else 2), (strategy, batch, asked)
        assert "analyze:ddl_parse" not in asked and "analyze:schema" not in asked, (strategy, batch, asked)
    assert sum(a.startswith("config:") for a in asks[("one_task", 2)]) <= 1, asks


def test_a_kept_frame_stays_on_its_session_whichever_session_is_active(spark, monkeypatch) -> None:
    """pyspark's Connect client gives a checkpointed frame the thread's active session, not the frame's own: the
    process's first session, or none once the watchdog closed a frozen server's session (pyspark then clears it).
    A batch on a later session (``spark_client.connect`` makes one after a freeze) failed on its next job, or on
    "No active or default Spark session found". ``spark_keep.keep`` makes the checkpoint with the batch's session
    active: with none active and none default, and with another one active, the kept frame is the batch's."""
    from millpond.runtime.engines.spark_keep import keep
    from pyspark.sql.connect.session import SparkSession

    frame = spark.range(0, 10, 1, 2).selectExpr("id", "id * 2 AS twice")
    other = object.__new__(SparkSession)  # stands for a session this process made first (never used here)
    for active, default in ((None, None), (other, other)):
        monkeypatch.setattr(SparkSession._active_session, "session", active, raising=False)
        monkeypatch.setattr(SparkSession, "_default_session", default)
        kept = keep(spark, frame, now=True)
        assert kept.sparkSession is spark
        assert getattr(SparkSession._active_session, "session", None) is active  # put back as it was
        monkeypatch.undo()
        assert kept.agg({"twice": "sum"}).collect()[0][0] == 90
        kept.unpersist()


def test_local_frames_and_collected_rows_are_spark_s_own(spark) -> None:
    """``lake.spark_frames``: a frame of local rows built without the settings' round trip holds what
    ``createDataFrame`` makes of the same rows, nulls included (and a frame of other types, or too big, is
    ``createDataFrame``'s); collected rows are ``collect``'s, as dicts."""
    import datetime as dt

    from millpond.lake import spark_frames
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType, TimestampType

    schema = StructType([StructField("k", StringType()), StructField("n", LongType()),
                         StructField("p", IntegerType(), False)])
    rows = [("a", 1, 0), (None, None, 1), ("\u00e9", 2**40, -3)]
    frame = spark_frames.local_frame(spark, rows, schema)
    assert frame.schema == spark.createDataFrame(rows, schema).schema == schema
    assert spark_frames.collected(frame.orderBy("p")) == [r.asDict() for r in
                                                          spark.createDataFrame(rows, schema).orderBy("p").collect()]
    assert spark_frames.collected(spark_frames.local_frame(spark, [], schema)) == []
    timed = StructType([StructField("t", TimestampType())])
    at = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    assert spark_frames.local_frame(spark, [(at,)], timed).collect() == spark.createDataFrame([(at,)], timed).collect()
    many = [(str(i) * 40, i, i) for i in range(10_000)]  # above LOCAL_BYTES: the public call
    assert spark_frames.local_frame(spark, many, schema).count() == len(many)
    counts = spark_frames.collected(frame.groupBy().agg({"n": "sum", "p": "max"}))
    assert counts == [{"sum(n)": 1 + 2**40, "max(p)": 1}]


def test_a_batch_s_landing_files_are_parsed_in_tasks_by_its_rows(settings, tables, spark, pipeline_name,
                                                                  monkeypatch) -> None:
    """Parsing is the landing read's cost (about 10 us a row): a batch reads its files in a task per
    ``spark_batch.READ_ROWS_PER_TASK`` rows (at most a file each, at most the deployment's width), whatever its
    shuffles' width. Before, a 100k-row batch of four files, one partition wide, parsed them all in one task while
    the other core idled (1.1 s of a 10 s batch)."""
    from millpond.lake import spark_io
    from millpond.lake.landing import arrival_tag
    from millpond.model.spec import pipeline_from_dict
    from millpond.model.timeutil import US, iso, to_datetime, to_us
    from millpond.runtime.engines import spark_batch
    from millpond.runtime.job import run_batch

    monkeypatch.setattr(spark_batch, "READ_ROWS_PER_TASK", 100)  # the batch's ~400 rows: four tasks' worth
    asked: list[int | None] = []
    real = spark_io.read_landing

    def read_landing(*args, **kwargs):
        asked.append(kwargs.get("tasks"))
        return real(*args, **kwargs)

    monkeypatch.setattr(spark_io, "read_landing", read_landing)
    store = ObjectStore(settings)
    at = to_us("2026-03-01T12:05:00Z")
    spec = pipeline_from_dict({**SESSIONS, "name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"}})
    for f in range(4):
        body = "".join(json.dumps({"id": f"{f}-{i}", "key": f"k{i % 7}", "value": i,
                                   "event_time": iso(at - (i + 1) * 3 * US)}) + "\n" for i in range(100))
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(at - 30 * US)}-{f}.jsonl",
                        body.encode())
    chosen = settings.with_overrides(engine="spark", engine_local_below=0, engine_one_task_below=0,
                                     spark_shuffle_partitions=8)
    result = run_batch(chosen, spec, to_datetime(at), spark=spark)
    assert result.counts["accepted"] == 400 and result.engine == "spark/plan", result
    assert asked == [4], asked  # four files of about 100 rows: four tasks, though its shuffles take one
    assert tables.read_arrow(pipeline_name, "windows").num_rows == 7  # a session per key


def broadcasts_of_rows(plan: str) -> list[str]:
    """The broadcasts in a physical plan's tree whose input is not a local relation (rows computed on executors
    first, in jobs of their own)."""
    tree = plan.split("\n\n", 1)[0].splitlines()
    return [line.strip() for line, below in zip(tree, [*tree[1:], ""], strict=True)
            if "BroadcastExchange" in line and "LocalTableScan" not in below]


def test_a_batch_s_writes_broadcast_only_local_rows(settings, tables, spark, spark_connect, pipeline_name,
                                                   monkeypatch) -> None:
    """Every output table's files are written by one Spark query after the per-key step's job
    (``write_outputs``), which broadcasts only local rows: the batch's values and the panes' offsets, the
    latter from the counts the writes took already, one row per step task (``spark_batch.task_offsets``).
    Before, the offsets were summed on executors from the step's output: a nested-loop join and an aggregate,
    broadcast, which ran jobs of their own ahead of the write's, each analysed and planned. Three batches of a
    pipeline several step tasks wide (the later ones rewrite stored windows and the current view), their panes
    numbered as the local engine numbers them."""
    from millpond.lake import spark_io
    from millpond.lake.landing import arrival_tag
    from millpond.model.spec import pipeline_from_dict
    from millpond.model.timeutil import US, iso, to_datetime, to_us
    from millpond.runtime.engines import spark_batch
    from millpond.runtime.job import run_batch

    monkeypatch.setattr(spark_batch, "ROWS_PER_TASK", 60)  # the batch's 240 rows: four step tasks
    plans: list[str] = []
    real = spark_io.collect_writes

    def collect_writes(writes):
        before = spark_connect.last_job()
        got = real(writes)
        after = spark_connect.last_job()
        executions = spark_connect._get(f"applications/{spark_connect._app()}/sql?details=true&planDescription=true"
                                        "&length=10000")
        plans.extend(e.get("planDescription", "") for e in executions
                     if any(before < j <= after for j in e.get("successJobIds", [])))
        return got

    monkeypatch.setattr(spark_io, "collect_writes", collect_writes)
    store = ObjectStore(settings)
    t0 = to_us("2026-03-01T12:00:00Z")
    names = {engine: f"{pipeline_name}_{engine}" for engine in ("spark", "local")}
    for engine, name in names.items():
        spec = pipeline_from_dict({**SESSIONS, "name": name, "source": {"prefix": f"{name}/"}})
        chosen = settings.with_overrides(engine=engine, engine_local_below=0, engine_one_task_below=0,
                                         spark_shuffle_partitions=4)
        emitted = 0
        for batch in (1, 2, 3):
            at = t0 + batch * 300 * US
            body = "".join(json.dumps({"id": f"{batch}-{i}", "key": f"k{i % 40}", "value": i,
                                       "event_time": iso(at - (i + 1) * US)}) + "\n" for i in range(240))
            store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(at - 30 * US)}-{batch}.jsonl",
                            body.encode())
            result = run_batch(chosen, spec, to_datetime(at), spark=spark if engine == "spark" else None)
            assert result.engine.startswith(engine), result
            emitted += result.counts["panes"]
        assert emitted, engine
    assert len(plans) == 3 and all("MapInArrow" in p for p in plans), plans  # one write query a batch
    assert not [b for p in plans for b in broadcasts_of_rows(p)], [b for p in plans for b in broadcasts_of_rows(p)]
    panes = [tables.read_arrow(name, "panes").sort_by([("batch", "ascending"), ("seq", "ascending")])
             .select(["key", "window_start", "window_end", "value", "pane_index", "kind", "batch", "seq"])
             for name in names.values()]
    assert panes[0].num_rows >= 40 and panes[0].equals(panes[1]), (panes[0].slice(0, 5), panes[1].slice(0, 5))
