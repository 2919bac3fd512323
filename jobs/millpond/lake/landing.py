"""Ingest: landing files taken exactly once, parsed into elements; bad rows quarantined with a reason.

A file's arrival time is the ``arrival=<YYYYMMDDTHHMMSS[ffffff]Z>`` tag in its key when present
(injectors and the replay write it), else the object's last-modified time. A batch at processing
time P takes the not-yet-ingested files that arrived before P, so a backfill picks exactly the
files a live run would have picked.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.objectstore import StoredObject
from millpond.model.timeutil import US, to_us

_ARRIVAL = re.compile(r"arrival=(\d{8}T\d{6}(?:\d{6})?)Z")
MAX_FUTURE = 86400 * US  # event times more than a day past the batch are implausible
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class LandingFile:
    key: str
    arrival: int
    size: int
    etag: str


def arrival_tag(us: int) -> str:
    dt = datetime.fromtimestamp(us / US, tz=UTC)
    return f"arrival={dt.strftime('%Y%m%dT%H%M%S')}{dt.microsecond:06d}Z"


def file_arrival(obj: StoredObject) -> int:
    match = _ARRIVAL.search(obj.key)
    if match:
        text = match.group(1)
        dt = datetime.strptime(text[:15], "%Y%m%dT%H%M%S").replace(tzinfo=UTC)
        return to_us(dt) + (int(text[15:]) if len(text) > 15 else 0)
    return int(obj.last_modified * US)


def parse_file(
    key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
) -> tuple[list[tuple], list[tuple]]:
    """(elements, quarantined) of one JSONL file.

    elements: (id, key, value, event_time_us, arrival_us, file, line)
    quarantined: (file, line, raw, reason)
    """
    fast = _parse_clean_file(key, data, value_type, file_arrival_us, processing_time)
    if fast is not None:
        return fast, []
    good: list[tuple] = []
    bad: list[tuple] = []
    if not data.strip():
        bad.append((key, 0, "", "empty file"))
        return good, bad
    for lineno, raw_bytes in enumerate(data.splitlines(), start=1):
        if not raw_bytes.strip():
            continue
        raw = raw_bytes.decode("utf-8", errors="replace")
        row, reason = parse_event(raw, value_type, file_arrival_us, processing_time)
        if reason:
            bad.append((key, lineno, raw[:10_000], reason))
        else:
            good.append((*row, key, lineno))
    return good, bad


def parse_file_table(
    key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
) -> tuple[pa.Table, list[tuple]]:
    """``parse_file`` in columnar form: (elements, quarantined) of one JSONL file.

    elements: a table of EVENT_SCHEMA (times in microseconds) in line order
    quarantined: (file, line, raw, reason)
    """
    fast = _parse_clean_table(data, value_type, file_arrival_us, processing_time)
    if fast is not None:
        return fast, []
    good, bad = parse_file(key, data, value_type=value_type, file_arrival_us=file_arrival_us,
                           processing_time=processing_time)
    schema = event_schema(value_type)
    return pa.table([pa.array([r[i] for r in good], f.type) for i, f in enumerate(schema)], schema=schema), bad


def event_schema(value_type: str) -> pa.Schema:
    """The columns of a batch's elements (``parse_file_table``, the dedup and the per-key step)."""
    return pa.schema([("id", pa.string()), ("key", pa.string()),
                      ("value", pa.int64() if value_type == "int" else pa.float64()),
                      ("event_time", pa.int64()), ("arrival_time", pa.int64())])


def _parse_clean_file(key: str, data: bytes, value_type: str, file_arrival_us: int,
                      processing_time: int) -> list[tuple] | None:
    """Vectorised parse (pyarrow.json) of a file with nothing to quarantine; None sends the file to the
    line-by-line parser, which gives every bad row its reason. Both give the same elements."""
    table = _parse_clean_table(data, value_type, file_arrival_us, processing_time)
    if table is None:
        return None
    n = table.num_rows
    return list(zip(*(table.column(i).to_pylist() for i in range(5)), [key] * n, range(1, n + 1), strict=True))


def _parse_clean_table(data: bytes, value_type: str, file_arrival_us: int, processing_time: int) -> pa.Table | None:
    """The vectorised parse as a table of ``event_schema`` (rows in line order), or None (see above)."""
    import pyarrow.json as pj

    if not data.strip() or b"\n\n" in data or data.startswith(b"\n") or b"\r" in data:
        return None
    out_schema = event_schema(value_type)
    schema = pa.schema([out_schema.field("id"), out_schema.field("key"), out_schema.field("value"),
                        ("event_time", pa.string()), ("arrival_time", pa.string())])
    try:
        table = pj.read_json(pa.BufferReader(data), parse_options=pj.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore"))
        if any(table.column(c).null_count for c in ("id", "key", "value", "event_time")):
            return None
        ts = pa.timestamp("us", tz="UTC")
        event_us = pc.cast(table.column("event_time"), ts).cast(pa.int64())
        arrival_col = table.column("arrival_time")
        arrival_us = pc.cast(arrival_col, ts).cast(pa.int64()) if arrival_col.null_count < len(arrival_col) else None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    if table.num_rows != data.count(b"\n") + (0 if data.endswith(b"\n") else 1):
        return None
    if pc.min(event_us).as_py() < 0 or pc.max(event_us).as_py() > processing_time + MAX_FUTURE:
        return None
    if value_type == "float" and not pc.all(pc.is_finite(table.column("value"))).as_py():
        return None
    n = table.num_rows
    if arrival_us is None:
        arrivals = pa.chunked_array([pa.array(np.full(n, file_arrival_us, dtype=np.int64))])
    elif arrival_col.null_count:
        arrivals = pc.fill_null(arrival_us, file_arrival_us)
    else:
        arrivals = arrival_us
    return pa.table([table.column("id"), table.column("key"), table.column("value"), event_us, arrivals],
                    schema=out_schema)


def parse_event(raw: str, value_type: str, file_arrival_us: int, processing_time: int) -> tuple[tuple, str | None]:
    try:
        obj: Any = json.loads(raw)
    except ValueError as exc:
        return (), f"malformed JSON: {exc.msg} at column {exc.colno}"
    if not isinstance(obj, dict):
        return (), f"not a JSON object: {type(obj).__name__}"
    missing = [f for f in ("id", "key", "value", "event_time") if obj.get(f) is None]
    if missing:
        return (), f"missing field: {', '.join(missing)}"
    if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        return (), "wrong type: id must be a string or integer"
    if not isinstance(obj["key"], (str, int)) or isinstance(obj["key"], bool):
        return (), "wrong type: key must be a string or integer"
    value = obj["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return (), f"wrong type: value must be a number, got {type(value).__name__}"
    if value_type == "int":
        if isinstance(value, float):
            if not value.is_integer():
                return (), f"wrong type: value {value} is not an integer"
            value = int(value)
        if abs(value) > INT64_MAX:
            return (), "value out of range for a 64-bit integer"
    else:
        value = float(value)
        if not math.isfinite(value):
            return (), "value is not finite"
    try:
        event_time = to_us(obj["event_time"])
    except (ValueError, TypeError, OverflowError):
        return (), f"unparseable event_time: {str(obj['event_time'])[:60]!r}"
    if event_time < 0:
        return (), "implausible event_time: before 1970"
    if event_time > processing_time + MAX_FUTURE:
        return (), "implausible event_time: more than a day after the batch's processing time"
    arrival = file_arrival_us
    if obj.get("arrival_time") is not None:
        try:
            arrival = to_us(obj["arrival_time"])
        except (ValueError, TypeError, OverflowError):
            return (), f"unparseable arrival_time: {str(obj['arrival_time'])[:60]!r}"
    return (str(obj["id"]), str(obj["key"]), value, event_time, arrival), None
