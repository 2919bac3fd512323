"""MillWheel computations on the micro-batch (issue 4): per-key state and timers that survive batches
and restarts, event timers gated by the low watermark, processing timers, productions exactly once
under a crash and rerun, and Zeitgeist finding injected spikes and dips (and nothing on steady traffic).
On both engines: the Spark engine's batches (``engines.spark_computation``) leave the same tables as the local
engine's (issue 36)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml
from engines import asked_columns
from millpond.errors import MillpondError
from millpond.examples.zeitgeist import query_stream
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables
from millpond.model.computation import Computation, Context, Record, Timer, load_computation, run_key
from millpond.model.spec import pipeline_from_dict
from millpond.model.step import BatchClock
from millpond.model.timeutil import US, iso, to_us
from millpond.runtime.computation import ComputationBatch, output_watermark
from millpond.runtime.job import run_batch

T0 = datetime(2026, 4, 1, 12, 0, tzinfo=UTC)
MIN = 60 * US


def at(minutes: float) -> int:
    return to_us(T0 + timedelta(minutes=minutes))


class Recorder(Computation):
    """Test computation: counts records per key; value 1 arms an event timer at the end of the record's
    minute, 3 also a chain of event timers a minute apart, 7 a processing timer 90 s out, -1 cancels, -2
    forgets the key (its state deleted, its timer cancelled)."""

    output_streams = {"log": None}

    def process_record(self, ctx: Context, record: Record) -> None:
        if record.value == -2:
            ctx.state.clear()
            ctx.cancel_timer("end")
            return
        st = ctx.state
        st["n"] = st.get("n", 0) + 1
        st.setdefault("ids", []).append(record.id)
        if record.value == -1:
            ctx.cancel_timer("end")
            return
        ctx.set_event_timer("end", record.event_time - record.event_time % MIN + MIN)
        if record.value == 3:
            ctx.set_event_timer("chain-0", record.event_time)
        if record.value == 7:
            ctx.set_processing_timer("ping", ctx.processing_time + 90 * US)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        ctx.state.setdefault("fired", []).append(timer.tag)
        ctx.produce("log", {"key": ctx.key, "tag": timer.tag, "domain": timer.domain, "at": timer.at,
                            "watermark": ctx.watermark})
        if timer.tag.startswith("chain-") and int(timer.tag[6:]) < 3:
            ctx.set_event_timer(f"chain-{int(timer.tag[6:]) + 1}", timer.at + MIN)


def land(settings, prefix: str, arrival: int, events: list[dict]) -> None:
    body = "".join(json.dumps(e, sort_keys=True) + "\n" for e in events).encode()
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{prefix}{arrival_tag(arrival)}-f.jsonl", body)


def ev(i: str, key: str, value: int, minute: float) -> dict:
    return {"id": i, "key": key, "value": value, "event_time": iso(at(minute)), "arrival_time": iso(at(minute))}


def test_config_validation() -> None:
    base = {"name": "c", "computation": "test_computation:Recorder"}
    assert pipeline_from_dict(base).raw["computation"] == "test_computation:Recorder"
    with pytest.raises(ValueError, match="no window or trigger"):
        pipeline_from_dict({**base, "window": {"type": "fixed", "size": "1m"}})
    with pytest.raises(ValueError, match="cannot be loaded"):
        pipeline_from_dict({**base, "computation": "test_computation:Nope"})
    with pytest.raises(ValueError, match="not a subclass"):
        pipeline_from_dict({**base, "computation": "millpond.model.step:BatchClock"})
    with pytest.raises(ValueError, match="bad options"):
        pipeline_from_dict({**base, "computation": {"class": "millpond.examples.zeitgeist:Zeitgeist", "colour": "red"}})
    assert load_computation({"class": "millpond.examples.zeitgeist:Zeitgeist", "k": 3}).k == 3.0


@pytest.fixture(params=["local", "spark"])
def engine(request, settings, monkeypatch):
    """(settings, session): the local engine, or the Spark engine (the session's ``spark``) for every batch, its
    keys spread over three tasks (a task per row, at most three), so that tasks' tallies and inferred stream
    types are merged and the rewritten state comes from several tasks."""
    if request.param == "local":
        return settings.with_overrides(engine="local"), None
    from millpond.runtime.engines import spark_batch
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module's computations, on executors
    monkeypatch.setattr(spark_batch, "ROWS_PER_TASK", 1)
    return (settings.with_overrides(engine="spark", engine_local_below=0, spark_shuffle_partitions=3),
            request.getfixturevalue("spark"))


def recorder_scenario(settings, spark, name: str) -> tuple[list, list[tuple[str, str]]]:
    """Four batches of the Recorder (a bad line and a re-delivery in the first): its results, and the timers
    pending after the first."""
    spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"},
                               "computation": "test_computation:Recorder", "batch_interval": "1m"})
    land(settings, f"{name}/", at(0.5), [ev("a1", "a", 1, 0.1), ev("a2", "a", 1, 0.3), ev("b1", "b", 1, 0.6),
                                         ev("c1", "c", 3, 50 / 60), ev("d1", "d", 7, 0.2), ev("e1", "e", 1, 0.4),
                                         ev("f1", "f", 1, 0.45)])
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(at(0.5))}-g.jsonl",
                                    b'{"id": "g1", "key": "g"\n' + json.dumps(ev("a1", "a", 1, 0.1)).encode() + b"\n")
    # Each run_batch is a fresh job: state and timers come back from Delta, nothing from memory.
    results = [run_batch(settings, spec, T0 + timedelta(minutes=1), watermark=T0, spark=spark)]
    pending = Tables(settings).select(name, "timers", columns=["key", "tag"])
    land(settings, f"{name}/", at(1.5), [ev("e2", "e", -1, 1.5), ev("f2", "f", -2, 1.5)])
    for minute, watermark in ((2, timedelta(seconds=55)), (3, timedelta(seconds=55)), (4, timedelta(minutes=10))):
        results.append(run_batch(settings, spec, T0 + timedelta(minutes=minute), watermark=T0 + watermark,
                                 spark=spark))
    return results, sorted(zip(*pending.to_pydict().values(), strict=True))


@pytest.fixture(scope="module")
def recorder_local(settings) -> tuple[str, list, list[tuple[str, str]]]:
    """The Recorder's scenario on the local engine: the reference the Spark engine's tables must equal."""
    name = "recorder_local"
    return (name, *recorder_scenario(settings.with_overrides(engine="local"), None, name))


def test_state_and_timers_across_batches_and_restarts(engine, tables, recorder_local, pipeline_name,
                                                      monkeypatch) -> None:
    chosen, spark = engine
    asked = asked_columns(monkeypatch)  # a Spark batch's reads, per-key step and writes name their columns
    name, (r1, r2, r3, r4), pending = (recorder_local if spark is None
                                       else (pipeline_name, *recorder_scenario(chosen, spark, pipeline_name)))
    assert asked == [], asked
    assert r1.counts["timers_fired"] == 0 and r1.counts["keys"] == 6 and r1.counts["productions"] == 0
    assert (r1.counts["quarantined"], r1.counts["duplicates"]) == (1, 1)  # a bad line; a1 delivered twice
    assert pending == [("a", "end"), ("b", "end"), ("c", "chain-0"), ("c", "end"), ("d", "end"), ("d", "ping"),
                       ("e", "end"), ("f", "end")]
    # Only c (a due timer), e and f (records) are read: 3 states + c's 2 timers + e's and f's 1 each.
    assert r2.counts["keys"] == 3 and r2.counts["state_rows_read"] == 7
    assert r2.counts["timers_fired"] == 1  # c's chain-0 (12:00:50); e's cancelled by the record first
    # The watermark is stuck: only the processing timer fires, when processing time reaches it.
    assert r3.counts["keys"] == 1 and r3.counts["timers_fired"] == 1
    assert r4.counts["timers_fired"] == 7
    assert {r.engine for r in (r1, r2, r3, r4)} == {"local/in-process" if spark is None else "spark/plan"}

    log = tables.read_arrow(name, "log").to_pylist()
    fired = defaultdict(list)
    for row in sorted(log, key=lambda r: r["batch"]):  # within a batch: the key's firing order
        fired[row["key"]].append((row["batch"], row["tag"], row["domain"], row["at"]))
    assert fired["c"] == [(2, "chain-0", "event", at(50 / 60)), (4, "end", "event", at(1)),
                          (4, "chain-1", "event", at(50 / 60 + 1)), (4, "chain-2", "event", at(50 / 60 + 2)),
                          (4, "chain-3", "event", at(50 / 60 + 3))]
    assert fired["d"] == [(3, "ping", "processing", at(2.5)), (4, "end", "event", at(1))]
    assert fired["a"] == [(4, "end", "event", at(1))] and fired["b"] == [(4, "end", "event", at(1))]
    assert "e" not in fired and "f" not in fired
    assert all(r["watermark"] >= r["at"] for r in log if r["domain"] == "event")  # never before the watermark
    for rows in fired.values():  # per key, in time order across batches
        assert [r[3] for r in rows if r[2] == "event"] == sorted(r[3] for r in rows if r[2] == "event")

    state = {r["key"]: json.loads(r["state"]) for r in tables.select(name, "comp_state").to_pylist()}
    assert state["a"] == {"n": 2, "ids": ["a1", "a2"], "fired": ["end"]}
    assert state["e"] == {"n": 2, "ids": ["e1", "e2"]} and "f" not in state  # f's state deleted
    assert tables.select(name, "timers").num_rows == 0  # every timer consumed
    # The output watermark follows the input one (nothing held) and is what downstream reads.
    marks = sorted(tables.read_arrow(name, "watermarks").to_pylist(), key=lambda r: r["batch"])
    assert [to_us(r["output_watermark"]) for r in marks] == [at(0), at(55 / 60), at(55 / 60), at(10)]
    assert output_watermark(tables, name) == at(10)
    # A retry of a committed batch is skipped: nothing fires twice.
    spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"},
                               "computation": "test_computation:Recorder", "batch_interval": "1m"})
    assert run_batch(chosen, spec, T0 + timedelta(minutes=4), spark=spark).skipped
    assert tables.read_arrow(name, "log").num_rows == len(log)
    if spark is not None:  # every table as the local engine left it
        assert snapshot(tables, name, ("log",), across_engines=True) == snapshot(
            tables, recorder_local[0], ("log",), across_engines=True)


def test_firing_bound_holds_the_output_watermark() -> None:
    """Timers left due by the per-key firing bound wait for the next batch and hold the watermark."""

    class Bounded(Recorder):
        max_timer_firings = 2

    clock = BatchClock(batch=1, processing_time=at(20), input_watermark=at(0), watermark=at(10))
    comp = Bounded()
    out = run_key(comp, "c", [Record("c1", "c", 3, at(0.5), at(0.5))], None, {}, clock)
    assert [p[1]["tag"] for p in out.productions] == ["chain-0", "end"]
    assert out.held_by == at(1.5)  # chain-1 was due but not fired
    stored = {t.tag: t for t in out.timer_upserts}
    again = run_key(comp, "c", [], out.state, stored, clock)
    assert [p[1]["tag"] for p in again.productions] == ["chain-1", "chain-2"] and again.held_by == at(3.5)


class Mixed(Recorder):
    """Also logs each record with a type that depends on its key (an inferred stream's types, merged)."""

    def process_record(self, ctx: Context, record: Record) -> None:
        super().process_record(ctx, record)
        ctx.produce("log", {"key": ctx.key, "v": 1 if ctx.key == "a" else 1.5, "note": "x" if ctx.key == "c" else None})


def test_spark_tasks_split_keys_as_one_process_would() -> None:
    """The Spark engine's per-key step gives the same rows whichever of its tasks a key falls in (untouched keys'
    state and timers passed through, a due timer's key run), and a stream's schema inferred from the tasks' parts
    is the one the local engine infers from all the batch's rows (``pa.Table.from_pylist``)."""
    from millpond.runtime.computation_tables import inferred_schema
    from millpond.runtime.engines.spark_computation import run_partition

    cols = [("src", pa.string()), ("key", pa.string()), ("id", pa.string()), ("value", pa.int64()),
            ("event_time", pa.int64()), ("arrival_time", pa.int64()), ("state", pa.string()), ("batch", pa.int64()),
            ("tag", pa.string()), ("domain", pa.string()), ("fire_at", pa.int64())]
    rows = [("r", "a", "a1", 1, at(0.1), at(0.1)), ("r", "b", "b1", 7, at(0.2), at(0.2)),
            ("r", "c", "c1", 3, at(0.3), at(0.3)), ("s", "a", *[None] * 4, '{"n":1}', 1),
            ("s", "x", *[None] * 4, '{"n":5}', 1), ("s", "d", *[None] * 4, '{"n":2}', 1),
            ("t", "d", *[None] * 5, 1, "end", "event", at(0.5)), ("t", "x", *[None] * 5, 1, "end", "event", at(30)),
            ("t", "a", *[None] * 5, 1, "old", "processing", at(100))]  # a row's missing columns are null
    table = pa.Table.from_pylist([dict(zip([c for c, _ in cols], r, strict=False)) for r in rows],
                                 schema=pa.schema(cols))
    clock = BatchClock(batch=2, processing_time=at(2), input_watermark=at(0), watermark=at(1))
    comp, infer = Mixed(), frozenset({"log"})

    def run(keys: set[str]) -> pa.Table:
        return run_partition(comp, clock, infer, "p", table.filter(pc.is_in(table.column("key"),
                                                                            pa.array(sorted(keys)))))

    whole, parts = run({"a", "b", "c", "d", "x"}), [run({"a", "c", "x"}), run({"b", "d"})]

    def rows_of(t: pa.Table, tbl: str) -> list:
        return sorted(repr(r) for r in t.filter(pc.equal(t.column("tbl"), tbl)).to_pylist())

    for tbl in ("state", "timer", "prod"):
        assert rows_of(whole, tbl) == sorted(sum((rows_of(t, tbl) for t in parts), [])), tbl
    tally = whole.filter(pc.equal(whole.column("tbl"), "tally")).to_pylist()[0]
    assert (tally["keys"], tally["fired"], tally["read"], tally["state_changes"]) == (4, 5, 4, 4)
    assert sorted(r["key"] for r in rows_of_dicts(whole, "state")) == ["a", "b", "c", "d", "x"]
    produced = [pickle.loads(r["record"]) for r in sorted(rows_of_dicts(whole, "prod"),
                                                          key=lambda r: (r["key"], r["seq"]))]

    def part(t: pa.Table) -> tuple:
        r = rows_of_dicts(t, "stream")[0]
        return r["key"], json.loads(r["names"]), pa.ipc.read_schema(pa.py_buffer(r["record"]))

    assert inferred_schema("p", "log", [part(t) for t in parts]) == pa.Table.from_pylist(produced).schema
    assert pa.Table.from_pylist(produced).schema == pa.schema([("key", pa.string()), ("v", pa.float64()),
                                                               ("note", pa.string()), ("batch", pa.int64())])


def rows_of_dicts(t: pa.Table, tbl: str) -> list[dict]:
    return t.filter(pc.equal(t.column("tbl"), tbl)).to_pylist()


# -- Zeitgeist ---------------------------------------------------------------------------------------
RATES = {"q0": 35.0, "q1": 40.0, "q2": 30.0, "s0": 20.0, "s1": 28.0}
SPIKES = {("q0", 75): 4.0, ("q1", 100): 4.0, ("q1", 101): 4.0, ("q2", 150): 4.0}
DIPS = {("q0", 70), ("q1", 120), ("q1", 121), ("q2", 160)}
BATCHES = 3  # one minute each; the last watermark is 2:55, data runs to 3:10 (no end-of-stream dip)
LATE = 20


def zeitgeist_doc(name: str) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "computation": "millpond.examples.zeitgeist:Zeitgeist",
            "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "5s"},
            "dedup": {"horizon": "10m"}}


def land_stream(settings, name: str) -> None:
    events = query_stream(at(0), BATCHES * 60 + 10, RATES, spikes=SPIKES, dips=DIPS, seed=4)
    # Stragglers: searches from second 30 arriving at 1:40, after that second was judged (dropped, counted).
    events += [{"id": f"late-{i}", "key": "q0", "value": 1, "event_time": iso(at(0.5) + i),
                "arrival_time": iso(at(100 / 60))} for i in range(LATE)]
    by_minute: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_minute[(to_us(e["arrival_time"]) - at(0)) // MIN].append(e)
    for m, chunk in by_minute.items():
        land(settings, f"{name}/", at(m), chunk)


def snapshot(tables, name: str, streams: tuple[str, ...] = ("anomalies",), across_engines: bool = False
             ) -> dict[str, list]:
    """Every table's rows, sorted. ``across_engines``: without what differs by engine, apart from timings (the
    engine and strategy that ran, and the tables' versions: a table the Spark engine creates starts with an
    empty version 0, the local engine's first write is its version 0)."""
    out = {}
    drop = ("phases", "versions", "engine", "strategy") if across_engines else ("phases",)
    for table in (*ComputationBatch.state_tables, "quarantine", "ingest_log", *streams, "batches"):
        t = tables.read_arrow(name, table, schema=pa.schema([]))
        t = t.drop([c for c in drop if c in t.column_names])
        out[table] = sorted(repr(sorted(r.items())).replace(name, "<pipeline>") for r in t.to_pylist())
    return out


@pytest.fixture(scope="module")
def zeitgeist_reference(settings, tables) -> str:
    name = "zg_reference"
    land_stream(settings, name)
    spec = pipeline_from_dict(zeitgeist_doc(name))
    for b in range(1, BATCHES + 1):
        run_batch(settings, spec, T0 + timedelta(minutes=b))
    return name


def test_zeitgeist_finds_injected_spikes_and_dips(tables, zeitgeist_reference) -> None:
    rows = tables.read_arrow(zeitgeist_reference, "anomalies").to_pylist()
    found = {(r["key"], (to_us(r["second"]) - at(0)) // US, r["kind"]) for r in rows}
    expected = {(q, s, "spike") for q, s in SPIKES} | {(q, s, "dip") for q, s in DIPS}
    assert found == expected  # every injected anomaly, nothing else: steady s0/s1 report nothing
    assert not {r["key"] for r in rows} & {"s0", "s1"}
    for r in rows:
        if r["kind"] == "spike":  # reported on arrival, as soon as the bound is crossed
            assert r["count"] > r["expected"] * 1.5
        else:
            assert r["count"] == 0 and r["expected"] > 15
    state = {r["key"]: json.loads(r["state"]) for r in tables.select(zeitgeist_reference, "comp_state").to_pylist()}
    assert state["q0"]["dropped"] == LATE and all("dropped" not in v for k, v in state.items() if k != "q0")
    late = {r["batch"]: r["late"] for r in tables.read_arrow(zeitgeist_reference, "batches").to_pylist()}
    assert late == {1: 0, 2: LATE, 3: 0}
    # Spikes come from records, dips from timers: a dip at second s waits for the watermark past s + 1.
    marks = {r["batch"]: to_us(r["output_watermark"]) for r in tables.read_arrow(zeitgeist_reference,
                                                                                 "watermarks").to_pylist()}
    for r in rows:
        if r["kind"] == "dip":
            assert marks[r["batch"]] >= to_us(r["second"]) + US
            assert r["batch"] == 1 or marks[r["batch"] - 1] < to_us(r["second"]) + US


def test_zeitgeist_as_the_paper_draws_it_a_counter_feeding_the_model(engine, tables, zeitgeist_reference,
                                                                      pipeline_name) -> None:
    """MillWheel's Figure 1: a windowed per-second counter (a stage with early panes, discarding) feeds the
    model computation (``input: counts``), which reads the counter's panes as a stage does. Over the same
    searches it finds the same anomalies as the one-computation Zeitgeist, in the same batches; its input
    watermark is the counter's. On either engine (the shipped ``zeitgeist_counts`` and ``zeitgeist``)."""
    settings, spark = engine
    counter, model = f"{pipeline_name}_counts", f"{pipeline_name}_model"
    counts = pipeline_from_dict({
        "name": counter, "source": {"prefix": f"{zeitgeist_reference}/"}, "window": {"type": "fixed", "size": "1s"},
        "trigger": "AtWatermark(early=AtCount(5))", "accumulation": "discarding", "aggregation": "count",
        "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "5s"}, "dedup": {"horizon": "10m"}})
    chain = pipeline_from_dict({
        "name": model, "source": {"pipeline": counter, "stream": "panes", "event_time": "window_start"},
        "computation": {"class": "millpond.examples.zeitgeist:Zeitgeist", "input": "counts"},
        "batch_interval": "1m", "dedup": {"horizon": "10m"}})
    for b in range(1, BATCHES + 1):
        run_batch(settings, counts, T0 + timedelta(minutes=b), spark=spark)
        result = run_batch(settings, chain, T0 + timedelta(minutes=b), validate=True, spark=spark)  # as its DAG
        assert result.engine.startswith("spark/" if spark is not None else "local/"), result.engine
        if result.counts["productions"]:  # its anomalies are checked by their committed suite
            assert result.quality.ok and result.quality.suites == {"millpond_stream_anomalies": True}
        counter_mark = tables.read_arrow(counter, "batches").sort_by("batch").to_pylist()[-1]
        assert result.watermark == counter_mark["watermark"]

    def found(name: str) -> set[tuple]:
        return {(r["key"], (to_us(r["second"]) - at(0)) // US, r["kind"], r["batch"])
                for r in tables.read_arrow(name, "anomalies").to_pylist()}

    assert found(model) == found(zeitgeist_reference)
    assert {(q, s, k) for q, s, k, _ in found(model)} == ({(q, s, "spike") for q, s in SPIKES}
                                                          | {(q, s, "dip") for q, s in DIPS})
    panes = tables.read_arrow(counter, "panes")
    assert set(panes.column("timing").to_pylist()) >= {"EARLY", "ON_TIME"}  # early counts, then the rest
    with pytest.raises(ValueError, match="input is searches"):
        load_computation({"class": "millpond.examples.zeitgeist:Zeitgeist", "input": "bytes"})


class BadAnomalies(Computation):
    """Reports a made-up kind of anomaly for every record: its stream's suite must stop the batch."""

    output_streams = {"anomalies": pa.schema([("key", pa.string()), ("second", pa.timestamp("us", tz="UTC")),
                                               ("kind", pa.string()), ("count", pa.int64()),
                                               ("expected", pa.float64())])}

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce("anomalies", {"key": ctx.key, "second": record.event_time, "kind": "bump", "count": 1,
                                  "expected": 1.0})


class Undeclared(Computation):
    """Produces to a stream it did not declare: a mistake in the computation, one line on either engine."""

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce("nowhere", {"key": ctx.key})


def test_a_stream_that_fails_its_suite_stops_the_batch(engine, tables, pipeline_name) -> None:
    """Validated on the batch's engine (Great Expectations' Spark engine on Spark): nothing is published."""
    chosen, spark = engine
    spec = pipeline_from_dict({"name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"},
                               "computation": "test_computation:BadAnomalies", "batch_interval": "1m"})
    land(chosen, f"{pipeline_name}/", at(0), [{"id": "e1", "key": "q", "value": 1, "event_time": iso(at(0.5)),
                                               "arrival_time": iso(at(0.5))}])
    with pytest.raises(MillpondError, match="failed critical data-quality checks.*kind"):
        run_batch(chosen, spec, T0 + timedelta(minutes=1), validate=True, spark=spark)
    assert not tables.exists(pipeline_name, "anomalies") and not tables.exists(pipeline_name, "batches")
    wrong = pipeline_from_dict({**spec.raw, "computation": "test_computation:Undeclared"})
    with pytest.raises(MillpondError, match=r"^produce to undeclared stream 'nowhere'"):
        run_batch(chosen, wrong, T0 + timedelta(minutes=1), spark=spark)


def test_zeitgeist_quiet_on_steady_traffic() -> None:
    """Six minutes of steady traffic for six queries, one-minute batches, in memory: no anomaly."""
    rates = {f"k{i}": 5.0 + 7 * i for i in range(6)}
    events = [(e["id"], e["key"], to_us(e["event_time"]), to_us(e["arrival_time"]))
              for e in query_stream(at(0), 360, rates, seed="steady")]
    comp = load_computation("millpond.examples.zeitgeist:Zeitgeist")
    state: dict[str, str | None] = {}
    timers: dict[str, dict[str, Timer]] = defaultdict(dict)
    produced, fired, wm = [], 0, at(-1)
    for b in range(1, 7):
        clock = BatchClock(b, at(b), wm, at(b) - 5 * US)
        by_key: dict[str, list[Record]] = defaultdict(list)
        for i, key, et, arrival in events:
            if at(b - 1) <= arrival < at(b):
                by_key[key].append(Record(i, key, 1, et, arrival))
        for key in sorted(set(by_key) | set(timers)):
            out = run_key(comp, key, by_key[key], state.get(key), timers[key], clock)
            state[key] = out.state if out.state_changed else state.get(key)
            timers[key] = {**{t: v for t, v in timers[key].items() if t not in out.timer_deletes},
                           **{t.tag: t for t in out.timer_upserts}}
            produced += out.productions
            fired += out.fired
        wm = clock.watermark
    assert fired == 6 * (360 - 5) and produced == []


#: a batch on the Spark engine in a process of its own (a Connect client of the session's server, as an Airflow
#: task is), killed by MILLPOND_CRASH_AFTER
SPARK_CLIENT = """
import json, sys
from millpond.config import load_settings
from millpond.model.spec import pipeline_from_dict
from millpond.runtime.engines.spark_client import connect
from millpond.runtime.job import run_batch
settings = load_settings().with_overrides(engine="spark", engine_local_below=0, spark_connect=sys.argv[3])
run_batch(settings, pipeline_from_dict(json.loads(sys.argv[1])), sys.argv[2], spark=connect(settings))
"""


def test_zeitgeist_on_spark_killed_retried_and_validated_equals_the_local_run(settings, tables, spark, spark_connect,
                                                                              zeitgeist_reference) -> None:
    """Zeitgeist on the Spark engine, its second batch SIGKILLed right after its copy-on-write ``comp_state``
    commit, then retried as a DAG run does it (validated: its anomalies on Great Expectations' Spark engine). The
    retry must not read the state that commit left (it recomputes from the plan's versions) nor commit it again:
    every table as the local engine's uninterrupted run left it."""
    name = "zg_spark"
    land_stream(settings, name)
    chosen = settings.with_overrides(engine="spark", engine_local_below=0)
    spec = pipeline_from_dict(zeitgeist_doc(name))
    first = run_batch(chosen, spec, T0 + timedelta(minutes=1), spark=spark)
    crashed = subprocess.run([sys.executable, "-c", SPARK_CLIENT, json.dumps(spec.raw), iso(at(2)), spark_connect.url],
                             env={**os.environ, "MILLPOND_CRASH_AFTER": "comp_state"}, capture_output=True, text=True,
                             timeout=600)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert max(tables.read_arrow(name, "batches").column("batch").to_pylist()) == 1
    planned = json.loads(tables.read_arrow(name, "ingest_log").sort_by("batch").column("versions")[-1].as_py())
    assert tables.version(name, "comp_state") > planned["comp_state"]  # its state landed, unmarked
    retried = run_batch(chosen, spec, T0 + timedelta(minutes=2), spark=spark, validate=True)
    assert retried.counts["productions"] and retried.quality.ok
    assert retried.quality.suites == {"millpond_stream_anomalies": True}
    last = run_batch(chosen, spec, T0 + timedelta(minutes=3), spark=spark)
    assert [r.engine for r in (first, retried, last)] == ["spark/plan"] * 3
    assert snapshot(tables, name, across_engines=True) == snapshot(tables, zeitgeist_reference, across_engines=True)


@pytest.mark.parametrize("step", ["comp_state", "timers", "produce_anomalies", "watermarks"])
def test_productions_exactly_once_after_crash_and_rerun(settings, tables, zeitgeist_reference, tmp_path,
                                                        step) -> None:
    name = f"zg_crash_{step}"
    land_stream(settings, name)
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump(zeitgeist_doc(name)))
    spec = pipeline_from_dict(zeitgeist_doc(name))
    run_batch(settings, spec, T0 + timedelta(minutes=1))
    env = {**os.environ, "MILLPOND_RUN_ID": f"retry-of-{name}"}
    cmd = [sys.executable, "-m", "millpond", "batch", str(conf), "--at", iso(at(2))]
    crashed = subprocess.run(cmd, env={**env, "MILLPOND_CRASH_AFTER": step}, capture_output=True, text=True,
                             timeout=120)
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # killed right after the commit, no cleanup
    landed = set(tables.read_arrow(name, "anomalies", schema=pa.schema([("batch", pa.int64())]))
                 .column("batch").to_pylist())
    # A batch's commits between plan and marker run concurrently (one thread per table): the crashed step's
    # own commit landed, the others may or may not have; only the marker decides what readers see.
    if step == "produce_anomalies":
        assert 2 in landed
    assert max(tables.read_arrow(name, "batches").column("batch").to_pylist()) == 1  # ... uncommitted
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    run_batch(settings, spec, T0 + timedelta(minutes=3))
    assert snapshot(tables, name) == snapshot(tables, zeitgeist_reference)
