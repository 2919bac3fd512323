"""Smoke test of the benchmark machinery (`make bench`) on a tiny workload, so it cannot rot.

No Beam, Flink or Airflow here (their own costs dwarf the workload); the full run is ``make bench`` (see
bench/README.md). The slow test runs the Spark engine's measures, its fair bare-Spark peers, Structured Streaming,
the engines-agree and stage-scale measures on one Connect server, at toy sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from millpond.lake.landing import parse_file

from bench.harness import TABLE_END, TABLE_START, Plan, ratio_table, run_bench, write_readme_table
from bench.workload import WorkloadSpec, generate, jsonl_bytes

pytestmark = pytest.mark.timeout(300)

SMOKE = Plan("smoke", session_sizes=(2_000,), fixed_sizes=(), spark_path_events=0, stream_events=0, beam=False,
             structured_streaming=False, over_time_batches=5, over_time_events=200, over_time_keys=50,
             over_time_repeats=2, tiny_events=200, tiny_runs=2, validation_events=0,
             flink_events=0, long_history_batches=12, long_history_events=10, spark_engine_events=0,
             spark_tiny_runs=0, spark_validation_events=0, spark_over_time_repeats=0, spark_stream_events=0,
             engines_agree_events=0, stage_scale_rows=0, lake_bytes_batches=16, lake_bytes_pace_s=0.0)


def test_workload_lands_as_valid_jsonl() -> None:
    spec = WorkloadSpec(events=500, keys=20, duplicate_fraction=0.1, late_fraction=0.1)
    events = generate(spec)
    assert events.num_rows == 550  # 10% delivered twice
    assert len(set(events.column("id").to_pylist())) == 500
    good, bad = parse_file("f", jsonl_bytes(events), value_type="int", file_arrival_us=spec.start_us,
                           processing_time=spec.start_us + spec.interval_us)
    assert not bad and len(good) == 550
    assert max(r[4] - r[3] for r in good) > spec.disorder_bound_s * 1_000_000  # a late tail exists


@pytest.mark.timeout(900)  # the in-process measures at smoke sizes: ~2-4 min, more on a loaded box
def test_bench_smoke(settings, spark, tmp_path) -> None:
    doc = run_bench(settings, SMOKE, spark, tmp_path, log=lambda m: None)
    json.dumps(doc, default=str)  # the document serialises
    assert doc["machine"]["cores"] and doc["machine"]["spark"]
    records = {r["measure"]: r for r in doc["records"]}
    for measure in ("tiny_batch_s", "sessions_2k_vs_spark", "sessions_1m_vs_spark", "peak_mem_10m_gib",
                    "batch5_vs_batch5", "batch12_vs_batch5"):
        rec = records[measure]
        assert set(rec) >= {"measure", "ours", "peer", "peer_name", "unit", "lower_is_better"}
        assert isinstance(rec["ours"], float | int) and rec["ours"] > 0, rec
        assert isinstance(rec["peer"], float | int) and rec["peer"] > 0, rec
    assert records["sessions_1m_vs_spark"]["notes"]  # says the largest size actually run
    assert "driver" in records["tiny_batch_s"]["path"]
    over_time = records["batch5_vs_batch5"]
    assert over_time["runs"] == 2 and len(over_time["per_run_ratio"]) == 2  # the median of two fresh sequences
    assert "tiny_batch_s" in ratio_table(doc["records"])
    for rec in doc["records"]:  # every record says its line and whether it was met; in-process ones their path
        assert rec["target"] and rec["target"] != "none set" and isinstance(rec["met"], bool), rec
        assert rec["engine"].startswith("local") and rec["path"], rec
    assert records["batch5_vs_batch5"]["met"] == (records["batch5_vs_batch5"]["ratio"] <= 1.2)
    lake = records["lake_bytes_16_vs_4"]  # the lake counted after 4 and 16 batches, per table too
    assert lake["ours"] > 0 and lake["peer"] > 0 and set(lake["tables"][1]) >= {"panes", "batches", "windows"}, lake
    assert sum(t["data_bytes"] + t["log_bytes"] for t in lake["tables"][1].values()) == lake["ours"]
    assert records["batch_time_16_vs_4_retained"]["ours"] > 0


def test_readme_table_is_regenerated_in_place(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nbody\n")
    doc = {"machine": {"date": "d", "load_average_at_start": [1.0], "load_average_at_end": [2.0], "cores": 2},
           "plan": {"name": "full"}, "duration_s": 1.0,
           "records": [{"measure": "tiny_batch_s", "ours": 0.2, "peer": 0.8, "unit": "s", "lower_is_better": True,
                        "ratio": 0.25, "path": ["driver"], "engine": "local (in-process)", "target": "<= 5 s",
                        "met": True},
                       {"measure": "x_vs_y", "ours": 3.0, "peer": 1.0, "unit": "s", "lower_is_better": True,
                        "ratio": 3.0, "engine": "spark (Connect client)", "target": "<= 1.5x", "met": False}]}
    write_readme_table(doc, readme)
    write_readme_table(doc, readme)  # replaced, not stacked
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n") and text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    assert "1 of 2 targets met" in text and "**missed**" in text and text.rstrip().endswith("body")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_spark_engine_smoke(settings, spark_connect, tmp_path) -> None:
    """The Spark-engine measures at toy sizes, on the session's Connect server, which the bench borrows and
    leaves running (``make bench`` starts and warms one of its own; a JVM start here is half a minute of a
    loaded box): the 2k-event
    batch against the bare-Spark peers, the tiny batch, validation's share, state scale; 2k events as 2
    micro-batches against Structured Streaming on the same server (availableNow per batch as its files land,
    foreachBatch to Delta via delta-rs); the engines-agree (its sessions scenario) and stage-scale measures.
    Batches and peers run in Connect clients of their own (no classic session in this process's way)."""
    plan = replace(SMOKE, spark_engine_events=2_000, spark_engine_runs=1, spark_tiny_runs=2,
                   spark_tiny_bare_runs=1, spark_validation_events=2_000, spark_validation_runs=1,
                   spark_stream_events=2_000, spark_stream_batches=2, spark_stream_runs=1, engines_agree_events=300,
                   stage_scale_rows=2_000, stage_scale_runs=1, engines_agree_fig14=False)
    doc = run_bench(settings, plan, None, tmp_path, log=lambda m: None, connect_url=spark_connect.url,
                    steps=["measure_spark_engine_sessions", "measure_spark_engine_tiny",
                           "measure_spark_engine_validation", "measure_state_scale",
                           "measure_spark_engine_structured_streaming", "measure_engines_agree",
                           "measure_stage_scale"])
    records = {r["measure"]: r for r in doc["records"]}
    assert all(isinstance(r["met"], bool) and r["target"] and r["engine"].startswith("spark") for r in records.values())
    engine = records["sessions_1m_spark_engine_vs_bare_spark"]
    assert engine["ours"] > 0 and engine["peer"] > 0 and engine["target"] and "not 1M" in engine["notes"]
    fair = records["sessions_1m_spark_engine_vs_bare_spark_executors"]  # the peer that reads on the executors
    assert fair["peer"] > 0 and fair["peer_reads"] == "executors" and fair["ours"] == engine["ours"]
    assert fair["peer_windows"] > 0  # its sessions were written (Parquet) and counted
    # 2k events: the Spark engine's one task (the 1M batch of ``make bench``: its multi-stage plan)
    assert doc["measures"]["spark_engine_sessions"]["ours"]["batches"][0]["path"] == "spark_one_task"
    assert doc["measures"]["spark_engine_sessions"]["ours"]["batches"][0]["counts"]["input"] == 2_020
    assert 0 < records["driver_rss_1m"]["ours"] < 1.5  # the client's own RSS, not the server JVM's
    tiny = records["tiny_batch_spark_engine_s"]
    assert 0 < tiny["in_process_s"] < tiny["ours"] and tiny["connect_s"] > 0 and "commit" in tiny["phases"]
    assert tiny["peer"] > 0 and tiny["peer_job_s"] > 0 and len(tiny["peer_samples"]) == 2  # start -> trivial job
    assert tiny["preload_s"] > 0  # the task's libraries imported first, as Airflow's scheduler has them, not counted
    share = records["validation_share_1m_spark"]  # the client imported what a DAG task inherits, then validated
    assert 0 < share["ours"] < 1 and share["preload_s"] > 0 and share["validation_seconds"] > 0
    assert share["shares"] == [share["ours"]]  # one run in this plan: its share is the median
    state = records["state_scale_500_batch_5k_vs_1k_windows_hot"]  # a small batch against 1k and 5k stored windows
    assert state["ours"] > 0 and state["peer"] > 0 and [r["windows_after"] for r in state["runs"]] == [1_000, 5_000]
    stream = records["sessions_2k_2batches_spark_engine_vs_structured_streaming"]
    assert stream["ours"] > 0 and stream["peer"] > 0 and isinstance(stream["met"], bool)
    assert len(stream["ours_task_seconds"]) == 2 and stream["counts"]["input"] == 2_020
    assert len(stream["peer_batch_seconds"]) == 2 and len(stream["peer_trigger_seconds"]) == 2
    assert stream["ours_runs_seconds"] == [stream["ours_seconds"]] and stream["peer_runs_seconds"] == [
        stream["peer_seconds"]], stream
    # the same tables from both Spark strategies and the local engine (300 sessions events; Figure 14 on every
    # engine is tests/test_conformance_paper.py's)
    agree = records["tables_identical_across_engines"]
    assert agree["ours"] == 0 and agree["met"] and set(agree["scenarios"]) == {"sessions_300"}, agree
    stage = records["stage_1m_rows_spark_engine_vs_bare_spark"]  # a stage batch over ~2k upstream pane rows
    assert stage["ours"] > 0 and stage["peer"] > 0 and stage["rows"] > 1_000 and stage["peer_rows"] > 1_000, stage
    assert stage["runs"] == [stage["ours"]] and stage["peer_runs"] == [stage["peer"]], stage
    assert not list((tmp_path / "spark-connect").glob("*"))  # no server of its own
    port = int(spark_connect.url.rsplit(":", 1)[1])
    assert [c for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN]


def test_client_reports_its_own_peak_rss() -> None:
    """A process spawned by a parent holding 1 GB: ``ru_maxrss`` reports the parent's peak (Linux carries it
    into the child), ``bench.connect_client.peak_rss_bytes`` the child's own."""
    root = str(Path(__file__).resolve().parents[1])
    child = (f"import resource, sys; sys.path.insert(0, {root!r}); from bench.connect_client import peak_rss_bytes; "
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_rss_bytes())")
    spawn = f"subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True).stdout"
    parent = f"import subprocess, sys; big = bytearray(1 << 30); big[::4096] = b'\\x01' * (1 << 18); print({spawn})"
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True).stdout.split()
    inherited, own = int(out[0]), int(out[1])
    assert inherited > 0.9 * (1 << 30) and own < 0.2 * (1 << 30), (inherited, own)
