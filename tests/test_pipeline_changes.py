"""A changed pipeline is caught (issue 22): a batch whose spec would reinterpret the stored state stops
before writing anything and names the change; a safe change goes on and is recorded; ``millpond history P``
shows where the spec changed; a marker written before specs were recorded is read, not misread."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from millpond.errors import PipelineChanged
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import BATCHES_SCHEMA
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, to_datetime, to_us
from millpond.model.versions import STATE_FORMAT
from millpond.runtime.job import run_batch
from millpond.surface.inputs import history

T0 = to_us("2026-03-01T12:00:00Z")
MINUTE = 60 * US


def spec(name: str, **changed):
    doc = {"name": name, "window": {"type": "fixed", "size": "1m"}, "aggregation": "sum", "value_type": "int",
           "trigger": "AtWatermark()", "allowed_lateness": "1m", "source": {"prefix": f"{name}/"}}
    return pipeline_from_dict({**doc, **changed})


def land(settings, name: str, n: int) -> None:
    body = "".join(json.dumps({"id": f"{n}-{i}", "key": "k", "value": i, "event_time": to_datetime(T0 + n * MINUTE + i)
                               .isoformat()}) + "\n" for i in range(3))
    key = f"{name}/{arrival_tag(T0 + n * MINUTE + 30 * US)}-f{n}.jsonl"
    ObjectStore(settings).put_bytes(settings.bucket_landing, key, body.encode())


def versions(tables, name: str) -> dict[str, int | None]:
    return {t: tables.version(name, t) for t in ("ingest_log", "panes", "windows", "batches", "seen_ids")}


def test_a_breaking_change_stops_before_writing_and_a_safe_one_is_recorded(settings, tables, pipeline_name) -> None:
    name = pipeline_name
    land(settings, name, 0)
    run_batch(settings, spec(name), to_datetime(T0 + 5 * MINUTE))
    before = versions(tables, name)
    land(settings, name, 1)
    for changed, field in (({"window": {"type": "fixed", "size": "2m"}}, "window"),
                           ({"trigger": "AtWatermark(early=AtCount(2))"}, "trigger"),
                           ({"accumulation": "discarding"}, "accumulation"), ({"aggregation": "max"}, "aggregation"),
                           ({"value_type": "float"}, "value_type"), ({"allowed_lateness": "0s"}, "allowed_lateness")):
        with pytest.raises(PipelineChanged, match=rf"changed since batch 1 .*\({field}.*nothing was written.*reset"):
            run_batch(settings, spec(name, **changed), to_datetime(T0 + 6 * MINUTE))
        assert versions(tables, name) == before, field  # no table moved: not even the plan
    safe = spec(name, allowed_lateness="2h", description="longer lateness")
    run_batch(settings, safe, to_datetime(T0 + 6 * MINUTE))
    land(settings, name, 2)
    run_batch(settings, safe, to_datetime(T0 + 7 * MINUTE))
    done = tables.read_arrow(name, "batches").sort_by("batch")
    assert done.column("state_format").to_pylist() == [STATE_FORMAT] * 3
    assert done.column("accepted").to_pylist() == [3, 3, 3]
    batches, _ = history(settings, name)
    assert batches.column("spec_change").to_pylist() == ["recorded", "description, allowed_lateness", ""]
    with pytest.raises(PipelineChanged, match="since batch 3"):  # the recorded spec is now the longer lateness
        run_batch(settings, spec(name, allowed_lateness="1m"), to_datetime(T0 + 8 * MINUTE))


def test_a_marker_without_a_spec_is_read_and_a_newer_format_refused(settings, tables, pipeline_name) -> None:
    name = pipeline_name
    land(settings, name, 0)
    old_marker = pa.schema([f for f in BATCHES_SCHEMA if f.name not in ("skipped", "spec", "state_format")])
    p0 = T0 + 2 * MINUTE
    tables.append(name, "batches", pa.Table.from_pylist([{
        "batch": 1, "processing_time": to_datetime(p0), "watermark": to_datetime(p0 - MINUTE), "files": 0, "input": 0,
        "accepted": 0, "duplicates": 0, "late": 0, "quarantined": 0, "panes": 0, "retractions": 0,
        "state_rows_read": 0, "phases": "{}", "versions": "{}"}], schema=old_marker))
    run_batch(settings, spec(name), to_datetime(T0 + 5 * MINUTE))  # format 1: nothing to compare, goes on
    done = tables.read_arrow(name, "batches").sort_by("batch")
    assert done.column("state_format").to_pylist() == [None, STATE_FORMAT]
    assert done.column("accepted").to_pylist() == [0, 3]
    batches, _ = history(settings, name)
    assert batches.column("spec_change").to_pylist() == ["", "recorded"]
    newer = done.slice(1).to_pylist()[0] | {"batch": 3, "state_format": STATE_FORMAT + 1}
    tables.append(name, "batches", pa.Table.from_pylist([newer], schema=done.schema))
    with pytest.raises(PipelineChanged, match=f"newer Millpond \\(state format {STATE_FORMAT + 1}"):
        run_batch(settings, spec(name), to_datetime(T0 + 9 * MINUTE))
