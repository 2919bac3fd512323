"""Incremental landing listing (``model.listing``): a batch lists the tagged keys from its cursor on and
every key without a tag, reads only the plans that may have taken them, and takes exactly the files a
whole listing would, down to a file written later than the lookback, which the next full-listing period
takes; the settings are strict and changing them is safe."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.listing import Listing
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_us
from millpond.model.versions import changes, semantic_spec
from millpond.runtime.job import run_batch
from millpond.runtime.microbatch import MicroBatch
from millpond.runtime.steps import plan

T0 = datetime.now(UTC).replace(microsecond=0)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


@pytest.fixture(autouse=True)
def _start_now() -> None:
    """Processing times just after the test starts (a key without a tag arrives at its last-modified time),
    with batches 1-8 inside one ten-minute full-listing period whatever the clock says."""
    global T0
    T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=30)
    period = timedelta(minutes=10)
    boundary = datetime.fromtimestamp((at(1).timestamp() // 600 + 1) * 600, UTC)
    if boundary <= at(8):
        T0 = boundary - timedelta(minutes=1)
    assert at(8) - at(1) < period


def _doc(name: str, prefix: str, **listing: str) -> dict:
    return {"name": name, "source": {"prefix": prefix, **listing}, "window": {"type": "fixed", "size": "1m"},
            "allowed_lateness": "1h", "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "0s"}}


def _land(store: ObjectStore, bucket: str, key: str, i: int, minute: float) -> None:
    line = {"id": f"e{i}", "key": "k", "value": i, "event_time": at(minute).isoformat()}
    store.put_bytes(bucket, key, (json.dumps(line) + "\n").encode())


def _rows(tables, name: str, table: str) -> list[str]:
    t = tables.read_arrow(name, table, schema=pa.schema([]))
    t = t.drop([c for c in ("phases", "versions", "spec") if c in t.column_names])
    return sorted(repr(sorted(r.items())).replace(name, "P") for r in t.to_pylist())


def test_incremental_listing_takes_what_a_whole_listing_takes(settings, tables, pipeline_name) -> None:
    store, land = ObjectStore(settings), settings.bucket_landing
    prefix = f"{pipeline_name}/"
    inc = pipeline_from_dict(_doc(f"{pipeline_name}_inc", prefix, lookback="2m", full_listing_every="10m"))
    full = pipeline_from_dict(_doc(f"{pipeline_name}_full", prefix, listing="full"))
    tag = lambda minute: f"{prefix}{arrival_tag(to_us(at(minute)))}"  # noqa: E731

    def batches(lo: int, hi: int) -> dict[str, list[int]]:
        files: dict[str, list[int]] = {"inc": [], "full": []}
        for minute in range(lo, hi + 1):
            for label, spec in (("inc", inc), ("full", full)):
                files[label].append(run_batch(settings, spec, at(minute)).counts["files"])
        return files

    _land(store, land, f"{tag(0.5)}-a.jsonl", 1, 0.4)
    _land(store, land, f"{prefix}plain-b.jsonl", 2, 0.3)  # no tag: arrives at its last-modified time
    store.put_bytes(land, f"{prefix}_SUCCESS", b"")  # not input: reported once
    store.put_bytes(land, f"{tag(0.8)}-c.jsonl.inprogress", b"")  # still being written
    assert batches(1, 2) == {"inc": [2, 0], "full": [2, 0]}
    _land(store, land, f"{tag(2.5)}-d.jsonl", 3, 2.4)
    _land(store, land, f"{tag(1.5)}-e.jsonl", 4, 1.4)  # written a minute after its tag: within the lookback
    assert batches(3, 6) == {"inc": [2, 0, 0, 0], "full": [2, 0, 0, 0]}
    # c, tagged at 0:48, is finished five minutes later: the in-progress file held the cursor back
    _land(store, land, f"{tag(0.8)}-c.jsonl", 5, 0.7)
    store.mc.remove_object(land, f"{tag(0.8)}-c.jsonl.inprogress")
    assert batches(7, 7) == {"inc": [1], "full": [1]}
    for table in ("panes", "current", "late", "windows", "seen_ids", "quarantine", "batches"):
        assert _rows(tables, inc.name, table) == _rows(tables, full.name, table), table

    # Batch 8's listing skips every tagged key before its cursor (batch 7's time minus the lookback), and
    # reads the plans back to the untagged file's arrival only.
    job = MicroBatch(settings, inc)
    found = plan.read_history(job, to_us(at(8)))
    listed = sorted(o.key.removeprefix(prefix) for o in found["landing"])
    assert listed == ["_SUCCESS", "plain-b.jsonl"]
    assert min(found["log"].column("batch").to_pylist()) == 1  # plain-b's arrival is before batch 1

    # f is written eight minutes after its tag: later than the lookback. The whole listing takes it at
    # once; the incremental one at the first batch of the next ten-minute period, never silently.
    _land(store, land, f"{tag(1.0)}-f.jsonl", 6, 0.9)
    ten = to_us(datetime(1970, 1, 1, 0, 10, tzinfo=UTC))
    first_of_period = next(m for m in range(9, 20) if to_us(at(m)) // ten != to_us(at(m - 1)) // ten)
    files = batches(8, first_of_period)
    assert files["full"][0] == 1 and sum(files["full"]) == 1
    assert files["inc"][-1] == 1 and sum(files["inc"]) == 1, files
    late_in = tables.read_arrow(inc.name, "seen_ids", schema=pa.schema([])).to_pylist()
    assert {r["batch"] for r in late_in if r["id"] == "e6"} == {8 + len(files["inc"]) - 1}
    skipped = [r for r in tables.read_arrow(inc.name, "ingest_log", schema=pa.schema([])).to_pylist()
               if "_SUCCESS" in (r.get("skipped") or "")]
    assert len(skipped) == 1  # reported by the first batch only, however often it is listed


def test_listing_settings_are_strict_and_changing_them_is_safe() -> None:
    base = _doc("p", "p/")
    assert pipeline_from_dict(base).listing == Listing()
    with pytest.raises(ValueError, match="source.listing = 'partial': use incremental"):
        pipeline_from_dict(_doc("p", "p/", listing="partial"))
    with pytest.raises(ValueError, match="source.lookback: not a duration"):
        pipeline_from_dict(_doc("p", "p/", lookback="soon"))
    with pytest.raises(ValueError, match="unknown key source.'lookbak': did you mean 'lookback'"):
        pipeline_from_dict(_doc("p", "p/", lookbak="1h"))
    changed = _doc("p", "p/", lookback="3h")
    assert changes(semantic_spec(base), semantic_spec(changed)) == ([], ["listing"])
    assert semantic_spec(base)["source"] == {"prefix": "p/"}


def test_the_cursor_follows_the_previous_batch() -> None:
    m = 60_000_000
    listing = Listing(lookback=2 * m, full_every=10 * m)
    assert listing.cursor(None, None, 5 * m) is None  # the first batch lists everything
    assert listing.cursor(5 * m, None, 6 * m) == 3 * m
    assert listing.cursor(5 * m, 1 * m, 6 * m) == 1 * m  # held back by a file still being written
    assert listing.cursor(9 * m, None, 10 * m) is None  # a new period: the whole prefix once
    assert Listing(mode="full").cursor(5 * m, None, 6 * m) is None
