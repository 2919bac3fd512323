"""The commit path's shortcuts keep its contract: the marker names, for every output table, the
version holding exactly the batches up to its own; a MERGE into a table that does not exist yet is one
plain write with the same rows, settings and transaction id."""

from __future__ import annotations

import json

import pyarrow as pa
from deltalake import DeltaTable
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import OUTPUT_TABLES
from millpond.lake.tables import Tables, Txn
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_us
from millpond.runtime.job import run_batch
from test_state_bounds import land, minute


def test_merge_into_a_new_table_is_one_write(tables: Tables, pipeline_name: str) -> None:
    source = pa.table({"k": ["a", "b", "c", "d"], "p": ["x", "x", "y", "y"], "v": [1, 2, 3, 4],
                       "gone": [False, True, None, False]})
    txn = Txn(pipeline_name, 3)
    metrics = tables.merge(pipeline_name, "t", source, on=["k"], delete_when="s.gone", txn=txn,
                           partition_by=["p"], stats_columns=["k"])
    assert metrics["num_target_rows_inserted"] == 2  # b is deleted, c's null flag matches neither clause
    assert sorted(tables.read_arrow(pipeline_name, "t").column("k").to_pylist()) == ["a", "d"]
    dt = DeltaTable(tables.uri(pipeline_name, "t"), storage_options=tables.options)
    assert dt.version() == 0 and dt.transaction_version(pipeline_name) == 3
    assert dt.metadata().partition_columns == ["p"]
    assert dt.metadata().configuration["delta.dataSkippingStatsColumns"] == "k"
    assert dt.metadata().name == f"{pipeline_name}.t"
    assert tables.merge(pipeline_name, "t", source, on=["k"], delete_when="s.gone", txn=txn) is None  # the retry
    # From then on a real MERGE: updates, deletes and inserts by key.
    change = pa.table({"k": ["a", "d", "e"], "p": ["x", "y", "y"], "v": [10, 0, 5], "gone": [False, True, False]})
    tables.merge(pipeline_name, "t", change, on=["k"], delete_when="s.gone", txn=Txn(pipeline_name, 4))
    got = {r["k"]: r["v"] for r in tables.read_arrow(pipeline_name, "t").to_pylist()}
    assert got == {"a": 10, "e": 5}
    assert [h["operation"] for h in tables.history(pipeline_name, "t")][0] == "MERGE"


def test_a_predicate_other_than_a_flag_column_goes_through_merge(tables: Tables, pipeline_name: str) -> None:
    source = pa.table({"k": ["a", "b"], "v": [1, -1]})
    tables.merge(pipeline_name, "t", source, on=["k"], delete_when="s.v < 0")
    assert tables.read_arrow(pipeline_name, "t").column("k").to_pylist() == ["a"]
    assert [h["operation"] for h in tables.history(pipeline_name, "t")] == ["MERGE", "CREATE TABLE"]


def test_marker_names_the_version_of_each_table_as_of_its_batch(settings, tables, pipeline_name, monkeypatch) -> None:
    spec = pipeline_from_dict({"name": pipeline_name, "window": {"type": "sessions", "gap": "5m"},
                               "accumulation": "accumulating_and_retracting", "allowed_lateness": "10m",
                               "trigger": "AtWatermark()", "source": {"prefix": f"{pipeline_name}/"}})
    store = ObjectStore(settings)
    land(settings, pipeline_name, minute(9), [("a", "k", 1, 1), ("b", "j", 1, 2)])
    bad = f"{pipeline_name}/{arrival_tag(to_us(minute(9)))}-bad.jsonl"
    store.put_bytes(settings.bucket_landing, bad, b"{not json\n")
    asked: list[str] = []  # the tables whose latest version the store is asked for
    real = Tables.version
    monkeypatch.setattr(Tables, "version", lambda self, p, n: asked.append(n) or real(self, p, n))
    run_batch(settings, spec, minute(10), watermark=minute(0))
    # Before the first marker, no output table but the plan's can exist: the first batch asks for none.
    assert sorted(n for n in asked if n in OUTPUT_TABLES) == ["seen_ids", "windows"]  # (the plan's state versions)
    land(settings, pipeline_name, minute(19), [("c", "k", 2, 3)])
    asked.clear()
    run_batch(settings, spec, minute(20), watermark=minute(30))  # both sessions fire and are collected
    # Batch 1's marker found `late` absent: no batch has created it since, so batch 2 need not ask.
    assert "quarantine" in asked and "late" not in asked
    land(settings, pipeline_name, minute(29), [("d", "k", 4, 1), ("e", "i", 1, 31)])  # d: beyond lateness
    run_batch(settings, spec, minute(30), watermark=minute(30))
    markers = tables.read_arrow(pipeline_name, "batches").sort_by("batch").to_pylist()
    assert [m["late"] for m in markers] == [0, 0, 1] and markers[0]["quarantined"] == 1
    for m in markers:
        for table, version in json.loads(m["versions"]).items():
            uri = tables.uri(pipeline_name, table)
            if version is None:  # no batch up to this one wrote it
                assert not any(json.loads(n["versions"]).get(table) is not None for n in markers
                               if n["batch"] <= m["batch"])
                continue
            # Every later version of the table belongs to a later batch (or is upkeep that changes no data).
            history = {h["version"]: h for h in DeltaTable(uri, storage_options=tables.options).history()}
            for v in range(version + 1, max(history) + 1):
                txn = DeltaTable(uri, version=v, storage_options=tables.options).transaction_version(
                    f"millpond/{pipeline_name}")
                assert history[v]["operation"] == "OPTIMIZE" or (txn or 0) > m["batch"], (table, m["batch"], v)
            # ... and the named version holds this batch's commit when the batch wrote the table.
            at = DeltaTable(uri, version=version, storage_options=tables.options)
            assert (at.transaction_version(f"millpond/{pipeline_name}") or 0) <= m["batch"]
        counts = {"panes": m["panes"], "quarantine": m["quarantined"], "late": m["late"], "ingest_log": 1}
        wrote = {table for table, n in counts.items() if n}
        for table in wrote:
            at = DeltaTable(tables.uri(pipeline_name, table), version=json.loads(m["versions"])[table],
                            storage_options=tables.options)
            assert at.transaction_version(f"millpond/{pipeline_name}") == m["batch"], table
