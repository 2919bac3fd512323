"""A time to live for output rows (issue 38, storage bounded): a pipeline that says ``expire: 2h`` has the rows of
windows that ended that long before its watermark deleted from ``panes``, ``current`` and ``late`` once an upkeep
cycle, after a batch's marker. What a data engineer expects of a table's TTL: nothing younger goes, the tables
are what they would be without it less the expired rows, whatever the engine; a stage that keeps up sees the
same input; one that lagged past it is refused in one line, before it writes."""

from __future__ import annotations

import json
import random
import time

import pyarrow as pa
import pytest
from millpond.errors import MillpondError
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, to_datetime, to_us
from millpond.runtime.job import run_batch
from millpond.runtime.upkeep import EXPIRING, expiry_horizon

T0 = to_us("2026-04-01T00:00:00Z")
MINUTE = 60 * US
#: batches a scenario runs: with ``expire: 4m`` (a step of 30 s) and a watermark a minute further each batch, the
#: batches from the sixth on delete rows
N = 9
#: the stages' scenario: by then the upstream's expiries removed files of panes of its second batch and later
M = 12


def doc(name: str, **changed) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "value_type": "int", "aggregation": "sum",
            "window": {"type": "sessions", "gap": "2m"}, "accumulation": "accumulating_and_retracting",
            "trigger": "AtWatermark(early=AtCount(2), late=AtCount(1))", "allowed_lateness": "3m",
            "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "1m"}, **changed}


def land(settings, prefix: str, minutes: range, seed: int = 7) -> None:
    """One file a minute: a few keys, some events late (behind the watermark), some too late (dropped as late)."""
    rnd = random.Random(seed)
    store = ObjectStore(settings)
    for minute in minutes:
        arrival = T0 + minute * MINUTE + rnd.randrange(1, 50) * US
        rows = [{"id": f"e{minute}-{i}", "key": f"u{rnd.randrange(5)}", "value": rnd.randrange(1, 9),
                 "event_time": to_datetime(arrival - rnd.choice((0, 20, 90, 400)) * US).isoformat()} for i in range(6)]
        store.put_bytes(settings.bucket_landing, f"{prefix}{arrival_tag(arrival)}.jsonl",
                        "".join(json.dumps(r) + "\n" for r in rows).encode())


def rows(tables, name: str, table: str) -> list[dict]:
    return tables.read_arrow(name, table, schema=pa.schema([])).to_pylist()


def canonical(found: list[dict]) -> list[str]:
    return sorted(repr(sorted(r.items())) for r in found)


@pytest.mark.parametrize("value, message", [
    ("soon", "expected a duration longer than zero"), (0, "expected a duration longer than zero"),
    (True, "expected a duration longer than zero"), ("3m", "must be longer than allowed_lateness 3m"),
])
def test_expire_is_a_strict_pipeline_key(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipeline_from_dict(doc("p", expire=value))
    with pytest.raises(ValueError, match="the global window never ends"):
        pipeline_from_dict({**doc("p", expire="1d"), "window": {"type": "global"}})
    with pytest.raises(ValueError, match="did you mean 'expire'"):
        pipeline_from_dict(doc("p", expires="1d"))
    assert pipeline_from_dict(doc("p", expire="2h")).expire == 120 * MINUTE
    assert pipeline_from_dict(doc("p")).expire is None


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_expired_rows_go_and_nothing_else_changes(settings, tables, pipeline_name, spark, engine: str) -> None:
    """Two pipelines on the same landing files, one with ``expire: 4m``: each output table of the expiring one
    holds every row of the other's at or past its last expiry's horizon (and those written after it; ``panes``
    keeps its batch's), nothing the other does not, and only rows below the horizon went; a file is removed
    whole once its last row expired, so an expiry at the end removes nothing more; ``windows`` (state) is
    untouched. On the Spark engine every batch after the first expiry rewrites the current view's partitions an
    expiry already cut."""
    keep, expiring = f"{pipeline_name}_keep", f"{pipeline_name}_ttl"
    land(settings, f"{pipeline_name}/", range(N + 1))
    specs = {keep: pipeline_from_dict(doc(keep, source={"prefix": f"{pipeline_name}/"})),
             expiring: pipeline_from_dict(doc(expiring, source={"prefix": f"{pipeline_name}/"}, expire="4m"))}
    chosen = settings if engine == "local" else settings.with_overrides(engine="spark", engine_local_below=0)
    for minute in range(1, N + 1):
        at = to_datetime(T0 + minute * MINUTE + 55 * US)
        run_batch(settings, specs[keep], at)
        result = run_batch(chosen, specs[expiring], at, spark=spark if engine == "spark" else None)
        assert engine == "local" or result.engine.startswith("spark")
    gone = 0
    watermark = to_us(max(rows(tables, expiring, "batches"), key=lambda r: r["batch"])["watermark"])
    for table, column in EXPIRING.items():
        full, cut = canonical(rows(tables, keep, table)), canonical(rows(tables, expiring, table))
        assert set(cut) <= set(full), table
        notes = tables.table(expiring, table).expiries(None, tables.version(expiring, table))
        last = notes[-1] if notes else {"horizon": -(2**62), "batch": 0}
        after = last["batch"] if table == "panes" else last["batch"] + 1
        kept = [r for r in rows(tables, keep, table) if to_us(r[column]) >= last["horizon"] or r["batch"] >= after]
        assert set(canonical(kept)) <= set(cut), table
        removed = set(full) - set(cut)
        assert all(to_us(r[column]) < last["horizon"] for r in rows(tables, keep, table)
                   if canonical([r])[0] in removed), table
        assert tables.table(expiring, table).expire(
            column, expiry_horizon(specs[expiring].expire, watermark), {"batch": N},
            batch_below=N if table == "panes" else None)["files"] == 0, table
        gone += len(removed)
    assert gone > 0 and len(rows(tables, expiring, "panes")) < len(rows(tables, keep, "panes"))
    assert canonical(rows(tables, expiring, "windows")) == canonical(rows(tables, keep, "windows"))
    notes = tables.table(expiring, "current").expiries(None, tables.version(expiring, "current"))
    assert len(notes) >= 2 and notes[0]["batch"] < N  # a batch ran after an expiry of the current view
    if engine == "local":  # a DELETE on panes (a rewind's) writes change data; a vacuum past retention removes it
        store, cdc = ObjectStore(settings), f"{settings.table_root}/{keep}/panes/_change_data/"
        tables.table(keep, "panes").clear("batch = 2")
        assert list(store.list(settings.bucket_lake, cdc))
        panes = canonical(rows(tables, keep, "panes"))
        time.sleep(2.1)
        tables.table(keep, "panes").vacuum(1.0)
        assert not list(store.list(settings.bucket_lake, cdc))
        assert canonical(rows(tables, keep, "panes")) == panes


def test_stages_over_an_expiring_upstream_read_what_they_would_without_it(settings, tables, pipeline_name,
                                                                          monkeypatch) -> None:
    """Stages over an expiring upstream and over one that keeps everything (same landing files) end with the same
    tables, one that runs after every upstream batch and one that lags past the expiry (it reads the rows the
    range's commits added, expired since or not). A stage whose range spans an upstream reprocess and an expiry
    of panes after the last batch the range shares is refused in one line naming ``expire``, writing nothing."""
    from millpond.runtime import rewind, upkeep

    # a file goes whole once its last row expired, and a compaction packs new panes with old ones until its file
    # holds 256 KiB: a few minutes of this stream would never expire a pane, so nothing is compacted here
    monkeypatch.setattr(upkeep, "COMPACT_OVER_FILES", 10**6)
    keep, expiring = f"{pipeline_name}_keep", f"{pipeline_name}_ttl"
    land(settings, f"{pipeline_name}/", range(M + 2), seed=11)
    up = {keep: pipeline_from_dict(doc(keep, source={"prefix": f"{pipeline_name}/"})),
          expiring: pipeline_from_dict(doc(expiring, source={"prefix": f"{pipeline_name}/"}, expire="4m"))}

    def stage(name: str, upstream: str):
        return pipeline_from_dict({
            "name": name, "source": {"pipeline": upstream, "stream": "panes", "key": "all",
                                     "event_time": "window_start"},
            "window": {"type": "fixed", "size": "5m"}, "trigger": "AtWatermark(early=AtCount(1))",
            "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1h",
            "batch_interval": "1m"})

    follow = {name: stage(f"{name}_s", name) for name in up}
    lagging = {name: stage(f"{name}_lag", name) for name in up}
    across = stage(f"{expiring}_rw", expiring)
    at = lambda minute: to_datetime(T0 + minute * MINUTE + 55 * US)  # noqa: E731
    for minute in range(1, M + 1):
        for name in up:
            run_batch(settings, up[name], at(minute))
            run_batch(settings, follow[name], at(minute))
            if minute == 1:
                run_batch(settings, lagging[name], at(minute))
        if minute == 1:
            run_batch(settings, across, at(minute))
    for name in up:
        run_batch(settings, lagging[name], at(M + 1))
    notes = tables.table(expiring, "panes").expiries(None, tables.version(expiring, "panes"))
    assert any(n["last_batch"] > 1 for n in notes)  # panes the lagging stages had not taken yet expired
    for stages in (follow, lagging):
        for table in ("panes", "current", "windows", "seen_ids"):
            a, b = (canonical(rows(tables, stages[name].name, table)) for name in (keep, expiring))
            assert [r.replace(keep, "P") for r in a] == [r.replace(expiring, "P") for r in b], table
    assert rows(tables, lagging[expiring].name, "panes")

    rewind.run(settings, tables, up[expiring], to_us(at(2)), by="test")
    for minute in range(3, M + 1):  # the rerun's expiry deletes panes of batches after 2 again
        run_batch(settings, up[expiring], at(minute))
    before = tables.version(across.name, "batches")
    with pytest.raises(MillpondError, match=r"expired panes of its batch \d+ .*`expire:`.*across a reprocess") as exc:
        run_batch(settings, across, at(M + 1))
    assert "\n" not in str(exc.value)
    assert tables.version(across.name, "batches") == before


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_an_expiring_pipeline_reprocessed_equals_a_fresh_run(settings, tables, pipeline_name, spark,
                                                             engine: str) -> None:
    """Expiry x reprocess: an expiring pipeline ran until its upkeep had deleted rows; files then landed late into
    a past range, and a reprocess from before them rewound it. The rewind restores versions that still held rows
    expired since; the recomputed batches take the late files and expire those rows again. Every output table
    equals that of a fresh expiring pipeline (local engine) over the same files and schedule."""
    from millpond.runtime import rewind

    chosen = settings if engine == "local" else settings.with_overrides(engine="spark", engine_local_below=0)
    session = spark if engine == "spark" else None

    at = lambda minute: to_datetime(T0 + minute * MINUTE + 55 * US)  # noqa: E731
    prefix, fresh_prefix = f"{pipeline_name}/", f"{pipeline_name}_fresh/"
    for where in (prefix, fresh_prefix):
        land(settings, where, range(N + 1), seed=13)
    ran, fresh = (pipeline_from_dict(doc(f"{pipeline_name}_{n}", source={"prefix": p}, expire="4m"))
                  for n, p in (("ran", prefix), ("fresh", fresh_prefix)))
    for minute in range(1, N + 1):
        assert run_batch(chosen, ran, at(minute), spark=session).engine.startswith(engine)
    assert tables.table(ran.name, "panes").expiries(None, tables.version(ran.name, "panes"))  # rows went
    # late into the past: files arriving in minutes 5 and 6 land only now (the fresh pipeline has them at once)
    rnd = random.Random(5)
    for where in (prefix, fresh_prefix):
        store = ObjectStore(settings)
        for minute in (5, 6):
            arrival = T0 + minute * MINUTE + 57 * US
            body = "".join(json.dumps({"id": f"late{minute}-{i}", "key": f"u{i % 5}", "value": 3 + i,
                                       "event_time": to_datetime(arrival - rnd.choice((5, 70)) * US).isoformat()})
                           + "\n" for i in range(4))
            store.put_bytes(settings.bucket_landing, f"{where}{arrival_tag(arrival)}-late.jsonl", body.encode())
    rewind.run(settings, tables, ran, to_us(at(4)), by="test", reprocess="late files")
    for minute in range(5, N + 1):
        run_batch(chosen, ran, at(minute), spark=session)
    for minute in range(1, N + 1):
        run_batch(settings, fresh, at(minute))
    for table in ("panes", "current", "late", "windows", "seen_ids", "quarantine"):
        a, b = (canonical(rows(tables, name, table)) for name in (ran.name, fresh.name))
        assert [r.replace(ran.name, "P") for r in a] == [r.replace(fresh.name, "P") for r in b], table
    assert len(rows(tables, ran.name, "batches")) == N
    assert {r["id"] for r in rows(tables, ran.name, "seen_ids")} >= {f"late{m}-{i}" for m in (5, 6) for i in range(4)}


def test_compaction_leaves_an_expiring_pipelines_panes_to_expire(settings, tables, pipeline_name,
                                                                 monkeypatch) -> None:
    """Compaction packs a table's small files into files of up to its tier's size, re-packing the last unfilled
    one with the newest panes each time: a packed file of an expiring pipeline whose tier holds more than a few
    steps of its panes would not expire until its newest row had (measured: 300 files, 4.9 MB of panes after
    2,000 batches under ``expire: 1d``, whose day of panes is ~0.3 MB, with a first tier of 256 KiB). An expiring
    pipeline's panes are packed up to about one expiry step's bytes. Here the first tier is far larger than this
    stream (as 256 KiB is against the bench's), and every batch's upkeep turn is a compaction of panes: most panes
    below the last horizon are gone, against a twin that keeps everything (and whose panes were packed)."""
    from millpond.runtime import upkeep
    from millpond.runtime.steps import plan

    monkeypatch.setattr(upkeep, "COMPACT_SMALL_BYTES", 1 << 20)
    monkeypatch.setattr(upkeep, "COMPACT_FLOOR_BYTES", 256, raising=False)  # (absent before it)
    monkeypatch.setattr(upkeep, "COMPACT_OVER_FILES", 3)
    monkeypatch.setattr(plan, "upkeep_turns", lambda *_: [("compact", "panes")])
    keep, expiring = f"{pipeline_name}_keep", f"{pipeline_name}_ttl"
    land(settings, f"{pipeline_name}/", range(M + 1), seed=5)
    specs = [pipeline_from_dict(doc(keep, source={"prefix": f"{pipeline_name}/"})),
             pipeline_from_dict(doc(expiring, source={"prefix": f"{pipeline_name}/"}, expire="4m"))]
    for minute in range(1, M + 1):
        for spec in specs:
            run_batch(settings, spec, to_datetime(T0 + minute * MINUTE + 55 * US))
    notes = tables.table(expiring, "panes").expiries(None, tables.version(expiring, "panes"))
    assert notes
    below = {name: [r for r in rows(tables, name, "panes") if to_us(r["window_end"]) < notes[-1]["horizon"]
                    and r["batch"] < notes[-1]["batch"]] for name in (keep, expiring)}
    assert len(tables.open(keep, "panes").get_add_actions(flatten=True)) < M  # the twin's panes were packed
    assert 3 * len(below[expiring]) <= len(below[keep]), below[expiring]


def test_an_expiring_pipelines_panes_pack_up_to_one_steps_bytes(tables, pipeline_name) -> None:
    """The tiers of a compaction capped at one expiry step's bytes (never below COMPACT_FLOOR_BYTES); the bytes
    per span estimated from the files' statistics of the column."""
    from datetime import timedelta

    from millpond.runtime.upkeep import COMPACT_FLOOR_BYTES, COMPACT_SMALL_BYTES, COMPACT_TARGET_BYTES, compaction_tiers

    assert compaction_tiers(None) == (COMPACT_SMALL_BYTES, COMPACT_TARGET_BYTES)
    assert compaction_tiers(50_000) == (50_000,)
    assert compaction_tiers(10) == (COMPACT_FLOOR_BYTES,)
    assert compaction_tiers(1 << 30) == (COMPACT_SMALL_BYTES, COMPACT_TARGET_BYTES)
    start = to_datetime(T0)
    for hour in range(4):  # four files, an hour of window ends each: four hours in all
        ends = [start + timedelta(hours=hour, minutes=m) for m in range(0, 60, 5)]
        tables.append(pipeline_name, "spans", pa.table({"window_end": pa.array(ends, pa.timestamp("us", tz="UTC")),
                                                        "v": list(range(len(ends)))}))
    table = tables.table(pipeline_name, "spans")
    total = sum(pa.table(tables.open(pipeline_name, "spans").get_add_actions(flatten=True)).column("size_bytes")
                .to_pylist())
    span = 4 * 60 * MINUTE - 5 * MINUTE  # the first file's first end to the last file's last
    assert table.bytes_per_span("window_end", 60 * MINUTE) == total * 60 * MINUTE // span
    assert table.bytes_per_span("window_end", 24 * 60 * MINUTE) == total  # a span longer than the data: all of it
    assert table.bytes_per_span("v", MINUTE) is None  # not a timestamp with statistics


def test_an_expiring_pipelines_panes_pack_with_their_neighbours_in_time(settings, tables, pipeline_name,
                                                                         monkeypatch) -> None:
    """An expiring pipeline's ``panes`` compact in the order of ``window_end`` (``lake.packing``): each packed file
    holds the rows of adjacent files in time, whatever their sizes, so it expires about when its rows do; the rows,
    and a stage's reading of the table's changes, are as before (a ``dataChange=false`` commit). delta-rs's
    compaction bins files in the order it lists them: here it packed hours far apart together."""
    from datetime import timedelta

    from millpond.lake.delta_files import added_files
    from millpond.runtime import upkeep

    start, rnd = to_datetime(T0), random.Random(5)
    # one file an hour of window ends, every other one four times the rows, in the order a table's files may be
    # listed in (a packed file is added after the files it followed in time; a checkpoint reorders them)
    for hour in rnd.sample(range(12), 12):
        ends = [start + timedelta(hours=hour, seconds=s) for s in range(0, 3600, 25 if hour % 2 else 100)]
        tables.append(pipeline_name, "panes", pa.table({
            "window_end": pa.array(ends, pa.timestamp("us", tz="UTC")), "batch": [hour + 1] * len(ends),
            "v": [rnd.randrange(10**6) for _ in ends]}))
    before, version = canonical(rows(tables, pipeline_name, "panes")), tables.version(pipeline_name, "panes")
    sizes = pa.table(tables.open(pipeline_name, "panes").get_add_actions(flatten=True)).column("size_bytes").to_pylist()
    monkeypatch.setattr(upkeep, "compaction_tiers", lambda per_step=None: (max(sizes) * 3,))
    # an expiring pipeline's compaction turn (``expire: 8h``: a step of an hour)
    upkeep.maintain(tables, pipeline_name, 13, ("compact", "panes"), retention_s=3600, expire_us=8 * 60 * MINUTE)
    files = pa.table(tables.open(pipeline_name, "panes").get_add_actions(flatten=True)).to_pylist()
    assert len(files) < 12 and canonical(rows(tables, pipeline_name, "panes")) == before
    hours = sorted((a["min.batch"], a["max.batch"]) for a in files)  # the hours each file holds, in order
    assert all(lo <= hi < nxt for (lo, hi), (nxt, _) in zip(hours, hours[1:], strict=False)), hours
    assert sum(hi - lo + 1 for lo, hi in hours) == 12
    assert added_files(tables, pipeline_name, "panes", version, tables.version(pipeline_name, "panes")) == []
