"""Low watermarks (MillWheel section 5): policies, monotonicity, the injector's pending files, and
bounded dedup state expiring behind the watermark."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, to_us
from millpond.model.watermark import WatermarkPolicy, advance
from millpond.runtime.job import run_batch
from millpond.runtime.steps import dedup
from millpond.runtime.steps.dedup import SEEN_FOLD_EXPIRED_SHARE, SEEN_FOLD_OVER_FILES

T0 = datetime(2026, 4, 1, 12, 0, tzinfo=UTC)


def us(minutes: float) -> int:
    return to_us(T0 + timedelta(minutes=minutes))


def test_policies() -> None:
    p = WatermarkPolicy.from_config({"policy": "processing_time", "lag": "2m"})
    assert p.candidate(batch_index=0, processing_time=us(10), max_event_time=None) == us(8)
    b = WatermarkPolicy.from_config({"policy": "bounded_out_of_orderness", "bound": "30s"})
    assert b.candidate(batch_index=0, processing_time=us(10), max_event_time=us(9)) == us(8.5)
    inj = WatermarkPolicy.from_config({"policy": "injector", "bound": "1m"})
    assert inj.candidate(batch_index=0, processing_time=us(10), max_event_time=None, oldest_pending=us(4)) == us(3)
    assert inj.candidate(batch_index=0, processing_time=us(10), max_event_time=None) == us(9)
    pct = WatermarkPolicy.from_config({"policy": "percentile", "percentile": 99})
    delays = [1 * US] * 99 + [600 * US]  # one straggler ten minutes late
    assert pct.candidate(batch_index=0, processing_time=us(10), max_event_time=None, delays=delays) == us(10) - US
    full = WatermarkPolicy.from_config({"policy": "percentile", "percentile": 100})
    assert full.candidate(batch_index=0, processing_time=us(10), max_event_time=None, delays=delays) == us(0)
    assert advance(us(5), us(3)) == us(5)  # never backwards


def event(i: int, minute: float, arrival: float) -> str:
    return json.dumps({"id": f"e{i}", "key": "k", "value": 1,
                       "event_time": (T0 + timedelta(minutes=minute)).isoformat(),
                       "arrival_time": (T0 + timedelta(minutes=arrival)).isoformat()}) + "\n"


def test_injector_watermark_held_by_unfinished_file(settings, tables, pipeline_name) -> None:
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "source": {"prefix": f"{pipeline_name}/"}, "allowed_lateness": "1h",
                               "watermark": {"policy": "injector", "bound": "10s"}})
    store = ObjectStore(settings)
    land = settings.bucket_landing
    store.put_bytes(land, f"{pipeline_name}/{arrival_tag(us(0.5))}-a.jsonl", event(1, 0.2, 0.5).encode())
    store.put_bytes(land, f"{pipeline_name}/{arrival_tag(us(1))}-b.jsonl.inprogress", b"")
    first = run_batch(settings, spec, T0 + timedelta(minutes=3))
    assert to_us(first.watermark) == us(1) - 10 * US  # held at the unfinished file
    assert first.counts["files"] == 1
    store.put_bytes(land, f"{pipeline_name}/{arrival_tag(us(1))}-b.jsonl", event(2, 0.9, 1).encode())
    store.mc.remove_object(land, f"{pipeline_name}/{arrival_tag(us(1))}-b.jsonl.inprogress")
    second = run_batch(settings, spec, T0 + timedelta(minutes=4))
    assert to_us(second.watermark) == us(4) - 10 * US
    assert second.counts["accepted"] == 1 and second.counts["late"] == 0


def _dedup_spec(pipeline_name: str):
    return pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "source": {"prefix": f"{pipeline_name}/"}, "allowed_lateness": "1m",
                               "watermark": {"policy": "processing_time", "lag": "0s"}})


def _land_dedup_batch(store: ObjectStore, bucket: str, pipeline_name: str, b: int, batches: int) -> None:
    """Batch ``b``'s file (one element, e``b``); the last batch also gets e(b-2) again, still remembered."""
    store.put_bytes(bucket, f"{pipeline_name}/{arrival_tag(us(b))}-{b}.jsonl", event(b, b + 0.5, b + 0.6).encode())
    if b == batches - 1:
        store.put_bytes(bucket, f"{pipeline_name}/{arrival_tag(us(b))}-again.jsonl",
                        event(b - 2, b - 1.5, b + 0.7).encode())


def test_dedup_state_is_bounded_and_old_redelivery_is_counted_late(settings, tables, pipeline_name,
                                                                    monkeypatch) -> None:
    spec = _dedup_spec(pipeline_name)
    store = ObjectStore(settings)
    # Ids expire when seen_ids is compacted: by the commit of the first batch that finds it with more than
    # SEEN_FOLD_OVER_FILES files (one per batch).
    batches = SEEN_FOLD_OVER_FILES + 2
    reads: list[str] = []  # the last batch's reads of seen_ids
    for b in range(batches):
        _land_dedup_batch(store, settings.bucket_landing, pipeline_name, b, batches)
        if b == batches - 1:
            for method in ("read_arrow", "select"):
                real = getattr(Tables, method)
                monkeypatch.setattr(Tables, method, lambda self, p, n, *a, _real=real, **k: (
                    reads.append(n) if n == "seen_ids" else None) or _real(self, p, n, *a, **k))
        last = run_batch(settings, spec, T0 + timedelta(minutes=b + 1))
    assert last.counts["duplicates"] == 1 and last.counts["accepted"] == 1
    # The dedup's read of seen_ids also took the ids the replacement keeps: the table was read once.
    assert reads == ["seen_ids"]
    monkeypatch.undo()
    seen = tables.read_arrow(pipeline_name, "seen_ids")
    # The last batch replaced the earlier batches' files by one file of its own ids and the earlier ones
    # not older than 2 minutes (1m lateness + 1m window) behind its input watermark (12:<batches - 1>).
    assert set(seen.column("id").to_pylist()) == {f"e{batches - 3}", f"e{batches - 2}", f"e{batches - 1}"}
    seen_dt = DeltaTable(tables.uri(pipeline_name, "seen_ids"), storage_options=tables.options)
    assert len(seen_dt.file_uris()) == 1
    # Record ids never repeat: written without a dictionary (the writer would build one only to drop it).
    chunks = [rg.column(i) for f in seen_dt.to_pyarrow_dataset().get_fragments()
              for rg in (f.metadata.row_group(j) for j in range(f.metadata.num_row_groups))
              for i in range(rg.num_columns)]
    assert {c.path_in_schema: c.has_dictionary_page for c in chunks}["id"] is False
    # e1 delivered again: no longer remembered, but its window is past allowed lateness: late, not double.
    store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(us(batches))}-again.jsonl",
                    event(1, 1.5, batches + 0.2).encode())
    result = run_batch(settings, spec, T0 + timedelta(minutes=batches + 1))
    assert result.counts["late"] == 1 and result.counts["accepted"] == 1
    late = tables.read_arrow(pipeline_name, "late", schema=pa.schema([("id", pa.string())]))
    assert late.column("id").to_pylist() == ["e1"]
    assert late.column("reason").to_pylist() == ["beyond allowed lateness"]
    values = tables.read_arrow(pipeline_name, "current").column("value").to_pylist()
    assert sum(values) == batches  # each event counted once


def test_seen_ids_are_folded_once_enough_has_expired_not_on_every_batch(settings, tables, pipeline_name) -> None:
    """A fold rewrites every id it keeps. It came with every accepting batch once seen_ids had more than
    SEEN_FOLD_OVER_FILES files, whether an id had expired or not: a pipeline rewrote its whole dedup state on each
    batch (the Spark engine's ten-batch sequence of ``make bench``: the last batches rewrote 0.9M ids to add
    0.1M). Now only once the files whose every id has expired hold SEEN_FOLD_EXPIRED_SHARE of its rows."""
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "fixed", "size": "1m"},
                               "source": {"prefix": f"{pipeline_name}/"}, "allowed_lateness": "30m",
                               "watermark": {"policy": "processing_time", "lag": "0s"}})  # ids kept 31m
    store = ObjectStore(settings)
    seen_dt = None

    def batch(i: int, at: float) -> list[str]:
        """Event ``e<i>`` half a minute before ``at`` (minutes), then the batch at ``at``; seen_ids' files."""
        nonlocal seen_dt
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(us(at - 0.4))}-{i}.jsonl",
                        event(i, at - 0.5, at - 0.4).encode())
        assert run_batch(settings, spec, T0 + timedelta(minutes=at)).counts["accepted"] == 1
        seen_dt = DeltaTable(tables.uri(pipeline_name, "seen_ids"), storage_options=tables.options)
        return seen_dt.file_uris()

    for i in range(12):  # nothing expires: no fold, one file a batch
        assert len(batch(i, i + 1)) == i + 1
    assert len(batch(12, 32)) == 13  # input watermark 12m: still nothing behind 31m
    assert len(batch(13, 33)) == 14  # e0 (0m30s) expired: 1 of 14 ids, under the share
    assert len(batch(14, 35)) == 1  # e0 and e1 expired, 2 of 15: folded, the ids from 2m on kept
    assert sorted(tables.read_arrow(pipeline_name, "seen_ids").column("id").to_pylist()) == sorted(
        f"e{i}" for i in range(2, 15))
    assert SEEN_FOLD_EXPIRED_SHARE == 0.1


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_seen_ids_of_a_global_window_are_compacted_every_id_kept(settings, tables, pipeline_name, engine, request,
                                                                  monkeypatch) -> None:
    """The global window never closes: its ids are kept for good (no dedup horizon), and ``seen_ids`` was never
    folded, so each accepting batch left a file more for every later dedup to open (a year of 5-minute batches:
    100k files). Past SEEN_FOLD_OVER_MANY_FILES files (6 here) a batch compacts them, keeping every id; on the
    Spark engine's plan too."""
    monkeypatch.setattr(dedup, "SEEN_FOLD_OVER_MANY_FILES", 6)
    spark = request.getfixturevalue("spark") if engine == "spark" else None
    chosen = settings.with_overrides(engine=engine, engine_local_below=0, engine_one_task_below=0)
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "global"},
                               "trigger": "Repeat(AtCount(1))", "source": {"prefix": f"{pipeline_name}/"},
                               "watermark": {"policy": "processing_time", "lag": "0s"}})
    store = ObjectStore(settings)
    files = []
    for i in range(9):
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(us(i + 0.6))}-{i}.jsonl",
                        event(i, i + 0.5, i + 0.6).encode())
        assert run_batch(chosen, spec, T0 + timedelta(minutes=i + 1), spark=spark).counts["accepted"] == 1
        files.append(len(DeltaTable(tables.uri(pipeline_name, "seen_ids"), storage_options=tables.options)
                         .file_uris()))
    assert files[:7] == [1, 2, 3, 4, 5, 6, 7] and files[7] < 7, files  # batch 8 found 7 files: compacted
    assert sorted(tables.read_arrow(pipeline_name, "seen_ids").column("id").to_pylist()) == sorted(
        f"e{i}" for i in range(9))


@pytest.mark.parametrize("one_task", [False, True], ids=["plan", "one_task"])
def test_dedup_state_is_bounded_on_the_spark_engine(settings, spark, tables, pipeline_name, one_task) -> None:
    """The Spark engine (its multi-stage plan, and a small batch's one task) folds seen_ids as the local engine
    does: ids expire behind the watermark, so the table every batch's dedup reads stays bounded over months of
    batches."""
    spec = _dedup_spec(pipeline_name)
    on_spark = settings.with_overrides(engine="spark", engine_local_below=0,
                                       engine_one_task_below=10**6 if one_task else 0)
    store = ObjectStore(settings)
    batches = SEEN_FOLD_OVER_FILES + 2
    for b in range(batches):
        _land_dedup_batch(store, settings.bucket_landing, pipeline_name, b, batches)
        last = run_batch(on_spark, spec, T0 + timedelta(minutes=b + 1), spark=spark)
        assert ("spark_task" in last.phases) == one_task  # the batch ran on the Spark engine, in one task or not
        assert ("dedup" in last.phases) == one_task
    assert last.counts["duplicates"] == 1 and last.counts["accepted"] == 1
    seen = tables.read_arrow(pipeline_name, "seen_ids")
    assert set(seen.column("id").to_pylist()) == {f"e{batches - 3}", f"e{batches - 2}", f"e{batches - 1}"}
    assert seen.num_rows == 3
    seen_dt = DeltaTable(tables.uri(pipeline_name, "seen_ids"), storage_options=tables.options)
    assert len(seen_dt.file_uris()) <= on_spark.spark_shuffle_partitions  # the earlier batches' files replaced
