"""Stages (issue 23): a pipeline reads another pipeline's panes, retractions included (Dataflow paper,
section 2.4). The paper's case: sessions per user upstream (accumulating and retracting), total watched per
hour of session start downstream; after every downstream batch its current view equals the same totals
computed from scratch from the upstream's current view, through merges, late data, an upstream compaction
and a downstream batch that failed mid-commit and was retried."""

from __future__ import annotations

import functools
import json
import random
import threading
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from millpond.config.pipelines import load_pipelines
from millpond.errors import MillpondError
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, to_datetime, to_us
from millpond.runtime import commits
from millpond.runtime.job import run_batch

T0 = to_us("2026-03-01T12:40:00Z")
MINUTE = 60 * US
HOUR = 60 * MINUTE


def upstream_doc(name: str, **changed) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "window": {"type": "sessions", "gap": "30m"},
            "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))",
            "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "2h",
            "watermark": {"policy": "processing_time", "lag": "10m"}, **changed}


def stage_doc(name: str, upstream: str | list[str], **changed) -> dict:
    source = {"pipelines": upstream} if isinstance(upstream, list) else {"pipeline": upstream}
    return {"name": name, "source": {**source, "stream": "panes", "key": "all", "event_time": "window_start"},
            "window": {"type": "fixed", "size": "1h"}, "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))",
            "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1d", **changed}


#: the Spark engine's strategies a stage's twin runs with (``engines.spark``), forced by the one-task threshold;
#: ``alternating``: one task, then the plan, and so on (a strategy is chosen per batch: both read what the other
#: wrote). Batches of the plan cost several Spark jobs each: the scenarios spend them where they test something.
STRATEGIES = ("plan", "one-task", "alternating")


class Engines:
    """A stage and its twins on the Spark engine (same file, a name of their own) over the same upstream, each
    batch run on every engine at the same processing time (issue 36: same tables, whatever the engine). The
    scenario's checks read the local stage (``name``), the only one validated when a batch is (validation
    changes no table); ``assert_same`` compares the twins' tables with it."""

    def __init__(self, settings, spark, doc: dict, strategies: tuple[str, ...]) -> None:
        assert set(strategies) <= set(STRATEGIES)
        self.settings, self.spark = settings, spark
        self.specs = {"local": pipeline_from_dict(doc)}
        self.specs |= {s: pipeline_from_dict({**doc, "name": f"{doc['name']}_{s.replace('-', '_')}"})
                       for s in strategies}
        self.name = doc["name"]
        self.runs = 0

    def run(self, at, validate: bool = False):
        """The stage's batch at ``at`` on every engine; the local engine's result."""
        self.runs += 1
        return {engine: self.run_on(engine, at, validate=validate and engine == "local")
                for engine in self.specs}["local"]

    def run_on(self, engine: str, at, validate: bool = False):
        if engine == "local":
            return run_batch(self.settings, self.specs[engine], at, validate=validate)
        strategy = engine if engine != "alternating" else ("plan", "one-task")[self.runs % 2]
        chosen = self.settings.with_overrides(engine="spark", engine_local_below=0,
                                              engine_one_task_below=0 if strategy == "plan" else 10**9)
        result = run_batch(chosen, self.specs[engine], at, spark=self.spark)
        assert result.skipped or result.engine == f"spark/{strategy}", (result.engine, strategy)
        return result

    def fail(self, at, match: str) -> None:
        """The batch at ``at`` fails the same way on every engine."""
        self.runs += 1
        for engine in self.specs:
            with pytest.raises(MillpondError, match=match):
                self.run_on(engine, at)

    def assert_same(self, tables) -> None:
        local = engine_tables(tables, self.name)
        # a stage consumes its upstreams by version range, not deduplicating by id: no ``seen_ids`` row, on any
        # engine (``steps.dedup.by_id``), and every marker counts no duplicate
        assert local["panes"] and not local["seen_ids"]
        assert all("('duplicates', 0)" in row for row in local["batches"]), local["batches"][:2]
        for engine, spec in self.specs.items():
            if engine != "local":
                assert engine_tables(tables, spec.name) == local, engine


def engine_tables(tables, name: str) -> dict[str, list[str]]:
    """A stage's tables as sorted rows (its name as P; timings and the engine that ran apart)."""
    out = {}
    for table in ("panes", "current", "windows", "seen_ids", "late", "quarantine", "batches"):
        t = tables.read_arrow(name, table, schema=pa.schema([]))
        t = t.drop_columns([c for c in ("phases", "versions", "engine", "strategy") if c in t.column_names])
        out[table] = sorted(repr(sorted(r.items())).replace(name, "P") for r in t.to_pylist())
    return out


# -- the pipeline file and the stage graph ------------------------------------------------------------------
def test_an_upstream_source_parses_with_its_defaults() -> None:
    spec = pipeline_from_dict({**stage_doc("down", "up"), "source": {"pipeline": "up"}})
    assert spec.upstream.pipelines == ("up",)
    assert (spec.upstream.stream, spec.upstream.key, spec.upstream.event_time) == ("panes", "keep", "window_end")
    assert pipeline_from_dict(upstream_doc("up")).upstream is None
    fan_in = pipeline_from_dict(stage_doc("down", ["a", "b"]))
    assert fan_in.upstream.pipelines == ("a", "b") and fan_in.upstream.key == "all"


@pytest.mark.parametrize(("changed", "message"), [
    ({"source": {"pipeline": "up", "prefix": "x/"}}, "either prefix"),
    ({"source": {"pipeline": "up", "key": "each"}}, "source.key 'each': use keep or all"),
    ({"source": {"pipeline": "up", "event_time": "middle"}}, "source.event_time 'middle'"),
    ({"source": {"pipeline": "up", "stream": "current"}}, "source.stream 'current': use panes"),
    ({"source": {"pipelines": "up"}}, "expected a list"),
    ({"source": {"prefix": "x/", "key": "all"}}, "source.key applies to an upstream source"),
    ({"source": {"pipeline": "up", "strem": "panes"}}, "did you mean 'stream'"),
    ({"aggregation": "count"}, "aggregation 'count' cannot read an upstream's panes"),
    ({"aggregation": "max"}, "only an additive aggregation"),
    ({"watermark": {"policy": "processing_time", "lag": "1m"}}, "takes its input watermark from its upstreams"),
])
def test_a_stage_file_is_checked(changed: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        pipeline_from_dict({**stage_doc("down", "up"), **changed})


def write_conf(folder: Path, *docs: dict) -> Path:
    (folder / "pipelines").mkdir(parents=True)
    for doc in docs:
        (folder / "pipelines" / f"{doc['name']}.yaml").write_text(yaml.safe_dump(doc))
    return folder


def test_a_cycle_is_refused_and_named(tmp_path: Path) -> None:
    conf = write_conf(tmp_path, upstream_doc("up"), stage_doc("a", "c"), stage_doc("b", "a"), stage_doc("c", "b"))
    with pytest.raises(ValueError, match=r"cycle: a -> c -> b -> a"):
        load_pipelines(conf)
    with pytest.raises(ValueError, match=r"cycle: me -> me"):
        load_pipelines(write_conf(tmp_path / "self", stage_doc("me", "me")))


@pytest.mark.parametrize(("upstream", "stage", "message"), [
    (upstream_doc("up"), stage_doc("down", "nope"), "source.pipeline 'nope' is not a pipeline here"),
    (upstream_doc("up", accumulation="accumulating"), stage_doc("down", "up"), "accumulating with merging windows"),
    (upstream_doc("up", value_type="float"), stage_doc("down", "up"), "set value_type: float"),
    (upstream_doc("up", aggregation="mean"), stage_doc("down", "up"), "emits 'float' values"),
])
def test_an_upstream_that_cannot_be_read_is_refused(tmp_path: Path, upstream: dict, stage: dict,
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_pipelines(write_conf(tmp_path, upstream, stage))


def test_a_chain_and_a_fan_in_load(tmp_path: Path) -> None:
    fixed = upstream_doc("b", window={"type": "fixed", "size": "1m"}, accumulation="discarding")
    specs = load_pipelines(write_conf(tmp_path, upstream_doc("a"), fixed, stage_doc("both", ["a", "b"]),
                                      stage_doc("total", "both")))
    assert specs["total"].upstream.pipelines == ("both",)
    assert list(specs) == ["a", "b", "both", "total"]  # each after its upstreams
    again = load_pipelines(write_conf(tmp_path / "renamed", upstream_doc("z"), stage_doc("m", "z")))
    assert list(again) == ["z", "m"]


# -- batches ----------------------------------------------------------------------------------------------
def land(settings, name: str, tag: str, events: list[tuple[str, int, int]], arrival: int) -> None:
    body = "".join(json.dumps({"id": f"{tag}-{i}", "key": k, "value": v, "event_time": to_datetime(et).isoformat()})
                   + "\n" for i, (k, et, v) in enumerate(events))
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(arrival)}-{tag}.jsonl",
                                    body.encode())


def from_scratch(tables, upstream: str) -> dict[int, int]:
    """Total of the upstream's current session values per hour of session start."""
    totals: dict[int, int] = defaultdict(int)
    for r in tables.read_arrow(upstream, "current").to_pylist():
        totals[to_us(r["window_start"]) // HOUR * HOUR] += r["value"]
    return {h: v for h, v in totals.items() if v}


def stage_view(tables, stage: str) -> dict[int, int]:
    if not tables.exists(stage, "current"):
        return {}
    rows = tables.read_arrow(stage, "current").to_pylist()
    assert {r["key"] for r in rows} <= {"all"}
    return {to_us(r["window_start"]): r["value"] for r in rows if r["value"]}


def session_events(batch: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """Batch ``batch``'s events (key, event time, value): random users, some late, plus user a's sessions
    that a later event bridges across the hour (13:10 and 13:25 merge in batch 3, into the 12:40 hour)."""
    p = T0 + (batch + 1) * 15 * MINUTE
    out = {1: [("a", T0, 10)], 2: [("a", T0 + 45 * MINUTE, 20)], 3: [("a", T0 + 25 * MINUTE, 5)]}.get(batch, [])
    for user in "bcdef":
        for _ in range(rng.randint(0, 3)):
            delay = rng.choice([rng.randint(0, 20), rng.randint(0, 20), rng.randint(40, 130), 200])
            out.append((user, p - delay * MINUTE - rng.randint(0, 59) * US, rng.randint(1, 100)))
    return out


def test_sessions_then_totals_per_hour_match_a_computation_from_scratch(settings, tables, pipeline_name, spark,
                                                                         monkeypatch) -> None:
    """The stage's twin on Spark as one task gives the local stage's tables (the multi-stage plan: the tests
    below, whose batches cost more there)."""
    up, down = f"{pipeline_name}_up", f"{pipeline_name}_down"
    up_spec, stage = pipeline_from_dict(upstream_doc(up)), Engines(settings, spark, stage_doc(down, up),
                                                                   ("one-task",))
    rng = random.Random(23)
    expected: dict[int, dict[int, int]] = {}
    for batch in range(1, 11):
        p = T0 + (batch + 1) * 15 * MINUTE
        land(settings, up, f"b{batch}", session_events(batch, rng), p - MINUTE)
        run_batch(settings, up_spec, to_datetime(p))
        expected[batch] = from_scratch(tables, up)
        if batch == 4:  # a compaction of the upstream's panes (dataChange=false) is not consumed again
            assert tables.compact(up, "panes", over_files=0)
        if batch == 6:  # the stage fails after its panes commit; the upstream moves on before the retry
            def crash(step: str, b: int) -> None:
                if step == "panes":
                    raise MillpondError("injected failure")

            monkeypatch.setattr(commits, "crash_point", crash)
            stage.fail(to_datetime(p), "injected failure")
            monkeypatch.undo()
            continue
        if batch == 7:  # the retry of batch 6 reads the range its plan recorded: through upstream batch 6
            stage.run(to_datetime(p - 15 * MINUTE))
            assert stage_view(tables, down) == expected[6]
        result = stage.run(to_datetime(p))
        assert stage_view(tables, down) == expected[batch], batch
        up_marker = tables.read_arrow(up, "batches").sort_by("batch").to_pylist()[-1]
        assert result.watermark == up_marker["watermark"]  # the stage's watermark is its upstream's
    marks = tables.read_arrow(up, "batches").to_pylist()
    assert sum(m["retractions"] for m in marks) > 0 and sum(m["late"] for m in marks) > 0
    assert {t for t in tables.read_arrow(up, "panes").column("timing").to_pylist()} >= {"EARLY", "ON_TIME", "LATE"}
    assert len(expected[10]) >= 3  # several hours
    stage_marks = tables.read_arrow(down, "batches").to_pylist()
    assert sum(m["duplicates"] for m in stage_marks) == 0 and sum(m["late"] for m in stage_marks) == 0
    stage.assert_same(tables)


def test_a_stage_s_batches_reach_the_per_key_step_lifted_on_spark(settings, tables, pipeline_name, spark,
                                                                     monkeypatch) -> None:
    """Combiner lifting (``runtime.engines.spark_lift``): a `key: all` stage's batches reach the per-key step of
    the Spark plan as one element per hour they touch (the step is one task: every pane row went through it), the
    first, which reads no stored window, and a later one, which reads the stored hours and adds to them. The
    elements are made once, by the step's read: counted first (``spark_batch.stage_tally``) from the pane files'
    statistics, so that the upstream's rows are read once (the later batch), or by a job over their columns where
    the statistics lack the values' bounds (the first); never kept. The tables, the markers' greatest event time
    included, are the local engine's. The upstream's files are listed once per batch. The step's one task writes
    the stage's tables itself (``spark_one_key``): its output is never kept, counted or written by actions of their
    own, so the batch asks the server for two executions (the tally's job or the stored windows' local checkpoint,
    and the one job that reads, lifts, steps and writes)."""
    from millpond.runtime.engines import spark_batch, spark_keys, spark_upstream
    from millpond.runtime.layout import EVENT_COLUMNS
    from pyspark.sql.connect.client.core import SparkConnectClient

    up, down = f"{pipeline_name}_up", f"{pipeline_name}_down"
    up_spec, stage = pipeline_from_dict(upstream_doc(up)), Engines(settings, spark, stage_doc(down, up), ("plan",))
    rng = random.Random(31)
    for batch in range(1, 6):
        p = T0 + (batch + 1) * 15 * MINUTE
        land(settings, up, f"b{batch}", session_events(batch, rng), p - MINUTE)
        run_batch(settings, up_spec, to_datetime(p))
        if batch < 4:
            continue
        into_step: list[int] = []
        counting = threading.Event()  # set while the test counts (its own execution, not the batch's)

        def counted(combined, *args, real=spark_keys.key_ranges, into=into_step, own=counting, **kw):
            own.set()
            try:
                into.append(combined.where("state IS NULL").count())  # the elements (not the stored windows)
            finally:
                own.clear()
            return real(combined, *args, **kw)

        kept: list[list[str]] = []

        def keeping(spark_, df, *args, real=spark_batch.keep, into=kept, **kw):
            into.append(df.columns)
            return real(spark_, df, *args, **kw)

        listed: list[tuple] = []

        def listing(*args, real, into=listed):
            into.append((real.__name__, *args[1:]))
            return real(*args)

        reads: list[str] = []

        def reading(spark_, tables_, pipeline, *args, real=spark_upstream.spark_io.read_table, into=reads, **kw):
            into.append(pipeline)
            return real(spark_, tables_, pipeline, *args, **kw)

        executions: list[str] = []

        def executing(client, req, *args, real=SparkConnectClient._execute_and_fetch, into=executions,
                      own=counting, **kw):
            # the watchdog's probes wait on no job; the test's own count (``counted``) is not the batch's
            if threading.current_thread().name != "spark-probe" and not own.is_set():
                into.append(req.plan.WhichOneof("op_type"))
            return real(client, req, *args, **kw)

        monkeypatch.setattr(SparkConnectClient, "_execute_and_fetch", executing)
        monkeypatch.setattr(spark_upstream.spark_io, "read_table", reading)
        if batch == 4:  # files without the values' statistics: one job counts the pane rows' own columns
            monkeypatch.setattr(spark_upstream, "magnitude", lambda files, column: None, raising=False)
        monkeypatch.setattr(spark_keys, "key_ranges", counted)
        for module in (spark_batch, spark_upstream):  # every frame a batch keeps
            monkeypatch.setattr(module, "keep", keeping)
        for lister in ("snapshot_files", "added_files"):  # every listing of the upstream's files
            real = getattr(spark_upstream, lister)
            monkeypatch.setattr(spark_upstream, lister, functools.partial(listing, real=real))
        stage.run(to_datetime(p))
        monkeypatch.undo()
        # nothing is kept but the stored windows the later batch reads: neither the elements nor the step's output
        assert len(kept) == (batch == 5) and list(EVENT_COLUMNS) not in kept, kept
        # the first: the tally's job (no values' statistics), then one job; the later: the stored windows' local
        # checkpoint (a command), then one job
        assert executions == (["root", "root"] if batch == 4 else ["command", "root"]), executions
        # sizing, the tally and the read share one listing of the range (each reads the upstream's log)
        assert listed and len(listed) == len(set(listed)), listed
        # counted by a job (the first batch), the upstream's panes are read twice; from statistics (the second,
        # whose stored windows are bounded by its elements' times in the frame that reads them), once, for the step
        assert [r for r in reads if r == up] == [up] * (2 if batch == 4 else 1), reads
        marker = tables.read_arrow(f"{down}_plan", "batches").sort_by("batch").to_pylist()[-1]
        # the hours the consumed panes fall in (an element's event time is its pane's window_start): through
        # upstream batch 4 for the stage's first batch, batch 5's for its second, which reads the stored hours
        hours = {to_us(r["window_start"]) // HOUR for r in tables.read_arrow(up, "panes").to_pylist()
                 if batch == 4 or r["batch"] == 5}
        assert into_step == [len(hours)] and marker["input"] > len(hours), (into_step, marker["input"])
        assert (marker["state_rows_read"] > 0) == (batch == 5)
        assert stage_view(tables, down) == from_scratch(tables, up)
    stage.assert_same(tables)


def fixed_doc(name: str, accumulation: str, lag: str) -> dict:
    return upstream_doc(name, window={"type": "fixed", "size": "10m"}, accumulation=accumulation,
                        allowed_lateness="1h", watermark={"policy": "processing_time", "lag": lag})


def totals_of(tables, upstreams: list[str]) -> dict[tuple[str, int], int]:
    """Per key and hour of the window's last instant: the sum of the upstreams' current values (a discarding
    upstream's current view holds each pane, an accumulating one's the window's latest)."""
    totals: dict[tuple[str, int], int] = defaultdict(int)
    for name in upstreams:
        if tables.exists(name, "current"):
            for r in tables.read_arrow(name, "current").to_pylist():
                totals[(r["key"], (to_us(r["window_end"]) - 1) // HOUR * HOUR)] += r["value"]
    return {k: v for k, v in totals.items() if v}


def test_fan_in_over_accumulating_and_discarding_upstreams(settings, tables, pipeline_name, spark,
                                                           monkeypatch) -> None:
    """A stage reads two upstreams (accumulating, discarding), keeps their keys, and takes the least of their
    watermarks; an upstream batch whose panes landed but whose marker did not is not read until it commits. Its
    twin on Spark (every other batch the multi-stage plan, which looks an accumulating upstream's previous panes
    up on executors) gives the same tables."""
    a, b, both = f"{pipeline_name}_a", f"{pipeline_name}_b", f"{pipeline_name}_both"
    specs = {a: pipeline_from_dict(fixed_doc(a, "accumulating", "5m")),
             b: pipeline_from_dict(fixed_doc(b, "discarding", "20m"))}
    stage = Engines(settings, spark, stage_doc(both, [a, b], source={"pipelines": [a, b], "stream": "panes"}),
                    ("alternating",))
    upstream = stage.specs["local"].upstream
    assert (upstream.key, upstream.event_time) == ("keep", "window_end")
    rng = random.Random(7)
    for batch in range(1, 8):
        p = T0 + batch * 10 * MINUTE
        for name in (a, b):
            events = [(rng.choice("xy"), p - rng.choice([1, 4, 8, 15, 30, 50]) * MINUTE, rng.randint(1, 9))
                      for _ in range(rng.randint(2, 6))]
            land(settings, name, f"b{batch}", events, p - MINUTE)
        if batch == 3:  # a's batch fails after its panes commit: its marker is missing, its panes are not read
            before = totals_of(tables, [a, b])

            def crash(step: str, n: int) -> None:
                if step == "panes":
                    raise MillpondError("injected failure")

            monkeypatch.setattr(commits, "crash_point", crash)
            with pytest.raises(MillpondError, match="injected failure"):
                run_batch(settings, specs[a], to_datetime(p))
            monkeypatch.undo()
            run_batch(settings, specs[b], to_datetime(p))
            # a stage batch before p reads neither a's uncommitted panes nor b's batch at p (after its time)
            stage.run(to_datetime(p - 5 * MINUTE))
            assert stage_totals(tables, both) == before
        for name in (a, b):
            run_batch(settings, specs[name], to_datetime(p))
        result = stage.run(to_datetime(p), validate=batch == 7)  # the DAGs validate
        assert stage_totals(tables, both) == totals_of(tables, [a, b]), batch
        marks = [tables.read_arrow(n, "batches").sort_by("batch").to_pylist()[-1]["watermark"] for n in (a, b)]
        assert result.watermark == min(marks) == marks[1]  # b's longer lag holds the stage back
    assert result.quality is not None and result.quality.ok, result.quality.summary()
    panes = tables.read_arrow(a, "panes")
    assert max(panes.column("pane_index").to_pylist()) >= 1  # accumulating windows fired more than once
    stage.assert_same(tables)


def test_an_accumulating_upstream_s_first_panes_need_no_previous_pane_on_spark(settings, tables, pipeline_name,
                                                                             spark, monkeypatch) -> None:
    """Over an accumulating upstream, an element is what its pane changed: its value less the window's previous
    pane's. A window's first pane (pane index 0) has none, so while the files a batch reads say by their
    statistics that every row is a first pane, the Spark engine looks no previous pane up (that look-up is a
    shuffle of every pane row by window, or a second read of the table); a batch whose files hold a late pane
    (index 1) does. The tables are the local engine's."""
    from millpond.runtime.engines import spark_upstream

    up, down = f"{pipeline_name}_up", f"{pipeline_name}_down"
    up_spec = pipeline_from_dict(fixed_doc(up, "accumulating", "5m") | {"trigger": "AtWatermark(late=AtCount(1))"})
    stage = Engines(settings, spark, stage_doc(down, up, source={"pipeline": up, "stream": "panes"}), ("plan",))
    looked_up: list[int] = []
    real = spark_upstream._with_previous
    monkeypatch.setattr(spark_upstream, "_with_previous",
                        lambda *a, **kw: looked_up.append(1) or real(*a, **kw))
    rng = random.Random(3)
    seen = []
    for batch in range(1, 6):
        p = T0 + batch * 10 * MINUTE
        late = batch == 5  # an event 25 minutes late: a late pane of a window that fired
        events = [(rng.choice("xyz"), p - rng.choice([1, 4, 8]) * MINUTE, rng.randint(1, 9)) for _ in range(5)]
        land(settings, up, f"b{batch}", events + ([("x", p - 25 * MINUTE, 100)] if late else []), p - MINUTE)
        run_batch(settings, up_spec, to_datetime(p))
        looked_up.clear()
        stage.run(to_datetime(p))
        panes = tables.read_arrow(up, "panes").to_pylist() if tables.exists(up, "panes") else []
        new = [r["pane_index"] for r in panes if r["batch"] == batch]
        assert (max(new, default=0) >= 1) == late, (batch, new)
        assert len(looked_up) == (1 if late else 0), (batch, looked_up)
        assert stage_totals(tables, down) == totals_of(tables, [up]), batch
        seen.append(bool(new))
    assert seen.count(True) >= 3, seen  # batches of first panes only, then one with a late pane
    stage.assert_same(tables)


def stage_totals(tables, stage: str) -> dict[tuple[str, int], int]:
    rows = tables.read_arrow(stage, "current").to_pylist() if tables.exists(stage, "current") else []
    return {(r["key"], to_us(r["window_start"])): r["value"] for r in rows if r["value"]}


def test_an_upstream_reprocess_reaches_the_stage_as_retractions(settings, tables, pipeline_name) -> None:
    """An upstream reprocess rewinds its panes (``runtime.rewind``) and recomputes them: the stage takes back
    what it took from the panes the rewind took away, then takes the new panes (a reprocessed pane is not a
    duplicate of the one it replaces). Right after the rewind, and after the upstream has caught up with
    late files landed into the past range, the stage's view equals the totals computed from scratch, and
    its tables equal a stage that starts on the reprocessed upstream."""
    from millpond.runtime import rewind

    up, down, fresh = f"{pipeline_name}_up", f"{pipeline_name}_down", f"{pipeline_name}_fresh"
    up_spec, down_spec = pipeline_from_dict(upstream_doc(up)), pipeline_from_dict(stage_doc(down, up))
    rng = random.Random(7)
    p = lambda batch: to_datetime(T0 + (batch + 1) * 15 * MINUTE)  # noqa: E731
    for batch in range(1, 6):
        land(settings, up, f"b{batch}", session_events(batch, rng), to_us(p(batch)) - MINUTE)
        run_batch(settings, up_spec, p(batch))
        run_batch(settings, down_spec, p(batch))
    before = from_scratch(tables, up)
    land(settings, up, "late", [("g", T0 + 20 * MINUTE, 7), ("a", T0 + 30 * MINUTE, 3)], T0 + 40 * MINUTE)
    rewind.run(settings, tables, up_spec, to_us(p(1)), by="test")
    run_batch(settings, down_spec, p(6))  # the upstream is back at its batch 1
    assert stage_view(tables, down) == from_scratch(tables, up) != before
    for batch in range(2, 8):
        run_batch(settings, up_spec, p(batch))
    run_batch(settings, down_spec, p(7))
    assert stage_view(tables, down) == from_scratch(tables, up)
    assert from_scratch(tables, up) != before  # the late files changed the totals
    run_batch(settings, pipeline_from_dict(stage_doc(fresh, up)), p(7))
    keep = ["key", "window_start", "window_end", "value"]
    view = lambda name: sorted(tables.read_arrow(name, "current").select(keep).to_pylist(),  # noqa: E731
                               key=lambda r: r["window_start"])
    assert view(down) == view(fresh)
    marks = tables.read_arrow(down, "batches").to_pylist()
    assert sum(m["duplicates"] for m in marks) == 0 and sum(m["late"] for m in marks) == 0


def test_the_shipped_stage_reads_the_same_upstream_batches_live_or_in_a_backfill(settings, tables, pipeline_name,
                                                                                   spark) -> None:
    """The shipped video_watch_hourly over video_sessions (conf/pipelines, renamed here): run live, each stage
    batch right after its upstream's, and as a backfill after the upstream finished, a stage batch at
    processing time P reads the upstream batches up to P only, so both give the same tables. The backfill runs
    on the Spark engine, with the shipped engine settings (``conf/millpond.yaml``), as `make run` would."""
    from millpond.examples.demo import land_demo_events

    shipped = load_pipelines()
    up_name, live, late = f"{pipeline_name}_vs", f"{pipeline_name}_live", f"{pipeline_name}_late"
    up = pipeline_from_dict({**shipped["video_sessions"].raw, "name": up_name, "source": {"prefix": f"{up_name}/"}})

    def stage(name: str):
        raw = shipped["video_watch_hourly"].raw
        return pipeline_from_dict({**raw, "name": name, "source": {**raw["source"], "pipeline": up_name}})

    base, step = to_us("2026-03-05T10:00:00Z"), up.batch_interval
    ends = [base + (i + 1) * step for i in range(6)]
    for end in ends:
        land_demo_events(settings, up, to_datetime(end - step), to_datetime(end))
        run_batch(settings, up, to_datetime(end))
        run_batch(settings, stage(live), to_datetime(end))
    on_spark = settings.with_overrides(engine="spark")  # the shipped thresholds (the session's settings load them)
    # the first batch under an `engine.local_below` above its upstream range's rows: in-process; the second
    # under one just met (a row counts as a landing line's bytes): on Spark
    below = {ends[0]: 10**12, ends[1]: 1}
    # small batches: one task each; the last validated, as a DAG run is, and as the multi-stage plan (a validated
    # small batch is one task too: the plan is forced, so that it reads the stage's upstream ranges here as well)
    for end in ends:
        chosen = on_spark.with_overrides(engine_local_below=below.get(end, on_spark.engine_local_below),
                                         **({"engine_one_task_below": 0} if end == ends[-1] else {}))
        result = run_batch(chosen, stage(late), to_datetime(end), spark=spark, validate=end == ends[-1])
        wanted = "local/in-process" if end == ends[0] else "spark/plan" if end == ends[-1] else "spark/one-task"
        assert result.engine == wanted, (result.engine, wanted)
    assert result.quality is not None and result.quality.ok, result.quality.summary()
    timings = ("phases", "versions", "engine", "strategy")
    for table in ("panes", "current", "batches"):
        rows = {n: tables.read_arrow(n, table).drop_columns(
            [c for c in timings if c in tables.read_arrow(n, table).column_names]).to_pylist()
            for n in (live, late)}
        assert sorted(rows[live], key=_canonical) == sorted(rows[late], key=_canonical), table
    assert tables.read_arrow(live, "panes").num_rows > 0
    assert sum(r["retractions"] for r in tables.read_arrow(up_name, "batches").to_pylist()) > 0


def _canonical(row: dict) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def _rewind_scenario(settings, tables, pipeline_name, steps: list[tuple], spark, strategy: str) -> tuple[str, str]:
    """Runs ``steps`` over an upstream of sessions and a stage of hourly totals: ("up", batch) lands that
    batch's events (once) and runs the upstream at its time; ("down", batch) runs the stage at that time;
    ("rewind", batch) rewinds the upstream to its batch at that time, with a late file landed into the past.
    After every stage batch its view equals the totals computed from scratch from the upstream's current; its
    twin on Spark (``strategy``; the plan compares a rewind's two versions on executors) ends with the same
    tables."""
    from millpond.runtime import rewind

    up, down = f"{pipeline_name}_up", f"{pipeline_name}_down"
    up_spec = pipeline_from_dict(upstream_doc(up))
    stage = Engines(settings, spark, stage_doc(down, up), (strategy,))
    rng = random.Random(11)
    p = lambda batch: to_datetime(T0 + (batch + 1) * 15 * MINUTE)  # noqa: E731
    landed: set[int] = set()
    for i, (what, batch) in enumerate(steps):
        if what == "up":
            if batch not in landed:
                land(settings, up, f"b{batch}", session_events(batch, rng), to_us(p(batch)) - MINUTE)
                landed.add(batch)
            run_batch(settings, up_spec, p(batch))
        elif what == "rewind":
            land(settings, up, f"late{i}", [("g", T0 + (5 + i) * MINUTE, 7 + i), ("a", T0 + 30 * MINUTE, 3)],
                 T0 + 40 * MINUTE)
            rewind.run(settings, tables, up_spec, to_us(p(batch)), by="test")
        else:
            stage.run(p(batch))
            assert stage_view(tables, down) == from_scratch_at(tables, up, to_us(p(batch))), (i, what, batch)
    stage.assert_same(tables)
    return up, down


def from_scratch_at(tables, upstream: str, processing_time: int) -> dict[int, int]:
    """``from_scratch`` of the upstream as its last marker at or before ``processing_time`` names it."""
    marks = [m for m in tables.read_arrow(upstream, "batches").to_pylist()
             if to_us(m["processing_time"]) <= processing_time]
    if not marks:
        return {}
    version = json.loads(max(marks, key=lambda m: m["batch"])["versions"])["current"]
    totals: dict[int, int] = defaultdict(int)
    for r in tables.read_arrow(upstream, "current", version=version).to_pylist():
        totals[to_us(r["window_start"]) // HOUR * HOUR] += r["value"]
    return {h: v for h, v in totals.items() if v}


def test_a_stage_that_lags_keeps_the_upstream_panes_a_rewind_kept(settings, tables, pipeline_name, spark) -> None:
    """Issue 37 (2): the stage consumed through upstream batch 2; the upstream ran to 6, was rewound to 4 and
    redid 5 and 6. The panes of batches 3 and 4, which the rewind kept, were never read (521 vs 687)."""
    steps = [*(("up", b) for b in range(1, 7))]
    steps[2:2] = [("down", 1), ("down", 2)]
    steps += [("rewind", 4), ("up", 5), ("up", 6), ("down", 6)]
    _rewind_scenario(settings, tables, pipeline_name, steps, spark, "plan")


def test_two_rewinds_inside_one_stage_range(settings, tables, pipeline_name, spark) -> None:
    """Issue 37 (2): two upstream rewinds (to 2, then to 4) between two stage batches."""
    steps = [("up", 1), ("down", 1), *(("up", b) for b in range(2, 7)), ("rewind", 2),
             *(("up", b) for b in range(3, 7)), ("rewind", 4), ("up", 5), ("up", 6), ("down", 6)]
    _rewind_scenario(settings, tables, pipeline_name, steps, spark, "plan")


def test_the_stage_batches_after_an_upstream_rewind_go_on(settings, tables, pipeline_name, spark) -> None:
    """Issue 37 (4): after an upstream rewind the stage's first batch took the rewind; its second, before the
    upstream committed again, failed with "was up reset?" and blocked the stage. Also: stage batches at times
    before the upstream's rewound batches, and a rewind to before the upstream's first batch."""
    steps = [("up", 1), ("down", 1), ("up", 2), ("down", 2), ("up", 3), ("up", 4), ("down", 4),
             ("rewind", 1), ("down", 5), ("down", 6), ("up", 2), ("down", 7), ("up", 3), ("up", 4),
             ("down", 8), ("rewind", -1), ("down", 9), ("down", 10), ("up", 1), ("up", 2), ("down", 11)]
    # on Spark, alternately: the batch right after the rewind to before the upstream's first batch is the plan's
    _rewind_scenario(settings, tables, pipeline_name, steps, spark, "alternating")


def test_a_validated_stage_is_judged_alike_on_every_engine(settings, tables, pipeline_name, spark) -> None:
    """A stage's batch validated (as every DAG run is) on the local engine, the one task and the multi-stage plan:
    its raw suite judges its elements (upstream panes, unique by construction), its panes its retractions; the
    same reports, none critical."""
    from test_quality_spark import _outcome

    up = f"{pipeline_name}_up"
    up_spec = pipeline_from_dict(upstream_doc(up))
    stages = {engine: pipeline_from_dict(stage_doc(f"{pipeline_name}_{engine}", up)) for engine in
              ("local", "task", "plan")}
    chosen = {"local": settings.with_overrides(engine="local"),
              "task": settings.with_overrides(engine="spark", engine_local_below=0, engine_one_task_below=10**9),
              "plan": settings.with_overrides(engine="spark", engine_local_below=0, engine_one_task_below=0)}
    rng = random.Random(5)
    reports: dict[str, list] = {engine: [] for engine in stages}
    for batch in range(1, 4):
        p = T0 + (batch + 1) * 15 * MINUTE
        land(settings, up, f"b{batch}", session_events(batch, rng), p - MINUTE)
        run_batch(settings, up_spec, to_datetime(p))
        for engine, spec in stages.items():
            result = run_batch(chosen[engine], spec, to_datetime(p), validate=True,
                               spark=None if engine == "local" else spark)
            assert result.quality.ok, (engine, result.quality.critical_failures)
            assert result.engine == {"local": "local/in-process", "task": "spark/one-task",
                                     "plan": "spark/plan"}[engine]
            reports[engine].append(_outcome(result.quality))
    assert reports["task"] == reports["local"] == reports["plan"]
    assert sum(m["retractions"] for m in tables.read_arrow(up, "batches").to_pylist()) > 0
