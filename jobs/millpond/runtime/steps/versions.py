"""Versions: before a batch plans, its pipeline's spec is compared with the spec that wrote the stored state.

The last committed marker records the semantic spec it ran under (``model.versions``). A change that
reinterprets stored state stops the batch before it writes anything, naming the changed fields and the
ways forward; a change that is safe by construction goes on, and this batch's marker records the new spec
(``millpond history P`` shows where it changed). A marker written before specs were recorded (state
format 1) has nothing to compare: the batch goes on and records its spec. A state format newer than this
release's is refused rather than misread.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from millpond.errors import PipelineChanged
from millpond.model.versions import STATE_FORMAT, canonical, changes, semantic_spec

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext


def spec_record(raw: dict[str, Any]) -> str:
    """The semantic spec as the marker stores it (canonical JSON)."""
    return canonical(semantic_spec(raw))


def check_spec(job: BatchContext, prev: dict[str, Any] | None) -> list[str]:
    """The safe changes since the last committed batch (recorded by this batch's marker); raises
    ``PipelineChanged`` for a change that would reinterpret the stored state."""
    if prev is None:
        return []
    written = prev.get("state_format") or 1
    if written > STATE_FORMAT:
        raise PipelineChanged(
            f"{job.name}: its state was written by a newer Millpond (state format {written}; this release reads "
            f"formats up to {STATE_FORMAT}): run this pipeline with that release or a later one")
    if not prev.get("spec"):
        return []
    old, new = json.loads(prev["spec"]), json.loads(spec_record(job.spec.raw))
    breaking, safe = changes(old, new)
    if breaking:
        raise PipelineChanged(
            f"{job.name}: the pipeline changed since batch {prev['batch']} in a way that reinterprets its stored "
            f"state ({', '.join(breaking)}); nothing was written. Ways forward: put the previous pipeline file back; "
            f"or start over under the new spec with `millpond reset {job.name}` then `millpond backfill` (the "
            "landing files are kept); or give the new spec a new name, a pipeline with tables of its own "
            "(docs/operations.md, 'Changing a pipeline')")
    return safe
