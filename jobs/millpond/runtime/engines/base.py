"""The engine seam: what a batch hands the engine that runs it, what it gets back, and the interface every
engine implements (Beam's ``TriggerDriver``, Quix Streams' ``state/base``: one abstract noun, implementations
behind it, one factory that picks, ``engines.create_engine``).

``MicroBatch`` sequences a batch once: the plan (``steps.plan``), then ``Engine.run`` (read or a stage's
upstream panes, dedup, watermark, the pipeline's per-key step, its writes queued as the batch's commits), then
the commits and the marker (``MicroBatch._finish``). An engine never reaches back into the batch that called
it: it gets the batch's context (``runtime.context.BatchContext``) and a frozen ``BatchWork``, and returns
``Outputs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from millpond.lake.tables import Txn
from millpond.model.clock import BatchClock

if TYPE_CHECKING:
    from millpond.runtime.commits import PhaseTimer
    from millpond.runtime.context import BatchContext


@dataclass(frozen=True)
class BatchWork:
    """A batch as its plan fixed it: everything an engine needs that is decided before a row is read."""

    batch: int
    #: the application transaction every commit of the batch carries (fenced by the run's lease)
    txn: Txn
    #: the committed plan (``steps.plan.plan_batch``): files, upstream ranges, table versions
    plan: dict[str, Any]
    #: the marker of the batch before (None: the first)
    prev: dict[str, Any] | None
    #: the input watermark the batch starts from (us)
    w_in: int
    #: the processing time the plan pinned (us)
    processing_time: int
    #: an explicit watermark the plan pinned (None: the pipeline's policy decides)
    watermark: datetime | None
    #: the planned landing files' bytes, as listed (what sizes the batch before it is read)
    planned_bytes: int


@dataclass(frozen=True)
class Outputs:
    """What an engine returns: the marker's counts, the batch's clock, its largest event time, and who ran it."""

    counts: dict[str, Any]
    clock: BatchClock
    max_event_time: int | None
    engine: str
    strategy: str

    @property
    def label(self) -> str:
        """``engine/strategy``, as the summary line and the marker name them."""
        return f"{self.engine}/{self.strategy}"


class Engine(ABC):
    """Runs one batch's work, from its planned input to its queued commits."""

    #: ``local`` or ``spark``
    name: str

    @abstractmethod
    def strategy(self, job: BatchContext, work: BatchWork) -> str:
        """How this engine runs ``work`` (the marker records it)."""

    @abstractmethod
    def run(self, job: BatchContext, work: BatchWork, timer: PhaseTimer) -> Outputs:
        """Read, dedup, advance the watermark, run the pipeline's per-key step and queue every table's
        commit under ``work.txn`` (``job.commits``); the marker is the caller's."""
