"""Event and processing time as integer microseconds since the epoch (UTC).

Integers keep window arithmetic exact and the engine deterministic; tables store them as
``timestamp[us, UTC]``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

US = 1_000_000
MIN_TS = -62135596800 * US  # 0001-01-01T00:00:00Z: the global window's start
MAX_TS = 253402300799 * US + 999_999  # 9999-12-31T23:59:59.999999Z: end of time
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)?\s*$")
_UNITS = {"us": 1, "ms": 1_000, "s": US, "m": 60 * US, "h": 3600 * US, "d": 86400 * US, None: US}


def parse_duration(value: str | int | float | timedelta) -> int:
    """'90s', '5m', '1h', '2d', or seconds as a number -> microseconds."""
    if isinstance(value, timedelta):
        return int(value / timedelta(microseconds=1))
    if isinstance(value, (int, float)):
        return int(round(value * US))
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"not a duration: {value!r} (use e.g. 90s, 5m, 1h, 2d)")
    return int(round(float(match.group(1)) * _UNITS[match.group(2)]))


def to_us(value: str | int | float | datetime) -> int:
    """ISO-8601 (UTC if no zone), epoch seconds, or a datetime -> microseconds."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return (value - _EPOCH) // timedelta(microseconds=1)
    if isinstance(value, bool):
        raise ValueError(f"not a timestamp: {value!r}")
    if isinstance(value, (int, float)):
        return int(round(value * US))
    text = str(value).strip()
    if text in ("inf", "+inf", "infinity"):
        return MAX_TS
    if text in ("-inf", "-infinity"):
        return MIN_TS
    try:
        return int(round(float(text) * US))
    except ValueError:
        pass
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    return to_us(parsed)


def to_datetime(us: int) -> datetime:
    if us >= MAX_TS:
        return datetime.max.replace(tzinfo=UTC)
    if us <= MIN_TS:
        return datetime.min.replace(tzinfo=UTC)
    return _EPOCH + timedelta(microseconds=us)


def iso(us: int) -> str:
    """ISO text with a Z; the ends of time print as 'min'/'max' bounds."""
    return to_datetime(us).isoformat().replace("+00:00", "Z")
