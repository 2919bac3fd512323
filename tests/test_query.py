"""SQL over real Delta tables on the embedded store: DataFusion through delta-rs, time travel, CLI."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from millpond.errors import MillpondError
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.lake.tables import Tables
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import to_us
from millpond.runtime.job import run_batch
from millpond.surface.query import history, render, rewrite, run_query

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")


def panes(batch: int, rows: list[tuple[str, int, int]]) -> pa.Table:
    """(key, window minute, value) rows of one batch, shaped like the engine's panes table."""
    return pa.table({
        "key": [r[0] for r in rows],
        "window_start": pa.array([T0 + timedelta(minutes=r[1]) for r in rows], TS),
        "window_end": pa.array([T0 + timedelta(minutes=r[1] + 1) for r in rows], TS),
        "value": pa.array([r[2] for r in rows], pa.int64()),
        "timing": ["ON_TIME"] * len(rows),
        "batch": pa.array([batch] * len(rows), pa.int64()),
    })


@pytest.fixture
def lake(tables: Tables, pipeline_name: str) -> str:
    """Three versions of panes (v0, v1, v2) and a users table to join with."""
    tables.append(pipeline_name, "panes", panes(1, [("alice", 0, 5), ("bob", 0, 3)]))
    time.sleep(0.05)
    tables.append(pipeline_name, "panes", panes(2, [("alice", 1, 7)]))
    time.sleep(0.05)
    tables.append(pipeline_name, "panes", panes(3, [("bob", 2, 10), ("carol", 2, 1)]))
    tables.append(pipeline_name, "users", pa.table({"key": ["alice", "bob"], "team": ["red", "blue"]}))
    return pipeline_name


def test_aggregation(settings, lake: str) -> None:
    got = run_query(settings, f"SELECT key, sum(value) AS total FROM {lake}.panes GROUP BY key ORDER BY key")
    assert got.to_pylist() == [
        {"key": "alice", "total": 12}, {"key": "bob", "total": 13}, {"key": "carol", "total": 1}]


def test_join_of_two_tables(settings, lake: str) -> None:
    sql = (f"SELECT u.team, count(*) AS panes, sum(p.value) AS total FROM {lake}.panes p "
           f"JOIN {lake}.users u ON p.key = u.key GROUP BY u.team ORDER BY u.team")
    assert run_query(settings, sql).to_pylist() == [
        {"team": "blue", "panes": 2, "total": 13}, {"team": "red", "panes": 2, "total": 12}]


def test_time_travel_by_version_and_timestamp(settings, tables: Tables, lake: str) -> None:
    count = f"SELECT count(*) AS n FROM {lake}.panes"
    assert run_query(settings, count).column("n").to_pylist() == [5]
    assert run_query(settings, f"SELECT count(*) AS n FROM {lake}.panes@v0").column("n").to_pylist() == [2]
    assert run_query(settings, count, as_of="1").column("n").to_pylist() == [3]
    # The same table at two versions in one query: what batch 3 added.
    diff = run_query(settings, f"SELECT key FROM {lake}.panes EXCEPT SELECT key FROM {lake}.panes@v1 ORDER BY key")
    assert diff.column("key").to_pylist() == ["carol"]
    commits = {h["version"]: h["timestamp"] for h in tables.history(lake, "panes")}
    at_v1 = datetime.fromtimestamp(commits[1] / 1000, UTC).isoformat()
    assert run_query(settings, count, as_of=at_v1).column("n").to_pylist() == [3]
    quoted = f"SELECT count(*) AS n FROM {lake}.panes@'{at_v1}'"
    assert run_query(settings, quoted).column("n").to_pylist() == [3]


def test_history(settings, lake: str) -> None:
    h = history(settings, f"{lake}.panes")
    assert h.column("version").to_pylist() == [2, 1, 0]
    assert h.column("rows_added").to_pylist() == [2, 1, 2]
    assert set(h.column("operation").to_pylist()) <= {"WRITE", "CREATE TABLE"}
    text = render(h, "table")
    assert text.splitlines()[0].split(" | ")[0].strip() == "version" and text.endswith("(3 rows)")


def test_csv_and_json_output(settings, lake: str) -> None:
    got = run_query(settings, f"SELECT key, value, window_start FROM {lake}.panes WHERE batch = 1 ORDER BY key")
    rows = list(csv.DictReader(io.StringIO(render(got, "csv"))))
    assert rows == [
        {"key": "alice", "value": "5", "window_start": "2026-01-01T12:00:00+00:00"},
        {"key": "bob", "value": "3", "window_start": "2026-01-01T12:00:00+00:00"},
    ]
    assert json.loads(render(got, "json")) == [
        {"key": "alice", "value": 5, "window_start": "2026-01-01T12:00:00+00:00"},
        {"key": "bob", "value": 3, "window_start": "2026-01-01T12:00:00+00:00"},
    ]
    table = render(got, "table").splitlines()
    assert table[0].startswith("key") and table[-1] == "(2 rows)"
    bars = {tuple(i for i, c in enumerate(line) if c == "|") for line in [table[0], *table[2:-1]]}
    assert bars == {tuple(i for i, c in enumerate(table[1]) if c == "+")}  # columns aligned


def test_unknown_table_and_bad_sql_are_one_line_errors(settings, lake: str) -> None:
    with pytest.raises(MillpondError, match=rf"unknown table {lake}\.nope \(tables of {lake}: panes, users\)"):
        run_query(settings, f"SELECT * FROM {lake}.nope")
    with pytest.raises(MillpondError, match="query failed"):
        run_query(settings, f"SELEC * FROM {lake}.panes")


def test_a_query_looks_up_only_the_pipelines_it_names(settings, lake: str, monkeypatch) -> None:
    """The lake is listed under the dotted names' first parts only, never pipeline by pipeline: a lake of many
    pipelines would make every query list them all (here, every test's pipelines in the session's store)."""
    import millpond.surface.query as query

    monkeypatch.setattr(query, "lake_pipelines", lambda _s: pytest.fail("every pipeline of the lake was listed"))
    asked: list[str] = []
    real = query.lake_tables
    monkeypatch.setattr(query, "lake_tables", lambda s, p: asked.append(p) or real(s, p))
    got = run_query(settings, f"SELECT count(*) AS n FROM {lake}.panes p WHERE p.key = 'alice'")
    assert got.column("n").to_pylist() == [2]
    assert sorted(set(asked)) == sorted({lake, "p"})  # ``p.key``: an alias, asked about and left alone


def test_rewrite_leaves_aliases_literals_and_comments_alone() -> None:
    sql, refs = rewrite("SELECT p.key, 'a.b' FROM vs.panes@v2 p -- x.y\nJOIN other.t o ON o.k = p.key", ["vs"])
    assert sql == "SELECT p.key, 'a.b' FROM \"vs.panes@v2\" p -- x.y\nJOIN \"other.t\" o ON o.k = p.key"
    assert [(r.pipeline, r.name, r.version) for r in refs] == [("vs", "panes", 2), ("other", "t", None)]


def test_cli_query_and_unknown_table(settings, lake: str) -> None:
    cmd = [sys.executable, "-m", "millpond", "query", f"SELECT count(*) AS n FROM {lake}.panes", "--format", "json"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == [{"n": 5}]
    bad = subprocess.run(cmd[:4] + [f"SELECT * FROM {lake}.missing"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"millpond: error: unknown table {lake}.missing"), bad.stderr
    hist = subprocess.run([sys.executable, "-m", "millpond", "history", f"{lake}.panes", "--format", "csv"],
                          capture_output=True, text=True, timeout=120)
    assert hist.returncode == 0, hist.stderr
    assert [r["version"] for r in csv.DictReader(io.StringIO(hist.stdout))] == ["2", "1", "0"]


# -- reads at the last committed marker (issue 37, 8) ------------------------------------------------------
def committed_batch(settings, name: str, minute: int, keys: list[str], late: list[str] = ()) -> None:
    """A real batch of a per-minute count at ``minute`` over one landing file: one event per key a minute
    earlier (the watermark, at the processing time, closes its window: one pane per key), and one per ``late``
    key at T0 (behind the watermark of an earlier batch: a ``late`` row)."""
    spec = pipeline_from_dict({"name": name, "source": {"prefix": f"{name}/"},
                               "window": {"type": "fixed", "size": "1m"}, "aggregation": "count",
                               "watermark": {"policy": "processing_time", "lag": 0}})
    at = T0 + timedelta(minutes=minute)
    events = [(k, at - timedelta(seconds=50)) for k in keys] + [(k, T0) for k in late]
    body = "".join(json.dumps({"id": f"{k}{minute}", "key": k, "value": 1, "event_time": t.isoformat()}) + "\n"
                   for k, t in events)
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(to_us(at) - 10**6)}-{minute}.jsonl",
                                    body.encode())
    counts = run_batch(settings, spec, at).counts
    assert (counts["panes"], counts["late"]) == (len(keys), len(late))


def crash_before_marker(tables: Tables, name: str) -> None:
    """What a batch that died between its commits and its marker leaves: ``panes`` rows (here, the last batch's
    again) and the first rows of ``late``, a table the last marker names as not created yet."""
    tables.append(name, "panes", tables.read_arrow(name, "panes"))
    late = pa.table({"id": ["x"], "key": ["a"], "value": pa.array([1], pa.int64()), "event_time": pa.array([T0], TS),
                     "arrival_time": pa.array([T0], TS), "reason": ["beyond allowed lateness"],
                     "batch": pa.array([2], pa.int64())})
    tables.append(name, "late", late)


def marker_versions(tables: Tables, name: str) -> dict:
    done = tables.read_arrow(name, "batches", schema=BATCHES_SCHEMA).sort_by("batch").to_pylist()
    return json.loads(done[-1]["versions"])


def test_a_query_sees_no_half_batch(settings, tables: Tables, pipeline_name: str) -> None:
    """Tables are read at the versions the last committed marker names; time travel still reads what it names."""
    name = pipeline_name
    committed_batch(settings, name, 2, ["a", "b"])
    assert "late" in marker_versions(tables, name) and marker_versions(tables, name)["late"] is None
    crash_before_marker(tables, name)

    def count(table: str, as_of: str | None = None) -> int:
        return run_query(settings, f"SELECT count(*) AS n FROM {table}", as_of=as_of).column("n").to_pylist()[0]

    assert count(f"{name}.panes") == 2  # not the uncommitted copies
    assert count(f"{name}.late") == 0  # created by the uncommitted batch: empty, with its columns
    assert run_query(settings, f"SELECT id, reason FROM {name}.late").column_names == ["id", "reason"]
    assert count(f"{name}.batches") == 1  # not named by the marker: latest
    assert count(f"{name}.panes@v1") == 4 and count(f"{name}.panes", as_of="1") == 4  # asked for: as asked
    joined = run_query(settings, f"SELECT count(*) AS n FROM {name}.panes p JOIN {name}.late l ON p.key = l.key")
    assert joined.column("n").to_pylist() == [0]
    committed_batch(settings, name, 4, ["c"], late=["d"])  # its marker names the versions after its commits
    assert count(f"{name}.panes") == 5 and count(f"{name}.late") == 2
