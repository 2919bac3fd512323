"""No input blocks a pipeline, and no landed file vanishes without a trace (issue 24).

Unit tests parse the corpus (``bad_input_corpus``) and exercise the checked sum; the batch tests land each
case beside good rows in a pipeline of its own on the real store: the batch commits, every row and file is
accounted for (input = accepted + duplicates + quarantined; skipped objects counted and named), and the
next batch runs. A batch that fails anyway fails with one line, and ``quarantine-file`` moves past it.
"""

from __future__ import annotations

import gzip
import json
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from bad_input_corpus import BIG, Case, corpus, lines, row
from engines import ENGINES, PLAN, on, same_tables
from millpond.errors import MillpondError
from millpond.lake.landing import file_arrival, not_input, parse_file, parse_file_table
from millpond.lake.objectstore import ObjectStore, StoredObject
from millpond.lake.schemas import BATCHES_SCHEMA, PLAN_SCHEMA
from millpond.model.aggregations import INT64_MAX, Sum
from millpond.model.clock import BatchClock
from millpond.model.spec import pipeline_from_dict
from millpond.model.state import WindowState
from millpond.model.step import SUM_OUT_OF_RANGE, Element, process_key
from millpond.model.timeutil import MIN_TS, US, to_datetime, to_us
from millpond.model.windows import Window
from millpond.runtime.failure import BatchFailed
from millpond.runtime.job import run_batch
from millpond.runtime.layout import KeyLayout
from millpond.runtime.microbatch import MicroBatch

T0 = to_us("2026-03-01T12:00:00Z")
MINUTE = 60 * US
CASES = corpus(T0)


def spec(name: str, aggregation: str = "sum", window: dict | None = None):
    return pipeline_from_dict({"name": name, "window": window or {"type": "fixed", "size": "1m"},
                               "aggregation": aggregation, "value_type": "int", "source": {"prefix": f"{name}/"},
                               "watermark": {"policy": "processing_time", "lag": "1m"}})


# -- parsing (no services) ---------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("case", [c for c in CASES if not c.skipped], ids=lambda c: c.name)
def test_every_row_becomes_an_element_or_a_reason(case: Case) -> None:
    kw = {"value_type": "int", "file_arrival_us": T0, "processing_time": T0 + 10 * MINUTE}
    good, bad = parse_file(case.name, case.body, **kw)
    table, bad_t = parse_file_table(case.name, case.body, **kw)
    assert bad_t == bad and table.to_pylist() == [dict(zip(table.column_names, g[:5], strict=True)) for g in good]
    assert len(good) + len(bad) == case.rows
    assert len(bad) == len(case.quarantined)
    for (_, line, raw, reason), expected in zip(bad, case.quarantined, strict=True):
        assert reason.startswith(expected), (reason, expected)
        assert (line == 0) == case.whole and len(raw) <= 10_000
        raw.encode("utf-8")  # storable: invalid bytes are kept escaped
    pa.table({"key": [g[1] for g in good], "id": [g[0] for g in good]})  # Arrow can hold every element


@pytest.mark.unit
def test_nesting_is_bounded_before_parsing_and_brackets_in_strings_do_not_count() -> None:
    """A line nested deeper than ``MAX_NESTING`` is quarantined without ``json`` recursing into it (a line at the
    interpreter's recursion limit left no stack for finalizers meanwhile); up to the bound, and with any number
    of brackets inside strings, a line is an element."""
    from millpond.lake.rows import MAX_NESTING, parse_line

    def line(extra: str) -> bytes:
        head = '{"id": "n", "key": "k", "value": 1, "event_time": "2026-03-01T11:59:00Z", "x": '
        return (head + extra + "}").encode()

    kw = {"value_type": "int", "file_arrival_us": T0, "processing_time": T0 + MINUTE}
    deepest = "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)  # inside the line's own object
    assert parse_line(line(deepest), **kw)[2] is None
    assert parse_line(line(json.dumps('[{"' * 10_000)), **kw)[2] is None
    too_deep = parse_line(line("[" + deepest + "]"), **kw)
    assert too_deep[0] == () and too_deep[2] == f"malformed JSON: nested more than {MAX_NESTING} levels deep"


@pytest.mark.unit
def test_landing_names_and_arrival_tags() -> None:
    for key in ("p/a.jsonl", "p/a.json", "p/a.ndjson", "p/a.JSONL", "p/a.jsonl.gz", "p/a.Json.GZ",
                "p/a.jsonl.inprogress"):
        assert not_input(key) is None, key
    for key in ("p/a.csv", "p/_SUCCESS", "p/a.gz", "p/a.parquet", "p/dir/"):
        assert not_input(key), key

    def arrival(key: str) -> int:
        return file_arrival(StoredObject("b", key, 1, "e", 1_700_000_000.5))

    assert arrival("p/arrival=20260301T120000Z-x.jsonl") == T0
    assert arrival("p/arrival=20260301T120000000007Z-x.jsonl") == T0 + 7
    for bad_tag in ("arrival=20261301T000000Z", "arrival=20260301T120000", "arrival=2026-03-01T12:00:00Z",
                    "arrival=20260230T120000Z"):
        assert arrival(f"p/{bad_tag}-x.jsonl") == 1_700_000_000_500_000, bad_tag


# -- the checked sum (no services) -------------------------------------------------------------------
@pytest.mark.unit
def test_checked_sum_skips_exactly_the_values_that_would_overflow() -> None:
    s = Sum()
    assert s.add_checked(0, [1, 2, 3]) == (6, [])
    assert s.add_checked(0, [BIG, BIG, -5, BIG]) == (BIG - 5, [1, 3])
    assert s.add_checked(INT64_MAX, [1, -1, 1]) == (INT64_MAX, [0])  # a running sum, in order
    assert s.add_checked(0, [-(2**63), -1, 7]) == (-(2**63) + 7, [1])
    assert s.add_checked(0, [1e308, 1e308, -1e308]) == (0.0, [1])
    assert s.add_checked(0, [2**62] * 3) == (2**62, [1, 2])
    assert s.merge_checked([BIG, BIG]) is None and s.merge_checked([BIG, -BIG]) == 0
    many = list(range(-1000, 1000))
    assert s.add_checked(5, many) == (5 + sum(many), [])


def _run_key(elements: list[Element], stored: list[WindowState], columnar: bool):
    strategy = spec("k").strategy()
    clock = BatchClock(batch=1, processing_time=T0 + 10 * MINUTE, input_watermark=MIN_TS, watermark=T0 + 2 * MINUTE)
    if not columnar:
        return process_key("k", stored, elements, clock, strategy)
    events = pa.table({"id": [e.id for e in elements], "key": [e.key for e in elements],
                       "value": pa.array([e.value for e in elements], pa.int64()),
                       "event_time": [e.event_time for e in elements],
                       "arrival_time": [e.arrival_time for e in elements]})
    no_state = pa.table({"key": pa.array([], pa.string()), "window_start": pa.array([], pa.int64()),
                         "window_end": pa.array([], pa.int64()), "state": pa.array([], pa.string())})
    layout = KeyLayout.of(events, no_state)
    (key_input,) = layout.rows(0, 1, strategy, clock, columnar=True)
    assert key_input.groups is None  # a key whose sums might overflow takes the element path
    return process_key("k", stored, key_input.elements, clock, strategy, key_input.groups)


@pytest.mark.unit
@pytest.mark.parametrize("columnar", [False, True])
def test_the_per_key_step_drops_the_element_that_would_overflow(columnar: bool) -> None:
    els = [Element(f"e{i}", "k", v, T0 + i, T0 + MINUTE) for i, v in enumerate([BIG, BIG, -5, 3])]
    res = _run_key(els, [], columnar)
    assert [(el.id, why) for el, why in res.late] == [("e1", SUM_OUT_OF_RANGE)]
    assert [p.value for p in res.panes] == [BIG - 2]


@pytest.mark.unit
def test_sessions_whose_sums_would_overflow_stay_apart() -> None:
    strategy = spec("k", window={"type": "sessions", "gap": "1m"}).strategy()
    clock = BatchClock(batch=2, processing_time=T0 + 10 * MINUTE, input_watermark=T0 - MINUTE, watermark=T0 - MINUTE)
    a = WindowState(Window(T0, T0 + MINUTE), BIG, unfired=1)
    b = WindowState(Window(T0 + 2 * MINUTE - 10, T0 + 3 * MINUTE - 10), BIG, unfired=1)
    bridge = Element("x", "k", 1, T0 + MINUTE - 5, T0 + 5 * MINUTE)  # its session [e, e + 1m) meets both
    res = process_key("k", [a, b], [bridge], clock, strategy)
    assert [(el.id, why) for el, why in res.late] == [("x", SUM_OUT_OF_RANGE)]
    assert not res.deletes and not res.upserts  # both sessions unchanged


# -- batches on the real store -----------------------------------------------------------------------
def _next_minutes(n: int) -> int:
    """A processing time ``n`` minutes after the wall clock's current minute: after the last-modified time
    of the objects landed now (their arrival when their key has no usable tag)."""
    return (int(time.time()) // 60 + n) * MINUTE


def _marker(tables, name: str, batch: int) -> dict:
    done = tables.read_arrow(name, "batches", schema=BATCHES_SCHEMA)
    return done.filter(pc.field("batch") == batch).to_pylist()[0]


def _balanced(m: dict) -> bool:
    return m["input"] == m["accepted"] + m["duplicates"] + m["quarantined"]


def _good_file(settings, name: str, arrival: int, event_time: int, tag: str) -> None:
    body = lines(*(row(f"{tag}", i, event_time) for i in range(2)))
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{name}/{tag}-{arrival}.jsonl", body)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_bad_input_commits_is_accounted_for_and_the_next_batch_runs(case: Case, settings, tables,
                                                                          pipeline_name) -> None:
    from millpond.surface.inputs import history

    name, store = pipeline_name, ObjectStore(settings)
    key = case.key(f"{name}/", T0 + MINUTE)
    store.put_bytes(settings.bucket_landing, key, case.body)
    store.put_bytes(settings.bucket_landing, f"{name}/companion.jsonl",
                    lines(*(row("companion", i, T0) for i in range(2))))
    p1 = _next_minutes(2)
    first = run_batch(settings, spec(name), to_datetime(p1))
    m = _marker(tables, name, 1)
    assert _balanced(m) and m["input"] == case.rows + 2, first.summary()
    assert m["quarantined"] == len(case.quarantined)
    assert m["duplicates"] == case.notes.get("duplicates", 0)
    assert m["skipped"] == (1 if case.skipped else 0)
    q = tables.read_arrow(name, "quarantine").filter(pc.field("source_file") == key).sort_by("line").to_pylist() \
        if case.quarantined else []
    assert [r["reason"][:len(e)] for r, e in zip(q, case.quarantined, strict=True)] == list(case.quarantined)
    assert all((r["line"] == 0) == case.whole for r in q)
    late = tables.read_arrow(name, "late").to_pylist() if case.dropped else []
    assert [r["reason"] for r in late] == list(case.dropped) and m["late"] == len(case.dropped)
    _, files = history(settings, name)
    listed = {r["file"]: (r["fate"], r["reason"]) for r in files.to_pylist()}
    if case.skipped:
        assert listed[key][0] == "skipped" and listed[key][1].startswith(case.skipped)
    elif case.whole:
        assert listed[key][0] == "quarantined"
    else:
        assert key not in listed
    # the next batch runs, takes only its own file, and reports nothing twice
    _good_file(settings, name, p1 + 10 * US, p1 - 30 * US, "next")
    second = run_batch(settings, spec(name), to_datetime(p1 + MINUTE))
    m2 = _marker(tables, name, 2)
    assert (m2["input"], m2["accepted"], m2["quarantined"], m2["skipped"]) == (2, 2, 0, 0), second.summary()


def test_a_file_that_keeps_failing_is_held_by_name_and_the_pipeline_moves_on(settings, tables, pipeline_name) -> None:
    from millpond.surface.inputs import history, hold_file

    name, store = pipeline_name, ObjectStore(settings)
    bad_spec = spec(name, aggregation="bad_input_corpus:Explosive")
    store.put_bytes(settings.bucket_landing, f"{name}/good.jsonl", lines(row("g", 0, T0), row("g", 1, T0)))
    poison = f"{name}/poison.jsonl"
    store.put_bytes(settings.bucket_landing, poison, lines(row("p", 0, T0), row("p", 1, T0, value=666)))
    p1 = to_datetime(_next_minutes(2))
    for _attempt in range(2):  # the plan is committed: every rerun fails the same way, in one line
        with pytest.raises(BatchFailed) as failed:
            run_batch(settings, bad_spec, p1)
        text = str(failed.value)
        assert "\n" not in text and f"{name} batch 1 " in text and "key 'p'" in text
        assert "ZeroDivisionError: the combiner's own bug" in text and f"millpond quarantine-file {name}" in text
    with pytest.raises(MillpondError, match="no landing file"):
        hold_file(settings, name, f"{name}/", "nonesuch.jsonl", "typo")
    said = hold_file(settings, name, f"{name}/", "poison.jsonl", "the combiner fails on it")
    assert said.startswith(f"{name}: batch 1 will quarantine {poison} whole")
    result = run_batch(settings, bad_spec, p1)
    m = _marker(tables, name, 1)
    assert _balanced(m) and (m["accepted"], m["quarantined"], m["files"]) == (2, 1, 1), result.summary()
    q = tables.read_arrow(name, "quarantine").to_pylist()
    assert [(r["source_file"], r["line"], r["reason"]) for r in q] == [
        (poison, 0, "quarantined by an operator: the combiner fails on it")]
    with pytest.raises(MillpondError, match="already taken by a committed batch"):
        hold_file(settings, name, f"{name}/", "poison.jsonl", "again")
    # a file held before any batch planned it is never read: the next batch's plan records the hold
    store.put_bytes(settings.bucket_landing, f"{name}/poison2.jsonl", lines(row("p", 5, T0, value=666)))
    hold_file(settings, name, f"{name}/", f"{name}/poison2.jsonl", "")
    _good_file(settings, name, 0, _next_minutes(2) - 30 * US, "next")
    run_batch(settings, bad_spec, to_datetime(_next_minutes(3)))
    m2 = _marker(tables, name, 2)
    assert _balanced(m2) and (m2["accepted"], m2["quarantined"]) == (2, 1)
    log = tables.read_arrow(name, "ingest_log", schema=PLAN_SCHEMA).filter(pc.field("batch") == 2)
    assert any(json.loads(r["held"] or "{}") == {f"{name}/poison2.jsonl": ""} and r["versions"]
               for r in log.to_pylist())
    _, files = history(settings, name)
    assert [(r["batch"], r["file"], r["fate"]) for r in files.to_pylist()] == [
        (1, poison, "held"), (2, f"{name}/poison2.jsonl", "held")]


def test_a_file_deleted_after_it_was_planned_is_quarantined_whole(settings, tables, pipeline_name) -> None:
    name, store = pipeline_name, ObjectStore(settings)
    store.put_bytes(settings.bucket_landing, f"{name}/good.jsonl", lines(row("g", 0, T0)))
    gone = f"{name}/gone.jsonl"
    store.put_bytes(settings.bucket_landing, gone, lines(row("x", 0, T0)))
    job = MicroBatch(settings, spec(name))
    read = job.store.get_bytes

    def vanishing(bucket: str, key: str) -> bytes:
        if key == gone:
            store.mc.remove_object(bucket, key)
        return read(bucket, key)

    job.store.get_bytes = vanishing
    job.run(to_datetime(_next_minutes(2)))
    m = _marker(tables, name, 1)
    assert _balanced(m) and (m["accepted"], m["quarantined"]) == (1, 1)
    (q,) = tables.read_arrow(name, "quarantine").to_pylist()
    assert (q["source_file"], q["line"]) == (gone, 0) and "deleted" in q["reason"]


def test_tables_written_before_the_new_columns_take_them(settings, tables, pipeline_name) -> None:
    """A pipeline whose ``batches`` and ``ingest_log`` were written by a version without ``skipped`` and
    ``held``: its next batches add the columns; the older rows read them as null."""
    from millpond.surface.inputs import history

    name = pipeline_name
    old_plan = pa.schema([f for f in PLAN_SCHEMA if f.name not in ("skipped", "held")])
    old_marker = pa.schema([f for f in BATCHES_SCHEMA if f.name != "skipped"])
    p0 = _next_minutes(-5)
    tables.append(name, "ingest_log", pa.Table.from_pylist([{
        "batch": 1, "processing_time": to_datetime(p0), "files": [], "file_arrivals": [],
        "versions": json.dumps({"windows": None, "seen_ids": None})}], schema=old_plan))
    tables.append(name, "batches", pa.Table.from_pylist([{
        "batch": 1, "processing_time": to_datetime(p0), "watermark": to_datetime(p0 - MINUTE), "files": 0, "input": 0,
        "accepted": 0, "duplicates": 0, "late": 0, "quarantined": 0, "panes": 0, "retractions": 0,
        "state_rows_read": 0, "phases": "{}", "versions": "{}"}], schema=old_marker))
    store = ObjectStore(settings)
    store.put_bytes(settings.bucket_landing, f"{name}/notes.txt", b"hello")
    _good_file(settings, name, 0, p0 + 10 * US, "a")
    run_batch(settings, spec(name), to_datetime(_next_minutes(2)))
    _good_file(settings, name, 1, _next_minutes(2), "b")
    run_batch(settings, spec(name), to_datetime(_next_minutes(3)))
    done = tables.read_arrow(name, "batches").sort_by("batch")
    assert done.column("skipped").to_pylist() == [None, 1, 0]
    assert done.column("accepted").to_pylist() == [0, 2, 2]
    batches, files = history(settings, name)
    assert batches.column("skipped").to_pylist() == [None, 1, 0]
    assert [(r["batch"], r["fate"]) for r in files.to_pylist()] == [(2, "skipped")]


def test_the_command_line_lists_skipped_files_and_holds_one(settings, pipeline_name, tmp_path, capsys) -> None:
    import yaml
    from millpond.surface.cli import main

    name, store = pipeline_name, ObjectStore(settings)
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump({"name": name, "window": {"type": "fixed", "size": "1m"}, "aggregation": "sum",
                                    "value_type": "int", "source": {"prefix": f"{name}/"}}))
    store.put_bytes(settings.bucket_landing, f"{name}/export.csv", b"a,b\n")
    store.put_bytes(settings.bucket_landing, f"{name}/ok.jsonl.gz", gzip.compress(lines(row("g", 0, T0))))
    assert main(["batch", str(conf), "--at", to_datetime(_next_minutes(2)).isoformat()]) == 0
    assert "skipped 1" in capsys.readouterr().out
    assert main(["history", name]) == 0
    out = capsys.readouterr().out
    assert f"{name}/export.csv" in out and "skipped" in out and "not a landing file" in out
    store.put_bytes(settings.bucket_landing, f"{name}/later.jsonl", lines(row("g", 1, T0)))
    assert main(["quarantine-file", str(conf), "later.jsonl", "--reason", "known bad"]) == 0
    assert f"batch 2 will quarantine {name}/later.jsonl whole (known bad)" in capsys.readouterr().out
    assert main(["quarantine-file", str(conf), "ok.jsonl.gz"]) == 1
    assert "already taken by a committed batch" in capsys.readouterr().err


@pytest.fixture(scope="module")
def corpus_landed(settings) -> tuple[dict[str, str], int]:
    """Every case and a held file, landed for a pipeline per engine at once (an object whose name has no
    arrival tag arrives at its last-modified time), and the processing time of their batch."""
    import uuid

    from millpond.surface.inputs import hold_file

    base, store = f"t_{uuid.uuid4().hex[:10]}", ObjectStore(settings)
    names = {engine: f"{base}_{engine}" for engine in ENGINES}

    def modified(key: str) -> float:
        (found,) = [o for o in store.list(settings.bucket_landing, key) if o.key == key]
        return found.last_modified

    for case in CASES:
        keys = [case.key(f"{name}/", T0 + MINUTE) for name in names.values()]
        for _attempt in range(5):  # the same arrival for both when it is the objects' last-modified time
            for key in keys:
                store.put_bytes(settings.bucket_landing, key, case.body)
            if not case.notes.get("last_modified") or len({modified(key) for key in keys}) == 1:
                break
        else:
            pytest.fail(f"{case.name}: the objects' last-modified times kept differing")
    for name in names.values():
        store.put_bytes(settings.bucket_landing, f"{name}/held.jsonl", lines(row("held", 0, T0)))
        hold_file(settings, name, f"{name}/", "held.jsonl", "by hand")
    return names, _next_minutes(2)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_whole_corpus_gives_the_same_tables_on_both_engines(settings, tables, corpus_landed, engine,
                                                                request) -> None:
    """Every case in one batch, on the local engine and as a Spark job (the multi-stage plan: each file read in a
    task of its own): the same counts, and the same tables, quarantined rows, dropped elements, panes, state and
    ids alike (``engines.same_tables``; parsing, the checked sum and the holds are shared code on both)."""
    names, p1 = corpus_landed
    for run in ("local", engine):  # the local engine's batch first (once: a committed batch is skipped)
        spark = request.getfixturevalue("spark") if run == "spark" else None
        run_batch(on(settings, run, PLAN), spec(names[run]), to_datetime(p1), spark=spark)
    name = names[engine]
    m = _marker(tables, name, 1)
    assert _balanced(m)
    counts = {k: m[k] for k in ("input", "accepted", "duplicates", "quarantined", "late", "skipped")}
    assert counts["input"] == sum(c.rows for c in CASES) + 1
    assert counts["quarantined"] == sum(len(c.quarantined) for c in CASES) + 1
    assert counts["skipped"] == sum(1 for c in CASES if c.skipped)
    dropped = tables.read_arrow(name, "late").to_pylist()
    assert [r["reason"] for r in dropped] == [SUM_OUT_OF_RANGE] * sum(len(c.dropped) for c in CASES)
    quarantined = tables.read_arrow(name, "quarantine").to_pylist()
    assert len(quarantined) == counts["quarantined"] and any(r["line"] == 0 for r in quarantined)
    if engine != "local":  # (apart from engines.DIVERGING_VERSIONS: the test below)
        same_tables(tables, names["local"], name)


def test_a_batch_closing_every_window_it_opened_names_one_windows_version_on_both_engines(settings, tables,
                                                                                      corpus_landed, request) -> None:
    """The corpus's batch (fixed one-minute windows, all behind its watermark) opens windows and closes them all:
    its marker names the same table versions on both engines. (Found by this battery: the local engine's MERGE
    created an empty ``windows`` table, the Spark engine committed nothing and named no version;
    ``lake.file_commits.commit_files`` now creates the table empty too.)"""
    names, p1 = corpus_landed
    for run in ENGINES:  # run by the test above, or here (a committed batch is skipped)
        spark = request.getfixturevalue("spark") if run == "spark" else None
        run_batch(on(settings, run, PLAN), spec(names[run]), to_datetime(p1), spark=spark)
    versions = {run: json.loads(_marker(tables, names[run], 1)["versions"]) for run in ENGINES}
    assert versions["local"]["windows"] == versions["spark"]["windows"], versions
