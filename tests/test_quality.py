"""Data quality with real Great Expectations (file context, pandas) and the real object store."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest
from millpond.config import Settings
from millpond.lake.objectstore import ObjectStore
from millpond.quality import suites as qs
from millpond.quality.context import get_context
from millpond.quality.datadocs import build_data_docs, external_refs, publish_data_docs
from millpond.quality.validation import validate_batch

PT = datetime(2026, 1, 1, 13, 0, tzinfo=UTC)


def ts(s: str) -> pd.Timestamp:
    return pd.Timestamp(f"2026-01-01T{s}", tz="UTC")


def good_raw() -> pd.DataFrame:
    return pd.DataFrame({
        "id": ["e1", "e2", "e3", "e4"],
        "key": ["alice", "bob", "alice", "carol"],
        "value": [5, 3, 2, 7],
        "event_time": ["2026-01-01T12:00:30Z", "2026-01-01T12:05:00Z", 1767270000, "2026-01-01T12:59:00"],
        "arrival_time": ["2026-01-01T12:01:10Z"] * 4,
    })


def pane(key: str, start: str, end: str, value: float, idx: int, kind: str = "value", timing: str = "EARLY",
         batch: int = 2, seq: int = 0) -> dict:
    return {"key": key, "window_start": ts(start), "window_end": ts(end), "value": value, "pane_index": idx,
            "timing": timing, "is_last": False, "kind": kind, "batch": batch, "processing_time": PT,
            "watermark": PT - timedelta(minutes=2), "seq": seq}


def prior_panes() -> pd.DataFrame:
    return pd.DataFrame([pane("alice", "12:00", "12:30", 5, 0, batch=1), pane("bob", "12:05", "12:35", 3, 0, batch=1)])


def good_panes() -> pd.DataFrame:
    """Batch 2 in accumulating-and-retracting mode: retract the earlier value, then the new total."""
    return pd.DataFrame([
        pane("alice", "12:00", "12:30", 5, 1, "retraction", seq=0),
        pane("alice", "12:00", "12:30", 7, 1, "value", seq=1),
        pane("carol", "12:59", "13:29", 7, 0, "value", seq=2),
        pane("carol", "12:59", "13:29", 7, 1, "retraction", seq=3),  # retracted in the same batch
        pane("carol", "12:59", "13:30", 9, 1, "value", seq=4),
    ])


def state_row(key: str, start: str, end: str) -> dict:
    return {"key": key, "window_start": ts(start), "window_end": ts(end), "state": json.dumps({"acc": 1}),
            "event_timer": ts(end), "ptime_timer": None, "batch": 2}


def good_state() -> pd.DataFrame:
    return pd.DataFrame([state_row("alice", "12:00", "12:30"), state_row("alice", "12:40", "13:10"),
                         state_row("bob", "12:05", "12:35")])


def run(settings: Settings, pipeline: str, **frames):
    args = {"raw": None, "panes": None, "state": None, **frames}
    return validate_batch(settings, pipeline, 2, processing_time=PT, **args)


def only(messages: list[str], needle: str) -> list[str]:
    return [m for m in messages if needle in m]


# -- suites ------------------------------------------------------------------------------------
def test_committed_suites_match_definitions_and_are_not_rewritten(tmp_path: Path, settings: Settings) -> None:
    before = {p.name: p.read_bytes() for p in settings.expectations_path.glob("*.json")}
    assert set(before) == {f"{s}.json" for s in qs.SUITES}
    get_context(settings.with_overrides(home=tmp_path))  # a fresh runtime home: get-or-create only
    assert {p.name: p.read_bytes() for p in settings.expectations_path.glob("*.json")} == before
    for suite, expected in qs.suite_definitions().items():
        committed = json.loads(before[f"{suite}.json"])["expectations"]
        stripped = [{"type": e["type"], "kwargs": e["kwargs"], "meta": e["meta"]} for e in committed]
        assert qs.canonical(stripped) == qs.canonical(expected), f"{suite}.json drifted from quality_suites.py"
        assert all(e["meta"]["severity"] in (qs.CRITICAL, qs.WARNING) for e in committed)


def test_good_batch_passes(settings: Settings, pipeline_name: str) -> None:
    report = run(settings, pipeline_name, raw=good_raw(), panes=good_panes(), state=good_state(),
                 prior_panes=prior_panes())
    assert report.ok, report.critical_failures
    assert report.warnings == []
    assert report.suites == {qs.RAW: True, qs.PANES: True, qs.STATE: True}
    assert len(report.result_urls) == 3 and all(Path(u).is_file() for u in report.result_urls)
    assert 0 < report.seconds < 30


def test_pipeline_name_that_reads_like_a_date(settings: Settings) -> None:
    """GX dates a run by parsing its name when no run time is given; digits in a name must not break it."""
    report = run(settings, "t7203516975", raw=good_raw())
    assert report.ok and report.suites == {qs.RAW: True}


# -- raw input ---------------------------------------------------------------------------------
def test_raw_critical_violations(settings: Settings, pipeline_name: str) -> None:
    raw = good_raw()
    raw.loc[0, "key"] = None
    raw["event_time"] = raw["event_time"].astype(object)
    raw.loc[1, "event_time"] = "yesterday-ish"
    raw["value"] = raw["value"].astype(object)
    raw.loc[2, "value"] = "12"
    report = run(settings, pipeline_name, raw=raw)
    assert not report.ok
    assert only(report.critical_failures, "expect_column_values_to_not_be_null(key)")
    assert only(report.critical_failures, "chk_event_time_unparseable")
    assert only(report.critical_failures, "expect_column_values_to_be_in_type_list(value)")
    assert report.warnings == []


def test_raw_missing_column_is_critical(settings: Settings, pipeline_name: str) -> None:
    report = run(settings, pipeline_name, raw=good_raw().drop(columns=["event_time"]))
    [failure] = only(report.critical_failures, "expect_table_columns_to_match_set")
    assert "'missing': ['event_time']" in failure


def test_raw_implausible_times_and_duplicates_are_warnings(settings: Settings, pipeline_name: str) -> None:
    raw = good_raw()
    raw["event_time"] = raw["event_time"].astype(object)
    raw.loc[0, "event_time"] = (PT + timedelta(days=2)).isoformat()  # too far in the future
    raw.loc[1, "event_time"] = "1969-07-20T20:17:00Z"  # before 1970
    raw.loc[3, "id"] = "e1"  # a duplicate id
    report = run(settings, pipeline_name, raw=raw)
    assert report.ok, report.critical_failures
    [between] = only(report.warnings, "event_time_epoch_s")
    assert "2 of 4" in between
    assert only(report.warnings, "expect_column_values_to_be_between(chk_id_copies)")


# -- panes -------------------------------------------------------------------------------------
def test_panes_critical_violations(settings: Settings, pipeline_name: str) -> None:
    panes = good_panes()
    panes.loc[2, "timing"] = "SOON"
    panes.loc[4, "window_end"] = panes.loc[4, "window_start"]
    panes = pd.concat([panes, panes.iloc[[1]]], ignore_index=True)  # the same pane twice
    report = run(settings, pipeline_name, panes=panes, prior_panes=prior_panes())
    assert only(report.critical_failures, "expect_column_values_to_be_in_set(timing)")
    assert only(report.critical_failures, "expect_compound_columns_to_be_unique")
    assert only(report.critical_failures, "expect_column_pair_values_a_to_be_greater_than_b")


def test_mostly_late_panes_is_a_warning(settings: Settings, pipeline_name: str) -> None:
    panes = good_panes().assign(timing="LATE")
    report = run(settings, pipeline_name, panes=panes, prior_panes=prior_panes())
    assert report.ok, report.critical_failures
    assert only(report.warnings, "expect_column_values_to_not_be_in_set(timing)")


def test_retraction_matching(settings: Settings, pipeline_name: str) -> None:
    prior = prior_panes()
    # Unit level: matched, wrong value, nothing to retract, retracted twice; either sign matches.
    panes = pd.DataFrame([
        pane("alice", "12:00", "12:30", 5, 1, "retraction", seq=0),
        pane("bob", "12:05", "12:35", 4, 1, "retraction", seq=1),
        pane("dave", "12:10", "12:40", 1, 1, "retraction", seq=2),
        pane("alice", "12:00", "12:30", 5, 2, "retraction", seq=3),
    ])
    got = qs.retraction_check(panes, prior).tolist()
    assert got == [qs.MATCHED, qs.MISMATCH, qs.UNMATCHED, qs.UNMATCHED]
    negative = pd.DataFrame([pane("alice", "12:00", "12:30", -5, 1, "retraction")])
    assert qs.retraction_check(negative, prior).tolist() == [qs.MATCHED]
    # Without the pane log, retractions of earlier batches are not judged (no false alarms).
    assert qs.retraction_check(panes, None).tolist() == [None, None, None, None]
    assert qs.retraction_check(good_panes(), None).tolist() == [None, None, None, qs.MATCHED, None]

    report = run(settings, pipeline_name, panes=panes, prior_panes=prior)
    [failure] = only(report.critical_failures, "chk_retraction")
    assert "3 of 4" in failure
    assert run(settings, pipeline_name, panes=good_panes(), prior_panes=prior).ok


# -- state -------------------------------------------------------------------------------------
def test_overlapping_sessions_are_critical(settings: Settings, pipeline_name: str) -> None:
    state = pd.concat([good_state(), pd.DataFrame([state_row("alice", "12:20", "12:50")])], ignore_index=True)
    assert qs.overlaps_earlier(state, "sessions").tolist() == [False, True, False, True]
    report = run(settings, pipeline_name, state=state)
    [failure] = only(report.critical_failures, "chk_overlaps_earlier")
    assert "2 of 4" in failure
    # Sliding windows overlap by design.
    assert run(settings, pipeline_name, state=state, window_type="sliding").ok


def test_state_warning_and_bad_json(settings: Settings, pipeline_name: str) -> None:
    state = good_state()
    state.loc[0, "event_timer"] = None
    report = run(settings, pipeline_name, state=state)
    assert report.ok and only(report.warnings, "expect_column_values_to_not_be_null(event_timer)")
    state.loc[1, "state"] = "{not json"
    assert only(run(settings, pipeline_name, state=state).critical_failures, "json_parseable")


# -- Data Docs ---------------------------------------------------------------------------------
def test_data_docs_build_offline(settings: Settings, pipeline_name: str) -> None:
    report = run(settings, pipeline_name, raw=good_raw(), panes=good_panes(), state=good_state(),
                 prior_panes=prior_panes())
    index = build_data_docs(settings)
    site = index.parent
    html = index.read_text()
    for suite in qs.SUITES:
        assert suite in html
    assert f"{pipeline_name}-2" in html
    page = Path(report.result_urls[1])
    assert page.is_relative_to(site) and page.is_file()
    text = page.read_text()
    assert qs.PANES in text and "chk_retraction" in text and "must never be null" in text
    for f in [index, page, *(site / "expectations").glob("*.html")]:
        body = f.read_text()
        assert external_refs(body) == [], f
        assert not re.search(r"""<(script|link)\b[^>]*(src|href)=["']https?://""", body), f
        assert "great-expectations-web-assets" not in body
    for ref in re.findall(r"""(?:src|href)="([^"]*static/vendor/[^"]+)\"""", page.read_text()):
        assert (page.parent / ref).resolve().is_file(), ref


def test_pages_can_be_left_to_the_next_build(settings: Settings, pipeline_name: str) -> None:
    """A DAG run validates without rendering (rendering checks nothing) and renders with its publish, after
    the commit; a failed check's page is rendered at once, so the batch's error can point at it."""
    report = validate_batch(settings, pipeline_name, 7, processing_time=PT, raw=good_raw(), panes=None, state=None,
                            render=False)
    assert report.ok and len(report.pages) == 1 and not Path(report.pages[0]).exists()
    assert report.result_urls[0].endswith(".json") and Path(report.result_urls[0]).is_file()
    build_data_docs(settings)
    assert Path(report.pages[0]).is_file()
    bad = validate_batch(settings, pipeline_name, 8, processing_time=PT, raw=good_raw().drop(columns=["key"]),
                         panes=None, state=None, render=False)
    assert not bad.ok and bad.result_urls == bad.pages and Path(bad.pages[0]).is_file()


def test_results_are_pruned(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    local = settings.with_overrides(home=tmp_path, dq_keep_results=2)
    pages = [validate_batch(local, "prune", b, raw=good_raw(), panes=None, state=None).result_urls[0]
             for b in range(4)]
    kept = sorted((tmp_path / "gx" / "validations" / qs.RAW).rglob("*.json"))
    assert len(kept) == 2
    assert [Path(p).is_file() for p in pages] == [False, False, True, True]
    index = build_data_docs(local).read_text()
    assert "prune-3" in index and "prune-0" not in index


def test_publish_data_docs(settings: Settings, pipeline_name: str) -> None:
    run(settings, pipeline_name, raw=good_raw())
    n = publish_data_docs(settings)
    keys = {o.key for o in ObjectStore(settings).list(settings.bucket_reports, "data_docs/")}
    assert 0 < n <= len(keys) and len(keys) > 10
    assert publish_data_docs(settings, rebuild=False) == 0  # incremental: nothing changed, nothing sent
    validate_batch(settings, pipeline_name, 3, processing_time=PT, raw=good_raw(), panes=None, state=None)
    again = publish_data_docs(settings)
    assert 2 <= again < len(keys) // 2  # the new batch's pages and the index, not the whole site
    assert "data_docs/index.html" in keys
    assert any(k.startswith(f"data_docs/validations/{qs.RAW}/{pipeline_name}-2/") for k in keys)
    assert "data_docs/static/vendor/bootstrap/dist/css/bootstrap.min.css" in keys
    store = ObjectStore(settings)
    assert store.mc.stat_object(settings.bucket_reports, "data_docs/index.html").content_type == "text/html"
    index = store.get_bytes(settings.bucket_reports, "data_docs/index.html").decode()
    assert pipeline_name in index


def test_docs_cli_builds(settings: Settings) -> None:
    from millpond.surface.cli import main

    assert main(["docs", "--no-serve"]) == 0


def test_concurrent_validations_are_serialised(settings: Settings, pipeline_name: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        reports = list(pool.map(lambda b: validate_batch(settings, pipeline_name, b, raw=good_raw(), panes=good_panes(),
                                                         state=None, prior_panes=prior_panes(), processing_time=PT),
                                range(3)))
    assert [r.ok for r in reports] == [True, True, True]
    assert len({u for r in reports for u in r.result_urls}) == 6


def test_the_dedup_names_the_copies_column_the_raw_suite_reads() -> None:
    from millpond.runtime.steps import dedup

    assert dedup.COPIES == qs.COPIES
