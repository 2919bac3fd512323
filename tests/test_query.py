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
from millpond.lake.tables import Tables
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
