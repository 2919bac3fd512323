"""What a step may use of the batch it belongs to: the batch's context, as a protocol the steps depend on
(``MicroBatch`` provides it), so that the steps never import the batch that sequences them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import pyarrow as pa

from millpond.config import Settings
from millpond.lake.objectstore import ObjectStore, StoredObject
from millpond.lake.tables import Tables, Txn
from millpond.model.clock import BatchClock
from millpond.model.spec import PipelineSpec
from millpond.model.step import Strategy
from millpond.runtime.commits import Commits, PhaseTimer


class BatchContext(Protocol):
    settings: Settings
    spec: PipelineSpec
    strategy: Strategy
    name: str
    #: the pipeline and batch, as the task log names them
    label: str
    spark: object
    validate: bool
    #: render the validation's Data Docs pages in the batch (else the next Data Docs build renders them)
    render_docs: bool
    tables: Tables
    store: ObjectStore
    commits: Commits
    background: ThreadPoolExecutor
    output_tables: tuple[str, ...]
    state_tables: tuple[str, ...]
    #: the pipeline's per-key step: ``windows`` or ``computation``
    kind: str
    #: the batch's number (set once the plan knows it)
    batch: int

    def committed(self) -> pa.Table: ...

    def ingest_log(self) -> pa.Table: ...

    def plans_since(self, arrival: int) -> pa.Table: ...

    def landing(self, since: int | None) -> list[StoredObject]: ...

    def process(self, batch: int, txn: Txn, clock: BatchClock, accepted: pa.Table, plan: dict[str, Any],
                t: PhaseTimer, delivered: pa.Table | None = None) -> dict[str, int]:
        """The pipeline's per-key step on the local engine (windows, or a MillWheel computation): its outputs'
        commits queued under ``txn``; counts for the marker. ``delivered``: the batch's input one row per id
        (``steps.dedup.Deduped``), which a validated batch's raw suite judges."""
        ...
