"""How refinements relate: discarding, accumulating, accumulating-and-retracting (section 2.3).

``emit`` turns one firing of a window into panes and updates the window's state accordingly.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from millpond.model.aggregations import Combiner
from millpond.model.clock import BatchClock
from millpond.model.panes import Kind, Pane, Timing
from millpond.model.state import WindowState


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


def timing_of(ws: WindowState, input_watermark: int, watermark: int) -> Timing:
    """EARLY before the watermark passes the window's end; ON_TIME for the pane fired in the batch
    whose watermark passes it (once); LATE for every pane after that, including the first pane of a
    window whose end the watermark had passed before it ever fired (Beam's rule)."""
    if watermark < ws.window.end:
        return Timing.EARLY
    if ws.on_time_emitted or input_watermark >= ws.window.end:
        return Timing.LATE
    return Timing.ON_TIME


def emit(
    ws: WindowState,
    mode: Accumulation,
    comb: Combiner,
    *,
    key: str,
    clock: BatchClock,
    is_last: bool,
    make: Callable[..., Pane],
) -> list[Pane]:
    """Panes for one firing, retractions first; mutates ``ws`` (pane index, accumulator, history)."""
    timing = timing_of(ws, clock.input_watermark, clock.watermark)
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
