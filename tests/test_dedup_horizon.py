"""Issue 37 (7): ``dedup.horizon`` against allowed lateness plus the window's span.

A record is accepted while its window's end (the element's own window: for sessions [t, t + gap), before
any merge) is later than the input watermark minus allowed lateness, so while its event time is later than
``watermark - allowed_lateness - span``; its id is forgotten once its event time is behind ``watermark -
horizon`` (``steps.dedup.seen_keep_from``, the watermark never moving back). No id may be forgotten while its
record can still be accepted: the horizon must be at least allowed lateness plus the span (exactly: that less
one microsecond; the default is that sum). A pipeline file with a shorter one is refused when it loads."""

from __future__ import annotations

import json

import pytest
from millpond.config.pipelines import load_pipeline, load_pipelines
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model import spec as spec_module
from millpond.model.spec import dedup_horizon_floor, pipeline_from_dict
from millpond.model.timeutil import US, iso, to_datetime, to_us
from millpond.model.versions import changes, semantic_spec
from millpond.runtime.job import run_batch
from millpond.runtime.steps.dedup import SEEN_FOLD_OVER_FILES

T0 = to_us("2026-03-02T00:00:00Z")
MINUTE = 60 * US
LATENESS, SIZE = 10 * MINUTE, MINUTE
#: the least horizon that keeps every id as long as its record can still be accepted
BOUND = LATENESS + SIZE
#: the watermark from the second batch on: half a second short of closing the window [T0, T0 + 1m) for good
#: (its end + allowed lateness), so a record of T0 is still accepted, and a horizon one second short of the
#: bound has forgotten its id. The records after the first are one minute later (the watermark's bound).
W = T0 + BOUND - US // 2


def pipeline(name: str, horizon: str | int | None = None, **extra) -> dict:
    doc = {"name": name, "source": {"prefix": f"{name}/"}, "window": {"type": "fixed", "size": "1m"},
           "aggregation": "count", "accumulation": "accumulating", "allowed_lateness": "10m", "batch_interval": "1m",
           "watermark": {"policy": "bounded_out_of_orderness", "bound": "1m"}, **extra}
    if horizon is not None:
        doc["dedup"] = {"horizon": horizon}
    return doc


def redeliver(settings, tables, spec) -> tuple[int, int, bool]:
    """Record ``a`` (event time T0) in the first batch, a fresh record in each of the next until a batch could
    replace seen_ids' files (ids expire there, if any has), then ``a`` delivered again. Returns the last batch's
    duplicates, the count of a's window in ``current``, and whether ``a``'s id was still remembered before the
    re-delivery."""
    store = ObjectStore(settings)
    name = spec.name

    def batch(m: int, rows: list[tuple[str, int]]):
        processing_time = T0 + 20 * MINUTE + m * MINUTE
        body = "".join(json.dumps({"id": i, "key": "k", "value": 1, "event_time": iso(t)}) + "\n" for i, t in rows)
        store.put_bytes(settings.bucket_landing, f"{name}/{arrival_tag(processing_time - 30 * US)}-{m}.jsonl",
                        body.encode())
        return run_batch(settings, spec, to_datetime(processing_time))

    first = batch(0, [("a", T0)])
    assert first.counts["accepted"] == 1
    for m in range(1, SEEN_FOLD_OVER_FILES + 2):  # the last of these finds more than SEEN_FOLD_OVER_FILES files
        assert batch(m, [(f"b{m}", W + MINUTE)]).counts["accepted"] == 1
    assert to_us(tables.read_arrow(name, "batches").sort_by("batch").column("watermark")[-1].as_py()) == W
    remembered = "a" in tables.read_arrow(name, "seen_ids").column("id").to_pylist()
    # folded into one file once an id (``a``) is behind W - horizon, else one file a batch (``seen_keep_from``)
    assert tables.file_count(name, "seen_ids", tables.version(name, "seen_ids")) == (
        SEEN_FOLD_OVER_FILES + 2 if remembered else 1)
    last = batch(SEEN_FOLD_OVER_FILES + 2, [("a", T0)])
    assert last.counts["late"] == 0  # still within allowed lateness: accepted unless recognised as a duplicate
    current = tables.read_arrow(name, "current").to_pylist()
    value = next(r["value"] for r in current if to_us(r["window_start"]) == T0)
    return last.counts["duplicates"], value, remembered


@pytest.mark.parametrize("horizon", [BOUND // US - 1, BOUND // US, None], ids=["bound-1s", "bound", "default"])
def test_a_horizon_that_loads_never_counts_a_redelivery_twice(settings, tables, pipeline_name, horizon) -> None:
    """Before the fix a horizon one second short of the bound loaded, forgot ``a`` and counted it twice."""
    try:
        spec = pipeline_from_dict(pipeline(pipeline_name, horizon))
    except ValueError as exc:
        assert horizon is not None and horizon * US < BOUND, exc
        assert "dedup.horizon" in str(exc) and "at least 11m" in str(exc)
        return
    duplicates, value, remembered = redeliver(settings, tables, spec)
    assert (duplicates, value) == (1, 1), f"dedup.horizon {horizon}: a re-delivery within lateness counted twice"
    assert remembered


def test_one_second_short_of_the_bound_a_redelivery_counts_twice(settings, tables, pipeline_name,
                                                                 monkeypatch) -> None:
    """Why the bound: the refused horizon, with the check switched off (the engine parses the spec again),
    forgets ``a`` while its window still accepts it, and counts it twice."""
    monkeypatch.setattr(spec_module, "check_dedup_horizon", lambda *_: None)
    spec = pipeline_from_dict(pipeline(pipeline_name, BOUND // US - 1))
    assert redeliver(settings, tables, spec) == (0, 2, False)


# -- the check, as a unit ----------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize(("extra", "horizon", "minimum"), [
    ({}, "10m", "11m"),
    ({"window": {"type": "sliding", "size": "1h", "period": "5m"}}, "1h", "70m"),
    ({"window": {"type": "sessions", "gap": "30m"}, "allowed_lateness": "2h"}, "2h", "150m"),
    ({"window": {"type": "fixed", "size": "90s"}, "allowed_lateness": 0}, 89.5, "90s"),
])
def test_a_horizon_below_the_bound_is_refused_in_one_line(extra: dict, horizon, minimum: str) -> None:
    with pytest.raises(ValueError) as caught:
        pipeline_from_dict(pipeline("p", horizon, **extra))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("dedup.horizon ") and f"set dedup.horizon to at least {minimum}" in message, message
    assert "counted twice" in message


@pytest.mark.unit
def test_a_pipeline_file_with_a_short_horizon_does_not_load(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nwindow: {type: sessions, gap: 30m}\nallowed_lateness: 2h\ndedup: {horizon: 2h}\n")
    with pytest.raises(ValueError, match=r"^p\.yaml: dedup\.horizon 2h is shorter than allowed_lateness 2h plus "
                                         r"the session gap 30m: .* at least 150m"):
        load_pipeline(path)


@pytest.mark.unit
def test_horizons_at_or_above_the_bound_and_unchecked_ones_load() -> None:
    for horizon in ("11m", 660, "1h", None):
        pipeline_from_dict(pipeline("p", horizon))
    # sessions: the gap is the span (lateness is judged on an element's own [t, t + gap), not on its session)
    pipeline_from_dict(pipeline("p", "150m", window={"type": "sessions", "gap": "30m"}, allowed_lateness="2h"))
    # a computation has no window to bound it; a custom window function without a span cannot be checked
    pipeline_from_dict({"name": "c", "computation": "millpond.examples.zeitgeist:Zeitgeist", "dedup": {"horizon": 1}})
    pipeline_from_dict(pipeline("p", 1, window={"type": "custom", "class": "millpond.model.windows:WindowFn"}))
    assert {"zeitgeist", "zeitgeist_counts"} <= set(load_pipelines())  # the shipped horizons (10m) pass


@pytest.mark.unit
def test_the_global_window_keeps_ids_for_good() -> None:
    with pytest.raises(ValueError, match=r"^dedup\.horizon 30d: the global window never closes.*remove dedup\.horizon"):
        pipeline_from_dict(pipeline("p", "30d", window={"type": "global"}))
    assert dedup_horizon_floor({"type": "sessions", "gap": "5m"}, LATENESS) == LATENESS + 5 * MINUTE


@pytest.mark.unit
def test_shortening_the_horizon_below_the_bound_is_not_a_safe_change() -> None:
    base = pipeline("p", "3h", window={"type": "sessions", "gap": "30m"}, allowed_lateness="2h")
    old = semantic_spec(base)
    assert changes(old, semantic_spec({**base, "dedup": {"horizon": "150m"}})) == ([], ["dedup"])
    assert changes(old, semantic_spec({**base, "dedup": {"horizon": "2h"}})) == (
        ["dedup.horizon (below allowed_lateness + the window's span)"], [])
    # a longer allowed lateness is safe, unless the horizon it leaves behind is now too short
    assert changes(old, semantic_spec({**base, "allowed_lateness": "150m"})) == ([], ["allowed_lateness"])
    assert changes(old, semantic_spec({**base, "allowed_lateness": "3h"})) == (
        ["dedup.horizon (below allowed_lateness + the window's span)"], ["allowed_lateness"])
