"""Reprocess a past range (issue 22): the rewind restores every table to the versions named by the last
marker at or before FROM, as new Delta commits, and the batches from FROM on run again to where the pipeline
was; the result equals a fresh run over the same landing files and schedule — with files landed late into
the past range, and with a spec change between the first run and the reprocess."""

from __future__ import annotations

import json
import random

import pytest
from millpond.errors import MillpondError, PipelineChanged
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, to_datetime, to_us
from millpond.runtime import catchup, rewind
from millpond.runtime.job import run_batch
from millpond.surface.inputs import history, operations

T0 = to_us("2026-03-02T00:00:00Z")
MINUTE = 60 * US
COMPARED = ("panes", "current", "windows", "late", "quarantine", "seen_ids")


def spec(name: str, gap: str = "2m"):
    return pipeline_from_dict({
        "name": name, "source": {"prefix": f"{name}/"}, "value_type": "int", "aggregation": "sum",
        "window": {"type": "sessions", "gap": gap}, "accumulation": "accumulating_and_retracting",
        "trigger": "AtWatermark(early=AtCount(2), late=AtCount(1))", "allowed_lateness": "10m",
        "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "1m"}})


def events(seed: int, first: int, last: int) -> list[tuple[int, list[dict]]]:
    """(arrival, rows) per file: arrivals within batch intervals [first, last), events a little earlier."""
    rnd = random.Random(seed)
    out = []
    for minute in range(first, last):
        arrival = T0 + minute * MINUTE + rnd.randrange(1, 50) * US
        rows = [{"id": f"s{seed}-{minute}-{i}", "key": f"u{rnd.randrange(4)}", "value": rnd.randrange(1, 9),
                 "event_time": to_datetime(arrival - rnd.randrange(0, 150) * US).isoformat()} for i in range(6)]
        out.append((arrival, rows))
    return out


def land(settings, name: str, files: list[tuple[int, list[dict]]], tag: str) -> None:
    store = ObjectStore(settings)
    for arrival, rows in files:
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(arrival)}-{tag}.jsonl", body)


def run(settings, s, minutes: range) -> None:
    for m in minutes:
        run_batch(settings, s, to_datetime(T0 + m * MINUTE))


def reprocess(settings, tables, s, start_minute: int, end_minute: int) -> rewind.Rewind:
    """What ``millpond backfill --reprocess`` does: rewind, then the batches from FROM to where it was."""
    r = rewind.run(settings, tables, s, T0 + start_minute * MINUTE, by="test")
    last = max(end_minute, (r.last_time - T0) // MINUTE)
    if not r.noop:  # live runs wait for the reprocess (its own batches, backfill runs, do not ask)
        assert "reprocess of" in catchup.catching_up(tables, s.name)
    run(settings, s, range(start_minute + 1, last + 1))
    assert catchup.catching_up(tables, s.name) == ""  # caught up: live runs go on
    return r


def content(tables, name: str) -> dict[str, list]:
    out = {}
    for t in COMPARED:
        rows = tables.read_arrow(name, t).to_pylist() if tables.exists(name, t) else []
        for r in rows:
            if "source_file" in r:
                r["source_file"] = r["source_file"].split("/", 1)[1]
        out[t] = sorted(json.dumps(r, sort_keys=True, default=str) for r in rows)
    done = tables.read_arrow(name, "batches").sort_by("batch").select(
        ["batch", "processing_time", "watermark", "input", "accepted", "duplicates", "late", "quarantined", "panes",
         "retractions"])
    out["batches"] = done.to_pylist()
    return out


def assert_like_a_fresh_run(settings, tables, name: str, files, fresh_spec, minutes: range) -> None:
    """The reprocessed pipeline's tables equal those of a fresh pipeline over the same files and schedule."""
    land(settings, fresh_spec.name, files, "a")
    run(settings, fresh_spec, minutes)
    assert content(tables, name) == content(tables, fresh_spec.name)


def test_late_files_into_a_past_range_are_reprocessed_like_a_fresh_run(settings, tables, pipeline_name) -> None:
    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    on_time, late = events(1, 0, 8), events(2, 2, 4)  # late: landed after the run, arrivals in batches 3-4
    land(settings, name, on_time, "a")
    run(settings, spec(name), range(1, 9))
    old_panes_version = tables.version(name, "panes")
    old_panes = tables.read_arrow(name, "panes", version=old_panes_version)
    land(settings, name, late, "b")
    r = reprocess(settings, tables, spec(name), 2, 5)  # TO before the last batch: it goes on to batch 8
    assert (r.to_batch, r.last_batch) == (2, 8) and not r.noop
    for files, tag in ((on_time, "a"), (late, "b")):
        land(settings, fresh, files, tag)
    run(settings, spec(fresh), range(1, 9))
    assert content(tables, name) == content(tables, fresh)
    assert sum(b["input"] for b in content(tables, name)["batches"]) == 6 * (8 + 2)
    # history and time travel keep the old results; the reprocess is one visible operation
    assert tables.read_arrow(name, "panes", version=old_panes_version).equals(old_panes)
    assert any(h.get("operation") == "RESTORE" for h in tables.history(name, "panes"))
    ops = tables.read_arrow(name, "operations").to_pylist()
    assert [(o["operation"], json.loads(o["detail"])["to_batch"]) for o in ops] == [("reprocess", 2)]
    batches, _ = history(settings, name)
    assert batches.column("batch").to_pylist() == list(range(1, 9))
    (op,) = operations(settings, name).to_pylist()
    assert (op["rewound_to_batch"], op["was_at_batch"], op["by"]) == (2, 8, "test")
    # a second reprocess works the same way (a new epoch of application transactions)
    r2 = reprocess(settings, tables, spec(name), 5, 5)
    assert (r2.to_batch, r2.last_batch) == (5, 8)
    assert content(tables, name) == content(tables, fresh)


def test_live_runs_wait_while_a_backfill_catches_up(settings, tables, pipeline_name) -> None:
    name = pipeline_name
    land(settings, name, events(5, 0, 4), "a")
    run(settings, spec(name), range(1, 2))
    catchup.hold_live_runs(settings, tables, name, T0 + 3 * MINUTE, 2, by="test")
    assert "backfill of" in catchup.catching_up(tables, name)
    run(settings, spec(name), range(2, 4))  # the backfill's batches reach its end: live runs go on
    assert catchup.catching_up(tables, name) == ""
    catchup.hold_live_runs(settings, tables, name, T0 + 9 * MINUTE, 6, by="test")
    assert catchup.catching_up(tables, name)
    catchup.release_live_runs(tables, name, by="test")  # a backfill that ended short of its end
    assert catchup.catching_up(tables, name) == ""
    assert [o["operation"] for o in operations(settings, name).to_pylist()] == ["backfill", "backfill",
                                                                               "backfill ended"]


def test_a_spec_change_is_reprocessed_from_the_start(settings, tables, pipeline_name) -> None:
    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    files = events(3, 0, 5)
    land(settings, name, files, "a")
    run(settings, spec(name), range(1, 6))
    with pytest.raises(PipelineChanged, match="reprocess from the start"):
        rewind.run(settings, tables, spec(name, gap="5m"), T0 + 2 * MINUTE, by="test")
    assert tables.read_arrow(name, "batches").num_rows == 5  # refused before anything was rewound
    run(settings, spec(name), range(6, 7))  # and the lease is free: the pipeline goes on
    reprocess(settings, tables, spec(name, gap="5m"), -1, 6)
    assert_like_a_fresh_run(settings, tables, name, files, spec(fresh, gap="5m"), range(0, 7))


def test_a_rewind_cut_off_half_way_is_redone_whole(settings, tables, pipeline_name) -> None:
    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    files = events(4, 0, 5)
    land(settings, name, files, "a")
    run(settings, spec(name), range(1, 6))
    r = rewind.plan(tables, spec(name), T0 + 2 * MINUTE)
    txn = rewind.Txn(app_id=rewind.rewind_app(name), version=1)
    tables.table(name, "panes").restore(r.targets["panes"], txn=txn)  # the first table only, then cut off
    reprocess(settings, tables, spec(name), 2, 5)
    assert_like_a_fresh_run(settings, tables, name, files, spec(fresh), range(1, 6))


def test_a_table_unchanged_since_the_rewind_point_is_left_as_it_is(settings, tables, pipeline_name) -> None:
    """Issue 37 (1): one bad line in batch 1, so ``quarantine`` exists and never changes again; a rewind to
    batch 3 restored every table, and delta-rs refuses to restore a table to its latest version: the rewind
    stopped half-way, holding the lease. Now such a table is left as it is, and the result equals a fresh run."""
    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    files = events(6, 0, 6)
    land(settings, name, files, "a")
    bad = [(T0 + 30 * US, [{"id": "bad-1", "key": "u1", "value": "not a number", "event_time": "nope"}])]
    land(settings, name, bad, "bad")
    run(settings, spec(name), range(1, 7))
    quarantined = tables.read_arrow(name, "quarantine")
    assert quarantined.num_rows == 1
    r = reprocess(settings, tables, spec(name), 3, 6)
    assert (r.to_batch, r.last_batch) == (3, 6)
    # nothing to undo: no RESTORE, the rows as they were; only the rewind's transaction (its fence) committed
    assert tables.read_arrow(name, "quarantine").equals(quarantined)
    assert [h["operation"] for h in tables.history(name, "quarantine")].count("RESTORE") == 0
    assert tables.txn_version(name, "quarantine", rewind.rewind_app(name)) == 1
    land(settings, fresh, bad, "bad")
    assert_like_a_fresh_run(settings, tables, name, files, spec(fresh), range(1, 7))
    # and a second reprocess over the same range works too
    reprocess(settings, tables, spec(name), 2, 6)
    assert content(tables, name) == content(tables, fresh)


def test_a_retry_at_another_processing_time_redoes_the_planned_batch(settings, tables, pipeline_name,
                                                                      monkeypatch) -> None:
    """Issue 37 (3): batch 3 fails after its ``current`` commit; its retry runs at another processing time (the
    next scheduled run, a manual trigger, ``millpond batch --at``). The plan pinned the files and versions but
    not the clock, so the retry recomputed the watermark and the triggers at the new time while the tables the
    first attempt committed were skipped: ``current`` named panes that ``panes`` never held. Now the plan pins
    the processing time (and an explicit watermark): the retry redoes the batch as planned, says so, and the
    tables equal a run that never failed."""
    from millpond.runtime import commits

    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    files = events(8, 0, 5)
    land(settings, name, files, "a")
    run(settings, spec(name), range(1, 3))

    def crash(step: str, batch: int) -> None:
        if step == "current":
            raise MillpondError("injected failure")

    monkeypatch.setattr(commits, "crash_point", crash)
    with pytest.raises(MillpondError, match="injected failure"):
        run_batch(settings, spec(name), to_datetime(T0 + 3 * MINUTE))
    monkeypatch.undo()
    retried = run_batch(settings, spec(name), to_datetime(T0 + 3 * MINUTE + 40 * US))
    assert retried.batch == 3 and to_us(retried.processing_time) == T0 + 3 * MINUTE
    assert "re-run of the plan made at" in retried.summary()
    run(settings, spec(name), range(4, 6))
    current = {(r["key"], r["window_start"], r["pane_index"]) for r in tables.read_arrow(name, "current").to_pylist()}
    panes = {(r["key"], r["window_start"], r["pane_index"]) for r in tables.read_arrow(name, "panes").to_pylist()
             if r["kind"] == "value"}
    assert current <= panes
    assert_like_a_fresh_run(settings, tables, name, files, spec(fresh), range(1, 6))


def test_a_run_of_a_reprocess_done_again_after_later_runs_rewinds_nothing(settings, tables, pipeline_name) -> None:
    """A reprocess rewinds once. Each of its runs rewinds first if it finds later batches (the DAG task's
    preamble); a run done again after later runs of the same reprocess committed (Airflow retrying a run it
    marked failed after its batch committed, a run cleared in the UI) used to rewind their batches away, and
    their files waited for the next live run. Now the runs carry the reprocess's name and find its rewind
    recorded: the run again rewinds nothing and skips its committed batch; a new reprocess still rewinds."""
    name, fresh = pipeline_name, f"{pipeline_name}_fresh"
    files = events(11, 0, 6)
    land(settings, name, files, "a")
    run(settings, spec(name), range(1, 7))

    def dag_run(minute: int, rid: str):
        """What a reprocess's DAG run does: rewind (once per reprocess), then its batch."""
        rewind.run(settings, tables, spec(name), T0 + (minute - 1) * MINUTE, by=f"run {minute}", reprocess=rid)
        return run_batch(settings, spec(name), to_datetime(T0 + minute * MINUTE))

    r = rewind.run(settings, tables, spec(name), T0 + 2 * MINUTE, by="backfill", reprocess="first")
    assert (r.to_batch, r.last_batch) == (2, 6)
    for minute in range(3, 7):
        assert not dag_run(minute, "first").skipped
    again = dag_run(4, "first")  # after batches 5 and 6 of the same reprocess committed
    assert again.skipped and again.reason == "already committed", again.summary()
    assert [b["batch"] for b in tables.read_arrow(name, "batches").sort_by("batch").to_pylist()] == [1, 2, 3, 4, 5, 6]
    assert_like_a_fresh_run(settings, tables, name, files, spec(fresh), range(1, 7))
    rows = [o for o in tables.read_arrow(name, "operations").to_pylist() if o["operation"] == "reprocess"]
    assert [json.loads(o["detail"])["id"] for o in rows] == ["first"]
    # another reprocess is another rewind; its own runs then rewind nothing, in any order
    assert not rewind.run(settings, tables, spec(name), T0 + 4 * MINUTE, by="backfill", reprocess="second").noop
    for minute in (6, 5, 6):
        dag_run(minute, "second")
    assert [b["processing_time"] for b in tables.read_arrow(name, "batches").sort_by("batch").to_pylist()][-1] == \
        to_datetime(T0 + 6 * MINUTE)
