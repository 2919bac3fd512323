"""The low watermark: a monotonic bound on the event times still to come (MillWheel section 5).

Each batch's watermark comes from a policy and never moves backwards. Policies derived from the
batch's processing time make a backfill reproduce the live run exactly (the watermark is
"simulated" from the run's data interval rather than read off a wall clock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from millpond.model.timeutil import MAX_TS, MIN_TS, parse_duration, to_us


@dataclass(frozen=True)
class WatermarkPolicy:
    kind: str
    lag: int = 0
    values: tuple[int, ...] = ()
    percentile: float = 100.0

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None) -> WatermarkPolicy:
        cfg = dict(cfg or {"policy": "processing_time", "lag": 0})
        kind = cfg.get("policy", "processing_time")
        if kind == "processing_time":
            return cls(kind, lag=parse_duration(cfg.get("lag", 0)))
        if kind == "bounded_out_of_orderness":
            return cls(kind, lag=parse_duration(cfg.get("bound", 0)))
        if kind == "explicit":
            return cls(kind, values=tuple(to_us(v) for v in cfg.get("values", [])))
        if kind == "perfect":
            return cls(kind)
        if kind == "injector":
            return cls(kind, lag=parse_duration(cfg.get("bound", 0)))
        if kind == "percentile":
            pct = float(cfg.get("percentile", 99))
            if not 0 < pct <= 100:
                raise ValueError("percentile watermark: percentile must be in (0, 100]")
            return cls(kind, lag=parse_duration(cfg.get("fallback_lag", 0)), percentile=pct)
        raise ValueError(
            f"unknown watermark policy {kind!r}: use processing_time, bounded_out_of_orderness, injector, "
            "percentile, explicit or perfect"
        )

    def candidate(self, *, batch_index: int, processing_time: int, max_event_time: int | None,
                  oldest_pending: int | None = None, delays: list[int] | None = None) -> int:
        """This policy's estimate for a batch, before the monotonic clamp.

        ``oldest_pending``: arrival of the oldest landing file still being written (``*.inprogress``):
        the injector cannot promise anything after it (MillWheel's log-file injector). ``delays``:
        arrival minus event time of the batch's elements, for the percentile watermark.
        """
        if self.kind == "processing_time":
            return processing_time - self.lag
        if self.kind == "injector":
            horizon = processing_time if oldest_pending is None else min(processing_time, oldest_pending)
            return horizon - self.lag
        if self.kind == "percentile":
            if not delays:
                return processing_time - self.lag
            ordered = sorted(delays)
            rank = min(len(ordered) - 1, max(0, int(round(self.percentile / 100 * len(ordered))) - 1))
            return processing_time - max(0, ordered[rank])
        if self.kind == "bounded_out_of_orderness":
            return MIN_TS if max_event_time is None else max_event_time - self.lag
        if self.kind == "explicit":
            if batch_index >= len(self.values):
                return MAX_TS
            return self.values[batch_index]
        return MIN_TS


def advance(previous: int, candidate: int) -> int:
    """Watermarks are monotonic: a policy can hold it back, never pull it back."""
    return max(previous, candidate)
