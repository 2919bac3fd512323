"""Per-window state: the accumulator, trigger state and emission history of one (key, window).

Kept as a JSON column in the ``windows`` Delta table with its timers beside it, so a batch loads
only the rows of keys it touches or whose timers are due (the state scales with live windows,
never with history).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from millpond.model.panes import TS
from millpond.model.windows import Window

#: ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` without building an encoder per call
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def encode_json(value: Any) -> str:
    """``value`` as the ``windows`` table's JSON writes it (keys sorted, no spaces)."""
    return _ENCODER.encode(value)


@dataclass
class WindowState:
    window: Window
    acc: Any
    trigger: dict[str, dict[str, Any]] = field(default_factory=dict)
    pane_index: int = 0
    #: last emitted value, for retractions ([value] once something was emitted)
    last: list[Any] | None = None
    #: retractions owed for windows merged into this one: [start, end, value]
    pending: list[list[Any]] = field(default_factory=list)
    on_time_emitted: bool = False
    #: elements added since the last firing (a GC firing happens only if > 0)
    unfired: int = 0
    closed: bool = False

    def to_json(self) -> str:
        return _ENCODER.encode(
            {
                "acc": self.acc,
                "trig": self.trigger,
                "pane": self.pane_index,
                "last": self.last,
                "pend": self.pending,
                "ontime": self.on_time_emitted,
                "unfired": self.unfired,
                "closed": self.closed,
            }
        )

    @classmethod
    def from_json(cls, window: Window, text: str) -> WindowState:
        d = json.loads(text)
        return cls(
            window=window,
            acc=d["acc"],
            trigger=d["trig"],
            pane_index=d["pane"],
            last=d["last"],
            pending=d["pend"],
            on_time_emitted=d["ontime"],
            unfired=d["unfired"],
            closed=d["closed"],
        )


#: a stored window's key in the ``windows`` table (its MERGE key; the order of the rows within a file)
WINDOW_KEY = ("key", "window_start", "window_end")
WINDOWS_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("window_start", TS),
        ("window_end", TS),
        ("state", pa.string()),
        ("event_timer", TS),
        ("ptime_timer", TS),
        ("batch", pa.int64()),
        ("deleted", pa.bool_()),
    ]
)
