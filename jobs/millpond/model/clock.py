"""A batch's place in time: its index, processing time and watermarks, the inputs every firing sees."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchClock:
    batch: int
    processing_time: int
    #: the watermark before this batch (lateness is judged against it)
    input_watermark: int
    #: the watermark after this batch's advance (triggers see it)
    watermark: int
