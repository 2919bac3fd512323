"""Panes: the outputs of a window's firings, values and retractions, with their timing."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NamedTuple

import pyarrow as pa

from millpond.model.timeutil import iso


class Timing(StrEnum):
    EARLY = "EARLY"
    ON_TIME = "ON_TIME"
    LATE = "LATE"


class Kind(StrEnum):
    VALUE = "value"
    RETRACTION = "retraction"


class Pane(NamedTuple):
    """One pane (a tuple: a batch builds one per firing and retraction, which a frozen dataclass makes slow)."""

    key: str
    window_start: int
    window_end: int
    value: Any
    pane_index: int
    timing: str
    is_last: bool
    kind: str
    batch: int
    processing_time: int
    watermark: int
    seq: int = 0

    def as_json(self) -> dict[str, Any]:
        out = self._asdict()
        for f in ("window_start", "window_end", "processing_time", "watermark"):
            out[f] = iso(out[f])
        return out


TS = pa.timestamp("us", tz="UTC")


def pane_schema(value_type: str) -> pa.Schema:
    """Schema of the ``panes`` table; ``value_type`` is the emitted values' type, 'int' or 'float'."""
    return pa.schema(
        [
            ("key", pa.string()),
            ("window_start", TS),
            ("window_end", TS),
            ("value", pa.int64() if value_type == "int" else pa.float64()),
            ("pane_index", pa.int64()),
            ("timing", pa.string()),
            ("is_last", pa.bool_()),
            ("kind", pa.string()),
            ("batch", pa.int64()),
            ("processing_time", TS),
            ("watermark", TS),
            ("seq", pa.int64()),
        ]
    )
