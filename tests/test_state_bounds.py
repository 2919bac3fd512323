"""A batch costs what its new data and the state it touches cost: it reads only the stored windows it
can change, and table upkeep (compaction, checkpoints) comes in bounded steps, one table at a time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import OUTPUT_TABLES, STATE_TABLES
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_us
from millpond.runtime.job import run_batch
from millpond.runtime.upkeep import COMPACT_OVER_FILES, upkeep_turns

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def minute(m: float) -> datetime:
    return T0 + timedelta(minutes=m)


def land(settings, pipeline: str, arrival: datetime, events: list[tuple[str, str, int, float]]) -> None:
    """(id, key, value, event minute) rows as one landing file arriving at ``arrival``."""
    body = "".join(json.dumps({"id": i, "key": k, "value": v, "event_time": minute(m).isoformat()}) + "\n"
                   for i, k, v, m in events)
    ObjectStore(settings).put_bytes(settings.bucket_landing,
                                    f"{pipeline}/{arrival_tag(to_us(arrival))}-{events[0][0]}.jsonl", body.encode())


def test_batch_reads_only_the_windows_it_can_reach(settings, tables, pipeline_name) -> None:
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "sessions", "gap": "5m"},
                               "accumulation": "accumulating_and_retracting", "allowed_lateness": "1h",
                               "trigger": "AtWatermark()", "source": {"prefix": f"{pipeline_name}/"}})
    # Three sessions of key k (and one of key j) in state, none due while the watermark stays at 12:00.
    land(settings, pipeline_name, minute(44), [("a", "k", 1, 0), ("b", "k", 1, 20), ("c", "k", 1, 40),
                                              ("d", "j", 1, 20)])
    first = run_batch(settings, spec, minute(45), watermark=T0)
    assert first.counts["state_rows_read"] == 0
    # One element of k at 12:41: only the 12:40 session can merge with it.
    land(settings, pipeline_name, minute(49), [("e", "k", 2, 41)])
    second = run_batch(settings, spec, minute(50), watermark=T0)
    assert second.counts["state_rows_read"] == 1
    # A late element of k at 12:04 bridges nothing but reaches the 12:00 session; j's window is due at 12:25.
    land(settings, pipeline_name, minute(54), [("f", "k", 5, 4)])
    third = run_batch(settings, spec, minute(55), watermark=minute(26))
    assert third.counts["state_rows_read"] == 3  # k@12:00 (reached, and due), k@12:20 and j@12:20 (due)
    run_batch(settings, spec, minute(60), watermark=minute(200))  # everything fires and is collected
    current = {(r["key"], r["window_start"].minute, r["window_end"].minute): r["value"]
               for r in tables.read_arrow(pipeline_name, "current").to_pylist()}
    assert current == {("k", 0, 9): 6, ("k", 20, 25): 1, ("k", 40, 46): 3, ("j", 20, 25): 1}
    assert tables.read_arrow(pipeline_name, "windows").num_rows == 0


def test_upkeep_is_spread_over_batches(settings, tables, pipeline_name) -> None:
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "source": {"prefix": f"{pipeline_name}/"},
                               "watermark": {"policy": "processing_time", "lag": "0s"}})
    store = ObjectStore(settings)
    lake_prefix = tables.uri(pipeline_name, "x").split("/", 3)[3].rsplit("/", 1)[0] + "/"

    def checkpoints() -> set[str]:
        return {o.key for o in store.list(settings.bucket_lake, lake_prefix) if o.key.endswith(".checkpoint.parquet")}

    seen: set[str] = set()
    batches, panes = 2 * COMPACT_OVER_FILES + 4, []  # past a whole cycle once the tables are old enough
    for b in range(batches):
        land(settings, pipeline_name, minute(5 * b + 1), [(f"e{b}", "k", 1, 5 * b + 1)])
        done = run_batch(settings, spec, minute(5 * b + 5))
        panes += [done.batch] * done.counts["panes"]
        now = checkpoints()
        assert len(now - seen) <= 1, f"batch {b + 1} wrote checkpoints of several tables: {sorted(now - seen)}"
        seen = now
    assert len({k.rsplit("/", 2)[0] for k in seen}) >= 5  # the tables took turns (young ones wait)
    cycle = len(upkeep_turns(OUTPUT_TABLES, STATE_TABLES))
    for name in ("batches", "ingest_log", "seen_ids", "panes"):  # each gets a file from every batch
        files = tables.open(pipeline_name, name).file_uris()
        assert len(files) <= cycle, f"{name}: {len(files)} files after {batches} batches"
    # Every table written by every batch has a recent checkpoint: opening it replays a bounded log tail.
    for name in ("batches", "ingest_log", "panes", "current", "seen_ids"):
        last = max(int(k.rsplit("/", 1)[1].split(".")[0]) for k in seen if k.rsplit("/", 3)[1] == name)
        assert tables.version(pipeline_name, name) - last <= cycle + 1, (name, last)
    assert tables.read_arrow(pipeline_name, "batches").num_rows == batches
    # Compaction (panes gets a file from every batch) keeps every row.
    assert len(set(panes)) >= batches - 1
    assert sorted(tables.read_arrow(pipeline_name, "panes").column("batch").to_pylist()) == panes


def test_custom_merging_window_reads_every_window_of_a_touched_key(settings, tables, pipeline_name) -> None:
    """A custom WindowFn's reach is unknown: an element may merge with a stored window that starts after it."""
    spec = pipeline_from_dict({"name": pipeline_name, "source": {"prefix": f"{pipeline_name}/"},
                               "window": {"type": "custom", "class": "test_custom_strategies:Bursts", "gap": "1m",
                                          "night_gap": "10m"},
                               "accumulation": "accumulating_and_retracting", "allowed_lateness": "1h",
                               "trigger": "AtWatermark()"})
    land(settings, pipeline_name, minute(4), [("a", "k", 1, 0.5)])  # [12:00:30, 12:01:30)
    run_batch(settings, spec, minute(5), watermark=T0)
    land(settings, pipeline_name, minute(9), [("b", "k", 1, 0)])  # [12:00, 12:01) merges with it
    second = run_batch(settings, spec, minute(10), watermark=T0)
    assert second.counts["state_rows_read"] == 1
    run_batch(settings, spec, minute(15), watermark=minute(200))
    current = [(r["key"], r["window_start"], r["window_end"], r["value"])
               for r in tables.read_arrow(pipeline_name, "current").to_pylist()]
    assert current == [("k", minute(0), minute(1.5), 2)]


def test_current_view_rewrites_only_the_hours_of_live_windows(settings, tables, pipeline_name) -> None:
    """The view is partitioned by the UTC day and hour of window_end: a batch rewrites the hours holding
    windows it can still change, even while a hot key's session has stayed open since the first batch."""
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "sessions", "gap": "5m"},
                               "accumulation": "accumulating_and_retracting", "allowed_lateness": "10m",
                               "trigger": "AtWatermark(early=AtPeriod('5m'))",
                               "source": {"prefix": f"{pipeline_name}/"},
                               "watermark": {"policy": "processing_time", "lag": "0s"}})
    batches = 18  # 12:00 to 15:00: the hot key's session spans it all, cold keys close hour by hour
    for b in range(batches):
        m = 10 * b
        land(settings, pipeline_name, minute(m + 9),
             [(f"h{b}-{i}", "hot", 1, m + 2 * i + 0.5) for i in range(5)] + [(f"c{b}", f"cold{b}", 1, m + 1)])
        run_batch(settings, spec, minute(m + 10))
    last = tables.history(pipeline_name, "current", limit=1)[0]["operationMetrics"]
    view = tables.read_arrow(pipeline_name, "current")
    assert last["num_target_files_skipped_during_scan"] >= 2  # hours 12 and 13 hold only closed windows
    assert last["num_target_rows_copied"] < view.num_rows - 10
    rows = {(r["key"], r["window_start"], r["window_end"]): (r["value"], r["window_end_day"], r["window_end_hour"])
            for r in view.to_pylist()}
    # The hot session's row moved from partition to partition as its end advanced; it is there once.
    assert [k for k in rows if k[0] == "hot"] == [("hot", minute(0.5), minute(10 * batches - 1.5 + 5))]
    assert rows["hot", minute(0.5), minute(10 * batches + 3.5)][0] == 5 * batches
    assert rows["cold0", minute(1), minute(6)] == (1, T0.date(), 12)
    assert len(rows) == batches + 1
