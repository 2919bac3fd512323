"""Watermark: the pipeline policy's candidate for this batch, never moving backwards (MillWheel section 5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.clock import BatchClock
from millpond.model.timeutil import to_us
from millpond.model.watermark import advance
from millpond.runtime.steps.upstream import input_watermark

if TYPE_CHECKING:
    from datetime import datetime

    from millpond.runtime.context import BatchContext


def advance_watermark(job: BatchContext, batch: int, processing_time: int, w_in: int, prev: dict[str, Any] | None,
                      accepted: pa.Table, plan: dict[str, Any], explicit: datetime | int | str | None
                      ) -> tuple[BatchClock, int | None]:
    """The batch's clock (its input watermark and the advanced one) and the largest event time seen so far."""
    event_times = accepted.column("event_time")
    batch_max = pc.max(event_times).as_py() if accepted.num_rows else None
    # arrival - event time per element: only the percentile policy reads them
    delays = (pc.subtract(accepted.column("arrival_time"), event_times).to_pylist()
              if job.spec.watermark_policy.kind == "percentile" and explicit is None else None)
    return clock_for(job, batch, processing_time, w_in, prev, batch_max, plan, explicit, delays)


def clock_for(job: BatchContext, batch: int, processing_time: int, w_in: int, prev: dict[str, Any] | None,
              batch_max: int | None, plan: dict[str, Any], explicit: datetime | int | str | None,
              delays: list[int] | None) -> tuple[BatchClock, int | None]:
    """The clock from the batch's largest event time (and delays, for the percentile policy): both engines."""
    max_et_prev = to_us(prev["max_event_time"]) if prev and prev["max_event_time"] is not None else None
    max_et = max([v for v in (batch_max, max_et_prev) if v is not None], default=None)
    if explicit is not None:
        candidate = to_us(explicit)
    elif job.spec.upstream is not None:  # a stage: the least of its upstreams' committed watermarks
        candidate = input_watermark(plan)
    else:
        candidate = job.spec.watermark_policy.candidate(
            batch_index=batch - 1, processing_time=processing_time, max_event_time=max_et,
            oldest_pending=plan["versions"].get("oldest_pending"), delays=delays)
    clock = BatchClock(batch=batch, processing_time=processing_time, input_watermark=w_in,
                       watermark=advance(w_in, candidate))
    return clock, max_et
