"""Landing rows: one JSON object per line, parsed into elements; every bad row quarantined with its reason.

Whatever the bytes, a line ends as an element or as a quarantined row: invalid UTF-8, JSON that Python
accepts but Arrow cannot store (a lone surrogate escape such as ``"\\ud800"``), numbers or times out of
range, and any unexpected error while parsing a line (a bug: the row says so) are reasons, never a failed
batch. A vectorised parse (pyarrow.json) handles clean files; anything it does not vouch for goes to the
line-by-line parser, which gives every bad row its reason. Both give the same elements.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.timeutil import US, to_us

MAX_FUTURE = 86400 * US  # times more than a day past the batch are implausible
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: the longest raw text kept with a quarantined row
RAW_MAX = 10_000


def event_schema(value_type: str) -> pa.Schema:
    """The columns of a batch's elements (``parse_rows_table``, the dedup and the per-key step)."""
    return pa.schema([("id", pa.string()), ("key", pa.string()),
                      ("value", pa.int64() if value_type == "int" else pa.float64()),
                      ("event_time", pa.int64()), ("arrival_time", pa.int64())])


def parse_rows(key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
               ) -> tuple[list[tuple], list[tuple]]:
    """(elements, quarantined) of a file's decoded bytes.

    elements: (id, key, value, event_time_us, arrival_us, file, line)
    quarantined: (file, line, raw, reason)
    """
    table = _parse_clean_table(data, value_type, file_arrival_us, processing_time)
    if table is not None:
        n = table.num_rows
        cols = (table.column(i).to_pylist() for i in range(5))
        return list(zip(*cols, [key] * n, range(1, n + 1), strict=True)), []
    good: list[tuple] = []
    bad: list[tuple] = []
    if not data.strip():
        return good, [(key, 0, "", "empty file")]
    for lineno, raw_bytes in enumerate(data.splitlines(), start=1):
        if not raw_bytes.strip():
            continue
        row, raw, reason = parse_line(raw_bytes, value_type, file_arrival_us, processing_time)
        if reason:
            bad.append((key, lineno, raw[:RAW_MAX], reason))
        else:
            good.append((*row, key, lineno))
    return good, bad


def parse_rows_table(key: str, data: bytes, *, value_type: str, file_arrival_us: int, processing_time: int
                     ) -> tuple[pa.Table, list[tuple]]:
    """``parse_rows`` in columnar form: a table of ``event_schema`` in line order, and the quarantined rows."""
    fast = _parse_clean_table(data, value_type, file_arrival_us, processing_time)
    if fast is not None:
        return fast, []
    good, bad = parse_rows(key, data, value_type=value_type, file_arrival_us=file_arrival_us,
                           processing_time=processing_time)
    schema = event_schema(value_type)
    return pa.table([pa.array([r[i] for r in good], f.type) for i, f in enumerate(schema)], schema=schema), bad


def parse_line(raw_bytes: bytes, value_type: str, file_arrival_us: int, processing_time: int
               ) -> tuple[tuple, str, str | None]:
    """(element, raw text, reason): one line's element, or the reason it is quarantined (never raises)."""
    try:
        raw = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (), raw_bytes.decode("utf-8", "backslashreplace"), f"invalid UTF-8 at byte {exc.start}"
    try:
        row, reason = parse_event(raw, value_type, file_arrival_us, processing_time)
    except RecursionError:
        return (), raw, "malformed JSON: nested too deeply"
    except Exception as exc:  # noqa: BLE001 - a bug must cost one row, not the pipeline
        return (), raw, f"unexpected error parsing the row: {type(exc).__name__}: {str(exc)[:200]}"
    return row, raw, reason


#: arrays and objects nested deeper than this are quarantined before ``json`` parses the line: it recurses once
#: per level, and a line nested up to the interpreter's recursion limit leaves the process no stack meanwhile
#: (a garbage collection's finalizers running then fail). Jackson's and simdjson's limits are about 1000.
MAX_NESTING = 500


def too_deep(raw: str) -> bool:
    """Whether ``raw`` nests arrays or objects deeper than ``MAX_NESTING`` (brackets in strings do not count;
    a line without that many brackets is not scanned)."""
    if raw.count("[") + raw.count("{") <= MAX_NESTING:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def parse_event(raw: str, value_type: str, file_arrival_us: int, processing_time: int) -> tuple[tuple, str | None]:
    """(id, key, value, event_time, arrival) of one JSON line, or the reason it cannot be an element."""
    if too_deep(raw):
        return (), f"malformed JSON: nested more than {MAX_NESTING} levels deep"
    try:
        obj: Any = json.loads(raw)
    except ValueError as exc:
        msg = f"malformed JSON: {exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else \
            f"malformed JSON: {exc}"
        return (), msg
    if not isinstance(obj, dict):
        return (), f"not a JSON object: {type(obj).__name__}"
    missing = [f for f in ("id", "key", "value", "event_time") if obj.get(f) is None]
    if missing:
        return (), f"missing field: {', '.join(missing)}"
    for name in ("id", "key"):
        if not isinstance(obj[name], (str, int)) or isinstance(obj[name], bool):
            return (), f"wrong type: {name} must be a string or integer"
        if isinstance(obj[name], str) and not _storable(obj[name]):
            return (), f"string cannot be stored: {name} holds a lone surrogate (\\ud800-\\udfff)"
    value, reason = _value(obj["value"], value_type)
    if reason:
        return (), reason
    event_time, reason = _time(obj["event_time"], "event_time", processing_time)
    if reason:
        return (), reason
    arrival = file_arrival_us
    if obj.get("arrival_time") is not None:
        arrival, reason = _time(obj["arrival_time"], "arrival_time", processing_time)
        if reason:
            return (), reason
    return (str(obj["id"]), str(obj["key"]), value, event_time, arrival), None


def _storable(text: str) -> bool:
    """Whether Arrow (UTF-8) can hold the string: JSON escapes can make lone surrogates, which it cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _value(value: Any, value_type: str) -> tuple[Any, str | None]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"wrong type: value must be a number, got {type(value).__name__}"
    if value_type == "int":
        if isinstance(value, float):
            if not value.is_integer():
                return None, f"wrong type: value {value} is not an integer"
            value = int(value)
        if not INT64_MIN <= value <= INT64_MAX:
            return None, "value out of range for a 64-bit integer"
        return value, None
    try:
        value = float(value)
    except OverflowError:
        return None, "value out of range for a 64-bit float"
    return (value, None) if math.isfinite(value) else (None, "value is not finite")


def _time(text: Any, name: str, processing_time: int) -> tuple[int, str | None]:
    """A time in microseconds, plausible for this batch: from 1970 to a day after its processing time."""
    try:
        us = to_us(text)
    except (ValueError, TypeError, OverflowError):
        return 0, f"unparseable {name}: {str(text)[:60]!r}"
    if us < 0:
        return 0, f"implausible {name}: before 1970"
    if us > processing_time + MAX_FUTURE:
        return 0, f"implausible {name}: more than a day after the batch's processing time"
    return us, None


def _utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parse_clean_table(data: bytes, value_type: str, file_arrival_us: int, processing_time: int) -> pa.Table | None:
    """The vectorised parse as a table of ``event_schema`` (rows in line order), or None: the file has
    something to quarantine, or something the vectorised parse does not check (the line parser decides)."""
    import pyarrow.json as pj

    if not data.strip() or b"\n\n" in data or data.startswith(b"\n") or b"\r" in data or not _utf8(data):
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
    latest = processing_time + MAX_FUTURE
    if pc.min(event_us).as_py() < 0 or pc.max(event_us).as_py() > latest:
        return None
    if arrival_us is not None and (pc.min(arrival_us).as_py() < 0 or pc.max(arrival_us).as_py() > latest):
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
