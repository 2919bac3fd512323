"""How refinements relate: discarding, accumulating, accumulating-and-retracting (section 2.3).

``emit`` turns one firing of a window into panes and updates the window's state accordingly.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from .aggregations import Combiner
from .panes import Kind, Pane, Timing
from .state import WindowState


class Accumulation(StrEnum):
    DISCARDING = "discarding"
    ACCUMULATING = "accumulating"
    RETRACTING = "accumulating_and_retracting"

    @classmethod
    def parse(cls, text: str) -> Accumulation:
        aliases = {"accumulating_retracting": cls.RETRACTING, "retracting": cls.RETRACTING}
        try:
            return aliases.get(text) or cls(text)
        except ValueError:
            raise ValueError(
                f"unknown accumulation {text!r}: use discarding, accumulating or accumulating_and_retracting"
            ) from None


def timing_of(ws: WindowState, watermark: int) -> Timing:
    """EARLY before the watermark passes the window; the first pane after it is ON_TIME; then LATE."""
    if watermark < ws.window.end:
        return Timing.EARLY
    return Timing.LATE if ws.on_time_emitted else Timing.ON_TIME


def emit(
    ws: WindowState,
    mode: Accumulation,
    comb: Combiner,
    *,
    key: str,
    watermark: int,
    is_last: bool,
    make: Callable[..., Pane],
) -> list[Pane]:
    """Panes for one firing, retractions first; mutates ``ws`` (pane index, accumulator, history)."""
    timing = timing_of(ws, watermark)
    value = comb.extract(ws.acc)
    out: list[Pane] = []
    if mode is Accumulation.RETRACTING:
        owed = sorted(ws.pending, key=lambda r: (r[0], r[1]))
        for start, end, old, index in owed:
            out.append(make(key, start, end, old, index, timing, False, Kind.RETRACTION))
        if ws.last is not None:
            out.append(
                make(key, ws.window.start, ws.window.end, ws.last[0], ws.pane_index - 1, timing, False, Kind.RETRACTION)
            )
        ws.pending = []
        ws.last = [value]
    out.append(make(key, ws.window.start, ws.window.end, value, ws.pane_index, timing, is_last, Kind.VALUE))
    if timing is Timing.ON_TIME:
        ws.on_time_emitted = True
    if mode is Accumulation.DISCARDING:
        ws.acc = comb.create()
    ws.pane_index += 1
    ws.unfired = 0
    return out
