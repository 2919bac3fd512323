"""The Spark engine's file-by-file rewrite of ``windows`` (``lake.spark_ranged``): which files a changed row
concerns, and what a replaced file holds, against a real object store (its executor-side functions, called as a
task calls them)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from millpond.lake.snapshot_files import Storage, read_file
from millpond.lake.spark_io import write_table
from millpond.lake.spark_ranged import (
    RangedFile,
    holding,
    homes,
    key_tags,
    replace_file,
    split_written,
    tag_task,
    touched_rows,
)
from millpond.model.state import WINDOWS_SCHEMA

KEY = ["key", "window_start", "window_end"]


def rows(*windows: tuple[str, int, str | None], deleted: bool = False) -> pa.Table:
    """``windows`` rows: (key, start minute, state); the window ends 5 minutes later."""
    n = len(windows)
    ts = pa.timestamp("us", tz="UTC")
    return pa.table({"key": [w[0] for w in windows],
                     "window_start": pa.array([w[1] * 60_000_000 for w in windows], pa.int64()).cast(ts),
                     "window_end": pa.array([(w[1] + 5) * 60_000_000 for w in windows], pa.int64()).cast(ts),
                     "state": [w[2] for w in windows], "event_timer": pa.nulls(n, ts), "ptime_timer": pa.nulls(n, ts),
                     "batch": pa.array([1] * n, pa.int64()), "deleted": [deleted] * n}, schema=WINDOWS_SCHEMA)


def file(lo: str | None, hi: str | None, uri: str = "s3://b/t/x.parquet") -> RangedFile:
    return RangedFile(uri, {}, {"path": uri.rsplit("/", 1)[1], "size": 1, "partition_values": {}}, lo, hi)


@pytest.mark.unit
def test_a_key_s_home_is_the_last_file_starting_at_or_below_it() -> None:
    files = [file("m", "p"), file("c", "f"), file(None, None), file("t", "x")]
    assert homes(files, ["a", "c", "e", "g", "m", "q", "z"]).tolist() == [1, 1, 1, 1, 0, 0, 3]
    assert homes([file(None, None)], ["a", "z"]).tolist() == [0, 0]


@pytest.mark.unit
def test_a_changed_row_goes_to_every_file_that_may_hold_it_and_is_added_to_its_home_only() -> None:
    files = [file("a", "f"), file("d", "k"), file(None, None), file("m", None)]
    changes = rows(("b", 0, "s"), ("e", 0, "s"), ("h", 0, "s"), ("l", 0, "s"), ("zz", 0, "s"))
    tagged = pa.Table.from_batches(list(tag_task(files, WINDOWS_SCHEMA, changes.to_batches())))
    got = sorted((r["key"], r["_f"], r["_home"]) for r in tagged.select(["key", "_f", "_home"]).to_pylist())
    assert got == sorted([
        ("b", 0, True), ("b", 2, False),
        ("e", 0, False), ("e", 1, True), ("e", 2, False),  # in both ranges: dropped from both, added to one
        ("h", 1, True), ("h", 2, False),
        ("l", 1, True), ("l", 2, False),  # between the ranges: its home's range grows
        ("zz", 2, False), ("zz", 3, True),  # no upper bound (a long key's statistic was cut)
    ])


@pytest.mark.unit
def test_the_keys_a_file_holds_are_found_by_search_as_by_comparing_each_key() -> None:
    """``holding`` (keys sorted once, two binary searches a file) against the plain rule, on seeded random keys
    and ranges: overlapping, open-ended, without statistics, and a range no key falls in."""
    import random

    rng = random.Random(7)
    alphabet = "abcé中z"
    keys = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    files = [file(None, None), file("b", None), file("zzzzz", None), file("é", "é中")]
    for _ in range(30):
        lo, hi = sorted("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2))
        files.append(file(lo, hi))
    got = {f: at.tolist() for f, at in holding(files, pa.array(keys))}
    want = {}
    for f, r in enumerate(files):
        at = [i for i, k in enumerate(keys) if r.lo is None or (k.encode() >= r.lo.encode()
                                                               and (r.hi is None or k.encode() <= r.hi.encode()))]
        if at:
            want[f] = at
    assert got == want
    tags = pa.Table.from_batches(list(key_tags(files, [pa.record_batch(
        {"key": keys, "lo": pa.array(range(400), pa.int64()), "hi": pa.array(range(400), pa.int64())})])))
    assert sorted(zip(tags.column("_f").to_pylist(), tags.column("lo").to_pylist(), strict=True)) == sorted(
        (f, i) for f, at in want.items() for i in at)


def _written(settings, uri: str, actions: list[str]) -> pa.Table:
    storage = Storage.of(settings)
    parts = []
    for a in actions:
        fs, path = storage.filesystem(f"{uri}/{json.loads(a)['path']}")
        parts += list(read_file(fs, path, WINDOWS_SCHEMA, {}))
    return pa.Table.from_batches(parts, schema=WINDOWS_SCHEMA)


def test_a_replaced_file_keeps_what_the_batch_did_not_change_and_takes_its_upserts(settings, pipeline_name) -> None:
    storage = Storage.of(settings)
    uri = settings.table_uri(pipeline_name, "windows")
    old = rows(("a", 0, "a0"), ("a", 10, "a10"), ("c", 0, "c0"), ("e", 0, "e0"))
    [action] = write_table(storage, uri, old)
    target = file("a", "e", f"{uri}/{json.loads(action)['path']}")
    upserts = rows(("a", 10, "a10+"), ("b", 0, "b0"), ("z", 0, "elsewhere"))
    drops = rows(("c", 0, None), ("e", 5, None), deleted=True)  # e@5 was never here: nothing to drop
    changes = pa.concat_tables([upserts, drops])
    home = pa.array([True, True, False, False, False])
    tagged = changes.append_column("_f", pa.array([0] * 5, pa.int32())).append_column("_home", home)
    actions = replace_file(storage, target, tagged, WINDOWS_SCHEMA, uri, KEY, KEY, file_rows=100)
    after = _written(settings, uri, actions)
    assert [(r["key"], r["window_start"].minute, r["state"]) for r in after.to_pylist()] == [
        ("a", 0, "a0"), ("a", 10, "a10+"), ("b", 0, "b0"), ("e", 0, "e0")]
    assert not pc.any(after.column("deleted")).as_py()
    # every row dropped: no file left, the old one still goes
    gone = replace_file(storage, target, rows(*[(k, m, None) for k, m, _s in
                                                [("a", 0, 0), ("a", 10, 0), ("c", 0, 0), ("e", 0, 0)]],
                                              deleted=True).append_column("_f", pa.array([0] * 4, pa.int32()))
                        .append_column("_home", pa.array([True] * 4)), WINDOWS_SCHEMA, uri, KEY, KEY, file_rows=100)
    assert gone == []
    assert split_written([json.loads(a) for a in actions] + [{"remove": target.remove}]) == (
        [json.loads(a) for a in actions], [target.remove])


def test_a_file_that_outgrows_its_size_is_written_as_sorted_pieces(settings, pipeline_name) -> None:
    storage = Storage.of(settings)
    uri = settings.table_uri(pipeline_name, "windows")
    [action] = write_table(storage, uri, rows(*[(f"k{i:03d}", 0, "s") for i in range(0, 100, 2)]))
    target = file("k000", "k098", f"{uri}/{json.loads(action)['path']}")
    new = rows(*[(f"k{i:03d}", 0, "n") for i in range(1, 100, 2)])
    tagged = new.append_column("_f", pa.array([0] * 50, pa.int32())).append_column("_home", pa.array([True] * 50))
    actions = replace_file(storage, target, tagged, WINDOWS_SCHEMA, uri, KEY, KEY, file_rows=30)
    pieces = [_written(settings, uri, [a]) for a in actions]
    assert [p.num_rows for p in pieces] == [33, 33, 34]
    keys = [k for p in pieces for k in p.column("key").to_pylist()]
    assert keys == [f"k{i:03d}" for i in range(100)]
    stats = [json.loads(json.loads(a)["stats"]) for a in actions]
    assert [(s["minValues"]["key"], s["maxValues"]["key"]) for s in stats] == [
        ("k000", "k032"), ("k033", "k065"), ("k066", "k099")]


@pytest.mark.unit
def test_a_read_keeps_the_rows_a_batch_can_change_and_only_those() -> None:
    """A due timer, or a window of a key the batch touches within reach of its elements; with the reach unknown,
    every window of such a key."""
    m = 60_000_000
    stored = rows(("a", 0, "a0"), ("a", 30, "a30"), ("b", 0, "b0"), ("c", 0, "c0"), ("d", 60, "d60"))
    ts = pa.timestamp("us", tz="UTC")
    stored = stored.set_column(4, "event_timer", pa.array([None, None, None, 10 * m, 70 * m], pa.int64()).cast(ts))
    # key a's elements at minutes 3-4 (two rows: the bounds of both count), b's at 20-21
    keys = pa.table({"key": ["a", "b", "a"], "lo": [3 * m, 20 * m, 4 * m], "hi": [4 * m, 21 * m, 4 * m]})

    def kept(reach, watermark=20 * m):
        got = touched_rows(stored, keys, watermark, 0, reach)
        return sorted((r["key"], r["window_start"] // m) for r in got.to_pylist())

    assert kept(reach=5 * m) == [("a", 0), ("c", 0)]  # c: its timer is due; b's window ended before 20
    assert kept(reach=30 * m) == [("a", 0), ("a", 30), ("c", 0)]  # a@30 starts within 30m of a's last element
    assert kept(reach=None) == [("a", 0), ("a", 30), ("b", 0), ("c", 0)]
    assert kept(reach=30 * m, watermark=0) == [("a", 0), ("a", 30)]
    assert touched_rows(stored, keys.slice(0, 0), 80 * m, 0, 0).column("key").to_pylist() == ["c", "d"]
