"""Storage bounded (issue 38): a deployment keeps its tables' history for ``retention`` (a pipeline's own
``retention:`` may lengthen it), and the batches' upkeep vacuums what no version within it needs and expires the
log past it. The lake then stops growing with batches, every version within retention reads as it did (a reader
pinned to one included), and what reaches further back — a reprocess, a lagging stage, time travel — is refused
in one line naming the setting, before anything is written."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import yaml
from millpond.config import load_settings
from millpond.errors import MillpondError
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, iso, to_datetime, to_us
from millpond.runtime import rewind
from millpond.runtime.job import run_batch
from millpond.runtime.upkeep import maintain, retention_of, upkeep_turns
from millpond.surface.query import run_query

#: the tests' retention, in seconds (a batch here takes a quarter to one second), and the long run's: what
#: changed within it stays, so it must be short against the run for the lake to stop growing within it
R = 8.0
R_LONG = 1.0
T0 = to_us("2026-03-02T00:00:00Z")
MINUTE = 60 * US
#: batches of the long run, measured after N and after 2N
N = 25
TABLES = ("panes", "current", "windows", "seen_ids", "late", "quarantine", "ingest_log", "batches")


@pytest.fixture(scope="module")
def short(settings):
    """The session's store, with a retention of seconds (set as a deployment sets it, by its variable)."""
    return load_settings(env={**os.environ, "MILLPOND_RETENTION": f"{R:g}s"})


@pytest.fixture(scope="module")
def tiny(settings):
    return load_settings(env={**os.environ, "MILLPOND_RETENTION": f"{R_LONG:g}s"})


def doc(name: str, **changed) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "value_type": "int", "aggregation": "sum",
            "window": {"type": "sessions", "gap": "2m"}, "accumulation": "accumulating_and_retracting",
            "trigger": "AtWatermark(early=AtCount(2), late=AtCount(1))", "allowed_lateness": "10m",
            "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "1m"}, **changed}


def land(settings, name: str, minutes: range, seed: int = 1) -> None:
    """One file per batch interval: a steady stream of a few keys, some events a little late."""
    rnd = random.Random(seed)
    store = ObjectStore(settings)
    for minute in minutes:
        arrival = T0 + minute * MINUTE + rnd.randrange(1, 50) * US
        rows = [{"id": f"e{minute}-{i}", "key": f"u{rnd.randrange(6)}", "value": rnd.randrange(1, 9),
                 "event_time": to_datetime(arrival - rnd.randrange(0, 150) * US).isoformat()} for i in range(8)]
        store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(arrival)}.jsonl",
                        "".join(json.dumps(r) + "\n" for r in rows).encode())


def run(settings, spec, minutes: range) -> None:
    for m in minutes:
        run_batch(settings, spec, to_datetime(T0 + m * MINUTE))


def usage(settings, name: str) -> tuple[int, int]:
    """(objects, bytes) of the pipeline's tables in the lake."""
    found = list(ObjectStore(settings).list(settings.bucket_lake, f"{settings.table_root}/{name}/"))
    return len(found), sum(o.size for o in found)


def rows(tables: Tables, name: str, table: str, version: int | None) -> list[str]:
    if version is None:
        return []
    return sorted(json.dumps(r, sort_keys=True, default=str) for r in tables.read_arrow(name, table, version=version)
                  .to_pylist())


def content(tables: Tables, name: str) -> dict[str, list]:
    """What a reader sees of the pipeline at its marker: every output table's rows (landing files named without
    the pipeline's prefix), the plans' files and the markers' counts (versions and timings differ run to run)."""
    out = {t: [r.replace(name, "P") for r in rows(tables, name, t, v)]
           for t, v in marker_versions(tables, name).items() if t not in ("ingest_log", "batches")}
    plans = tables.read_arrow(name, "ingest_log").sort_by("batch").select(["batch", "processing_time", "files"])
    out["ingest_log"] = [[f.replace(name, "P") for f in r["files"]] + [r["batch"], str(r["processing_time"])]
                         for r in plans.to_pylist()]
    out["batches"] = tables.read_arrow(name, "batches").sort_by("batch").select(
        ["batch", "processing_time", "watermark", "input", "accepted", "duplicates", "late", "panes"]).to_pylist()
    return out


def marker_versions(tables: Tables, name: str) -> dict[str, int | None]:
    last = tables.read_arrow(name, "batches").sort_by("batch").to_pylist()[-1]
    return {t: v for t, v in json.loads(last["versions"]).items() if t in TABLES}


def upkeep_now(tables: Tables, name: str) -> None:
    """Every table's vacuum/checkpoint/log turn at once (a batch takes one of them from its cycle)."""
    for turn in upkeep_turns(TABLES[:-2], ("windows", "seen_ids")):
        if turn[0] == "checkpoint":
            maintain(tables, name, 0, turn)


@pytest.fixture(scope="module")
def long_run(tiny, tables):
    """One pipeline run for 2N batches under a retention of a second, its lake measured after N and after 2N."""
    name = f"t_{os.urandom(5).hex()}"
    spec = pipeline_from_dict(doc(name))
    land(tiny, name, range(0, 2 * N + 8))
    run(tiny, spec, range(1, N + 1))
    after_n = usage(tiny, name)
    run(tiny, spec, range(N + 1, 2 * N + 1))
    return {"name": name, "spec": spec, "after_n": after_n, "after_2n": usage(tiny, name)}


def test_the_lake_stops_growing_with_batches(long_run) -> None:
    """Today's lake kept every version of every file: twice the batches, twice the objects and bytes. Vacuumed,
    it holds the live rows plus what changed within retention."""
    (objects_n, bytes_n), (objects_2n, bytes_2n) = long_run["after_n"], long_run["after_2n"]
    assert objects_2n <= 1.3 * objects_n, (objects_n, objects_2n)
    assert bytes_2n <= 1.5 * bytes_n, (bytes_n, bytes_2n)


def test_the_tables_read_as_a_fresh_run_without_vacuum_does(settings, tables, long_run) -> None:
    """Vacuum and log expiry change no row a reader sees: the same tables as a pipeline run under the default
    retention (7 days: nothing here is vacuumed) over the same files and schedule."""
    name = long_run["name"]
    fresh = f"{name}_fresh"
    land(settings, fresh, range(0, 2 * N + 8))
    run(settings, pipeline_from_dict(doc(fresh)), range(1, 2 * N + 1))
    assert content(tables, name) == content(tables, fresh)
    assert tables.table(fresh, "windows").retention() == 7 * 86400


def test_a_pinned_reader_keeps_its_versions_within_retention_and_old_ones_fail_in_one_line(short,
                                                                                             pipeline_name) -> None:
    """A reader pinned to a marker's versions (as a batch pins its plan's, and `millpond query` the marker's)
    reads them whole while they are within retention, through later batches and their vacuums; past it, time
    travel fails in one line naming the setting."""
    tables = Tables(short)
    name, spec = pipeline_name, pipeline_from_dict(doc(pipeline_name))
    land(short, name, range(0, 2 * N + 8))
    run(short, spec, range(N - 12, 2 * N + 1))  # past a cycle: every table has had its upkeep turn
    pinned = marker_versions(tables, name)
    held = {t: tables.open(name, t, v) for t, v in pinned.items() if v is not None}
    before = {t: rows(tables, name, t, v) for t, v in pinned.items()}
    run(short, spec, range(2 * N + 1, 2 * N + 4))  # every table moves on: the pinned versions are replaced
    upkeep_now(tables, name)
    assert {t: rows(tables, name, t, v) for t, v in pinned.items()} == before
    assert {t: sorted(json.dumps(r, sort_keys=True, default=str) for r in dt.to_pyarrow_table().to_pylist())
            for t, dt in held.items()} == {t: r for t, r in before.items() if t in held}
    at = time.time()
    time.sleep(R + 1.5)
    run(short, spec, range(2 * N + 4, 2 * N + 5))
    upkeep_now(tables, name)
    version = pinned["windows"]
    with pytest.raises(MillpondError):  # vacuumed: past retention
        tables.read_arrow(name, "windows", version=version)
    with pytest.raises(MillpondError) as refused:
        run_query(short, f"SELECT count(*) FROM {name}.windows@v{version}")
    message = str(refused.value)
    assert "\n" not in message and f"retention of {R:g}s" in message and "MILLPOND_RETENTION" in message, message
    assert f"{name}.windows at version {version} was replaced" in message, message
    with pytest.raises(MillpondError, match=r"older than .*'s retention of 8s \(`retention` in conf/millpond.yaml"):
        run_query(short, f"SELECT count(*) FROM {name}.windows", as_of=iso(int((at - R - 3) * 1_000_000)))
    assert run_query(short, f"SELECT count(*) AS n FROM {name}.windows").column("n")[0].as_py() > 0  # the marker's


def test_a_reprocess_beyond_retention_is_refused_before_it_writes(short, pipeline_name) -> None:
    tables = Tables(short)
    name = pipeline_name
    spec = pipeline_from_dict(doc(name))
    land(short, name, range(0, 12))
    run(short, spec, range(1, 6))
    r = rewind.run(short, tables, spec, T0 + 4 * MINUTE, by="test")  # within retention: rewinds
    assert (r.to_batch, r.last_batch) == (4, 5)
    run(short, spec, range(5, 8))
    time.sleep(R + 1.5)
    run(short, spec, range(8, 9))
    versions = {t: tables.version(name, t) for t in TABLES}
    with pytest.raises(MillpondError) as refused:
        rewind.run(short, tables, spec, T0 + 3 * MINUTE, by="test")
    message = str(refused.value)
    assert "\n" not in message and "beyond" in message and "`retention` in conf/millpond.yaml" in message, message
    assert f"reprocess from {iso(T0 + 3 * MINUTE)}" in message and "--from" in message, message
    assert {t: tables.version(name, t) for t in TABLES} == versions  # nothing moved
    assert len(tables.read_arrow(name, "operations").to_pylist()) == 1  # the first reprocess only
    run(short, spec, range(9, 10))  # the lease is free: the pipeline goes on
    r = rewind.run(short, tables, spec, T0 + 8 * MINUTE, by="test")  # the last batches are within retention
    assert (r.to_batch, r.last_batch) == (8, 9)


def test_a_stage_reading_beyond_its_upstreams_retention_is_refused_before_it_writes(short, tables,
                                                                                     pipeline_name) -> None:
    up, down = f"{pipeline_name}_up", f"{pipeline_name}_down"
    up_spec = pipeline_from_dict(doc(up))
    down_spec = pipeline_from_dict({
        "name": down, "source": {"pipeline": up, "stream": "panes", "key": "all", "event_time": "window_start"},
        "window": {"type": "fixed", "size": "1h"}, "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))",
        "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1d", "batch_interval": "1m"})
    land(short, up, range(0, 12))
    for m in range(1, 4):  # the stage keeps up
        run(short, up_spec, range(m, m + 1))
        run(short, down_spec, range(m, m + 1))
    run(short, up_spec, range(4, 7))  # the stage lags ...
    time.sleep(R + 1.5)  # ... longer than its upstream's retention
    run(short, up_spec, range(7, 8))
    plans = tables.version(down, "ingest_log")
    with pytest.raises(MillpondError) as refused:
        run(short, down_spec, range(7, 8))
    message = str(refused.value)
    assert "\n" not in message and f"{up}.panes at version" in message and "beyond" in message, message
    assert f"`millpond reset {down}`" in message and "MILLPOND_RETENTION" in message, message
    assert tables.version(down, "ingest_log") == plans  # its plan was not written
    assert len(tables.read_arrow(down, "batches")) == 3


def test_a_pipeline_keeps_a_longer_retention_of_its_own(short, tables, pipeline_name, tmp_path: Path) -> None:
    """``retention:`` in a pipeline file lengthens the deployment's for its tables: their vacuum keeps it (the
    upkeep finds it by the pipeline's name) and a reprocess reaches back that far."""
    name = pipeline_name
    raw = doc(name, retention="1h")
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    conf = short.with_overrides(conf_dir=tmp_path)
    spec = pipeline_from_dict(raw)
    assert (retention_of(conf, name), retention_of(short, name), retention_of(short, name, spec)) == (3600, R, 3600)
    land(conf, name, range(0, 8))
    run(conf, spec, range(1, 4))
    old = marker_versions(tables, name)
    before = {t: rows(tables, name, t, v) for t, v in old.items()}
    run(conf, spec, range(4, 6))
    time.sleep(R + 1.5)
    upkeep_now(Tables(conf), name)
    assert tables.table(name, "windows").retention() == 3600
    assert {t: rows(tables, name, t, v) for t, v in old.items()} == before  # not vacuumed after the deployment's
    r = rewind.run(conf, Tables(conf), spec, T0 + 2 * MINUTE, by="test")
    assert (r.to_batch, r.last_batch) == (2, 5)


def test_retention_is_a_strict_setting_and_pipeline_key(settings) -> None:
    assert load_settings(env={}).retention_s == 7 * 86400  # the shipped default: Delta's for replaced files
    assert load_settings(env={"MILLPOND_RETENTION": "36h"}).retention_s == 36 * 3600
    for bad in ("0s", "soon"):
        with pytest.raises(MillpondError, match="MILLPOND_RETENTION: retention"):
            load_settings(env={"MILLPOND_RETENTION": bad})
    for bad in ("0s", "forever", True):
        with pytest.raises(ValueError, match="retention: expected a duration longer than zero"):
            pipeline_from_dict(doc("p", retention=bad))
    with pytest.raises(ValueError, match="did you mean 'retention'"):
        pipeline_from_dict(doc("p", retension="30d"))
    assert pipeline_from_dict(doc("p", retention="30d")).retention == 30 * 86400 * US
    assert retention_of(settings, "p", pipeline_from_dict(doc("p", retention="1h"))) == 7 * 86400  # only longer


def test_no_commit_writes_a_checkpoint_that_strands_replaced_files(settings, pipeline_name) -> None:
    """A checkpoint forgets the files that versions replaced more than the retention ago, and a vacuum below an hour
    finds replaced files through the log alone: a checkpoint written by a commit at any time (delta-rs's hook,
    every 10 commits) left such files stranded for good (the bench's `panes` gained ~300 over 1,500 batches). A
    batch's commits write none, whichever verb makes them (an expiry, a reprocess's restore and its transaction
    marker, a clear, files committed for Spark's tasks): only the upkeep does, right after its vacuum."""
    import pyarrow as pa
    from millpond.lake.file_commits import commit_files, live_files
    from millpond.lake.tables import Txn

    tables = Tables(settings, auto_checkpoint=False)
    name = "ckpt"
    table = tables.table(pipeline_name, name)
    schema = pa.schema([("window_end", pa.timestamp("us", tz="UTC")), ("batch", pa.int64())])

    def append_upto(version: int) -> None:  # one row a commit until the table is at ``version``
        while (table.version() if table.exists() else -1) < version:
            n = (table.version() if table.exists() else -1) + 1
            tables.append(pipeline_name, name, pa.table({"window_end": [to_datetime(T0 + n * MINUTE)], "batch": [n]},
                                                        schema=schema))

    verbs = {"expire": lambda: table.expire("window_end", T0 + 2 * MINUTE, {"batch": 0}),
             "restore": lambda: table.restore(table.version() - 3),
             "restore marker": lambda: table.restore(table.version(), txn=Txn("ckpt-test", 1)),
             "clear": lambda: table.clear("batch = 25"),
             "commit_files": lambda: commit_files(tables, pipeline_name, name, [], schema, None,
                                                  removes=live_files(tables, pipeline_name, name, table.version())[:1])}
    for i, (verb, commit) in enumerate(verbs.items()):
        append_upto(10 * i + 8)
        before = table.version()
        commit()  # the tenth commit: delta-rs's hook would checkpoint here
        assert table.version() == before + 1, verb
        checkpoints = [v for v, kind, _ in table._log() if kind == "checkpoint"]
        assert not checkpoints, (verb, checkpoints)


def test_a_vacuum_removes_the_files_a_checkpoint_forgot_but_never_one_being_written(settings, pipeline_name,
                                                                                   monkeypatch) -> None:
    """A checkpoint drops the removes older than the retention; one written just after a vacuum (the upkeep's turn)
    forgets the files that came due in between, and a vacuum that finds replaced files through the log alone never
    deletes them (the bench's lake kept a few of every table's files each cycle). A vacuum deletes every file no
    version within retention names once no file being written can be older than the retention: from when the
    batch began writing (``writes_since``; its lease keeps other batches out) plus a margin for a command's write.
    A data file written since then, and not yet committed, stays."""
    import pyarrow as pa
    from millpond.lake import table as table_mod
    from millpond.lake.snapshot_files import Storage
    from millpond.lake.spark_io import write_table

    monkeypatch.setattr(table_mod, "IN_FLIGHT_MARGIN_S", 0.5)
    tables = Tables(settings, auto_checkpoint=False)
    table, keep = tables.table(pipeline_name, "forgot"), 2.0
    for n in range(6):
        tables.append(pipeline_name, "forgot", pa.table({"window_end": [to_datetime(T0 + n * MINUTE)], "batch": [n]}))
    table.vacuum(keep)  # records the retention; nothing replaced yet
    table.expire("window_end", T0 + 3 * MINUTE, {"batch": 5})  # three files replaced
    time.sleep(keep + 1)
    tables.checkpoint(pipeline_name, "forgot")  # written after they came due, before a vacuum saw them

    def stored() -> set[str]:
        prefix = f"{settings.table_root}/{pipeline_name}/forgot/"
        return {o.key[len(prefix):] for o in ObjectStore(settings).list(settings.bucket_lake, prefix)
                if "/" not in o.key[len(prefix):]}

    live = set(pa.table(tables.open(pipeline_name, "forgot").get_add_actions(flatten=True)).column("path").to_pylist())
    assert len(live) == 3 and len(stored()) == 6
    assert table.vacuum(keep) == 0 and len(stored()) == 6  # through the log: the three are forgotten
    began = time.time()  # a batch begins writing: a file of it, not committed yet
    written = {json.loads(a)["path"] for a in write_table(
        Storage.of(settings), tables.uri(pipeline_name, "forgot"),
        pa.table({"window_end": [to_datetime(T0)], "batch": [99]}))}
    assert table.vacuum(keep, writes_since=began) == 3 and stored() == live | written
    time.sleep(keep + 1)  # the batch's file is now older than the retention: no vacuum of its batch deletes it
    assert table.vacuum(keep, writes_since=began) == 0 and stored() == live | written
