"""The report from synthetic ``batches``/``panes`` tables written through ``Tables`` (per the contract)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from millpond.errors import MillpondError
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import Tables
from millpond.surface.report import build, normalize_batches

TS = pa.timestamp("us", tz="UTC")
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
END_OF_TIME = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def m(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


# batch: (processing minute, watermark, input, accepted, duplicates, late, quarantined); as in the
# engine, input = accepted + duplicates + quarantined and the late events are among the accepted.
BATCHES = {
    1: (5, m(2), 10, 9, 1, 0, 0),
    2: (10, m(7), 12, 11, 0, 1, 1),
    3: (15, m(11), 8, 8, 0, 0, 0),
    4: (20, m(16), 6, 5, 1, 1, 0),
    5: (25, END_OF_TIME, 0, 0, 0, 0, 0),  # the flush: watermark at +infinity
}
UNCOMMITTED = (30, m(28))
# (batch, key, window start min, window end min, value, timing, kind)
PANES = [
    (1, "alice", 0, 3, 5, "EARLY", "value"),
    (1, "bob", 1, 4, 2, "EARLY", "value"),
    (2, "alice", 0, 3, 5, "EARLY", "retraction"),
    (2, "alice", 0, 3, 5, "ON_TIME", "value"),
    (2, "alice", 6, 9, 7, "EARLY", "value"),
    (2, "bob", 1, 4, 2, "ON_TIME", "value"),
    (3, "alice", 0, 3, 5, "ON_TIME", "retraction"),
    (3, "alice", 6, 9, 7, "EARLY", "retraction"),
    (3, "alice", 0, 9, 15, "ON_TIME", "value"),
    (4, "alice", 0, 9, 15, "ON_TIME", "retraction"),
    (4, "alice", 0, 9, 16, "LATE", "value"),
]


def batches_table() -> pa.Table:
    b = sorted(BATCHES)
    col = {i: [BATCHES[k][i] for k in b] for i in range(7)}
    return pa.table({
        "batch": pa.array(b, pa.int64()),
        "processing_time": pa.array([m(x) for x in col[0]], TS),
        "watermark": pa.array(col[1], TS),
        "input_watermark": pa.array(col[1], TS),
        "input": pa.array(col[2], pa.int64()),
        "accepted": pa.array(col[3], pa.int64()),
        "duplicates": pa.array(col[4], pa.int64()),
        "late": pa.array(col[5], pa.int64()),
        "quarantined": pa.array(col[6], pa.int64()),
        "panes": pa.array([sum(1 for p in PANES if p[0] == k) for k in b], pa.int64()),
        "phase_ingest_s": pa.array([0.5 + 0.1 * k for k in b]),
        "phase_window_s": pa.array([1.0] * len(b)),
        "phase_commit_s": pa.array([0.25] * len(b)),
    })


def panes_table(rows: list[tuple]) -> pa.Table:
    seq = {}
    out = []
    for r in rows:
        seq[r[0]] = seq.get(r[0], -1) + 1
        out.append(r + (seq[r[0]],))
    return pa.table({
        "key": [r[1] for r in out],
        "window_start": pa.array([m(r[2]) for r in out], TS),
        "window_end": pa.array([m(r[3]) for r in out], TS),
        "value": pa.array([r[4] for r in out], pa.int64()),
        "pane_index": pa.array([0] * len(out), pa.int64()),
        "timing": [r[5] for r in out],
        "is_last": [False] * len(out),
        "kind": [r[6] for r in out],
        "batch": pa.array([r[0] for r in out], pa.int64()),
        "processing_time": pa.array([m(BATCHES.get(r[0], UNCOMMITTED)[0]) for r in out], TS),
        "watermark": pa.array([BATCHES.get(r[0], UNCOMMITTED)[1] for r in out], TS),
        "seq": pa.array([r[7] for r in out], pa.int64()),
    })


@pytest.fixture
def lake(tables: Tables, pipeline_name: str) -> str:
    tables.append(pipeline_name, "panes", panes_table(PANES))
    # A pane of a batch that never committed (no `batches` row): the report must leave it out.
    tables.append(pipeline_name, "panes", panes_table([(6, "alice", 30, 33, 99, "EARLY", "value")]))
    tables.append(pipeline_name, "batches", batches_table())
    return pipeline_name


def cells(page: str) -> dict[tuple[int, str], int]:
    return {(int(b), c): int(v) for b, c, v in re.findall(r'<td data-batch="(\d+)" data-col="(\w+)">(\d+)</td>', page)}


def test_report_builds_and_counts_match(settings, lake: str, tmp_path) -> None:
    report = build(settings, lake, out_dir=tmp_path / "r")
    assert report.key == "alice"
    for name in ("dataflow.png", "watermark_lag.png", "counts.png", "phases.png", "index.html"):
        path = report.folder / name
        assert path.exists(), name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, name
    # The diagram is drawn, not blank: pane fills, red retractions and the blue watermark are there.
    from PIL import Image

    img = Image.open(report.folder / "dataflow.png").convert("RGB")
    colors = {c for _n, c in img.getcolors(maxcolors=1 << 20)}
    assert len(colors) > 200
    assert any(r > 180 and g < 80 and b < 80 for r, g, b in colors)  # retraction red
    assert (31, 78, 156) in colors  # the watermark curve
    page = report.index.read_text()
    got = cells(page)
    for b, (_p, _w, n_in, acc, dup, late, quar) in BATCHES.items():
        assert got[(b, "input")] == n_in and got[(b, "accepted")] == acc and got[(b, "duplicates")] == dup
        assert got[(b, "late")] == late and got[(b, "quarantined")] == quar
        assert got[(b, "dropped")] == late + quar
        assert got[(b, "panes_retractions")] == sum(1 for p in PANES if p[0] == b and p[6] == "retraction")
        assert got[(b, "panes_early")] == sum(1 for p in PANES if p[0] == b and p[5] == "EARLY" and p[6] == "value")
    assert (6, "input") not in got
    total = {k: int(v) for k, v in re.findall(r'<td id="total-(\w+)">(\d+)</td>', page)}
    assert total["input"] == sum(v[2] for v in BATCHES.values()) == 36
    assert total["panes_retractions"] == 4 and total["panes_late"] == 1
    assert total["panes_on_time"] == 3 and total["panes_early"] == 3 and total["batches"] == 5
    summary = json.loads((report.folder / "summary.json").read_text())
    assert summary["lag_min_s"] == 180.0 and summary["lag_max_s"] == 240.0  # the flush is not a lag
    assert summary["phases_s"]["commit"] == pytest.approx(1.25)
    # Published to the reports bucket.
    keys = {o.key for o in ObjectStore(settings).list(settings.bucket_reports, f"reports/{lake}/")}
    assert {f"reports/{lake}/index.html", f"reports/{lake}/dataflow.png"} <= keys


def test_date_range_and_key(settings, lake: str, tmp_path) -> None:
    report = build(settings, lake, start=m(10).isoformat(), end=m(20).isoformat(), key="bob",
                   out_dir=tmp_path / "r", upload=False)
    got = cells(report.index.read_text())
    assert sorted({b for b, _ in got}) == [2, 3]
    assert report.totals["input"] == 20 and report.key == "bob"
    with pytest.raises(MillpondError, match="no committed batches"):
        build(settings, lake, start=m(100).isoformat(), upload=False, out_dir=tmp_path / "x")


def test_cli_report_prints_the_local_path(settings, lake: str) -> None:
    run = subprocess.run([sys.executable, "-m", "millpond", "report", "--pipeline", lake], capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    path = run.stdout.split()[0]
    assert path.endswith(f"reports/{lake}/index.html") and "published to" in run.stdout
    missing = subprocess.run([sys.executable, "-m", "millpond", "report", "--pipeline", lake + "x"],
                             capture_output=True, text=True, timeout=180)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "has no batches table" in missing.stderr


def test_batches_layouts_are_normalised() -> None:
    """Counts and phases as a struct, a map or a JSON string all read the same."""
    base = {"batch": pa.array([1], pa.int64()), "processing_time": pa.array([m(5)], TS),
            "watermark": pa.array([m(3)], TS)}
    struct = pa.table({**base, "counts": pa.array([{"input": 4, "accepted": 3, "duplicates": 1}]),
                       "phases": pa.array([{"ingest": 0.5, "write": 0.25}])})
    as_json = pa.table({**base, "counts": ['{"input": 4, "accepted": 3, "duplicates": 1}'],
                        "phases": ['{"ingest": 0.5, "write": 0.25}']})
    mapped = pa.table({**base, "counts": pa.array([[("input", 4), ("accepted", 3), ("duplicates", 1)]],
                                                  pa.map_(pa.string(), pa.int64())),
                       "ingest_ms": pa.array([500.0]), "phase_write": pa.array([0.25])})
    for t in (struct, as_json, mapped):
        df = normalize_batches(t)
        row = df.iloc[0]
        assert (row["input"], row["accepted"], row["duplicates"], row["late"]) == (4, 3, 1, 0)
        assert row["phase:ingest"] == pytest.approx(0.5) and row["phase:write"] == pytest.approx(0.25)
        assert row["lag_s"] == 120.0
