"""Watermark: the pipeline policy's candidate for this batch, never moving backwards (MillWheel section 5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.model.clock import BatchClock
from millpond.model.timeutil import to_us
from millpond.model.watermark import advance

if TYPE_CHECKING:
    from datetime import datetime

    from millpond.runtime.context import BatchContext


def advance_watermark(job: BatchContext, batch: int, processing_time: int, w_in: int, prev: dict[str, Any] | None,
                      accepted: pa.Table, plan: dict[str, Any], explicit: datetime | int | str | None
                      ) -> tuple[BatchClock, int | None]:
    """The batch's clock (its input watermark and the advanced one) and the largest event time seen so far."""
    event_times = accepted.column("event_time")
    max_et_prev = to_us(prev["max_event_time"]) if prev and prev["max_event_time"] is not None else None
    max_et = max(([pc.max(event_times).as_py()] if accepted.num_rows else [])
                 + ([max_et_prev] if max_et_prev is not None else []), default=None)
    if explicit is not None:
        candidate = to_us(explicit)
    else:
        policy = job.spec.watermark_policy
        # arrival - event time per element: only the percentile policy reads them
        delays = (pc.subtract(accepted.column("arrival_time"), event_times).to_pylist()
                  if policy.kind == "percentile" else None)
        candidate = policy.candidate(
            batch_index=batch - 1, processing_time=processing_time, max_event_time=max_et,
            oldest_pending=plan["versions"].get("oldest_pending"), delays=delays)
    clock = BatchClock(batch=batch, processing_time=processing_time, input_watermark=w_in,
                       watermark=advance(w_in, candidate))
    return clock, max_et
