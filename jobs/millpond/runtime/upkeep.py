"""Table upkeep, one step a batch from a fixed cycle: compact the tables that gain a file every batch,
checkpoint each table in turn. One cycle bounds both what a batch pays and how long a table waits (its
log tail and a compacted table's file count stay under a cycle's length). It changes no rows a reader
sees, so it runs beside the batch, which has pinned the versions it reads; best-effort: a failed step
waits for its next turn."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, wait

from millpond.errors import MillpondError
from millpond.lake.schemas import BOOKKEEPING_TABLES
from millpond.lake.tables import Tables

logger = logging.getLogger(__name__)

#: compacted once they pass COMPACT_OVER_FILES, so that what a batch pays does not grow with the number
#: of batches: the bookkeeping tables are read whole, and panes gets a file from every batch, while a
#: delta-rs commit's cost grows with the table's file count (measured: an append took 22 ms at 5 files,
#: 66 ms at 400; 23 ms at 400 versions compacted every 11 commits)
COMPACTED_TABLES = (*BOOKKEEPING_TABLES, "panes")
COMPACT_OVER_FILES = 8
#: compaction bin-packs the files below this size (delta-rs re-packs the last, unfilled bin each time, so a
#: turn rewrites at most about this much of an output that grows without bound: small, since the batch
#: waits for its upkeep step before committing; files of large batches stand alone); default: 100 MB
COMPACT_TARGET_BYTES = {"panes": 4 << 20}
#: a table's first commits replay about as fast as a checkpoint reads: its turns start at this version
CHECKPOINT_FROM_VERSION = 4


def upkeep_turns(output_tables: Sequence[str], state_tables: Sequence[str]) -> list[tuple[str, str]]:
    """The cycle: compact each of COMPACTED_TABLES (if it has more than COMPACT_OVER_FILES files), then
    checkpoint each table. (Compactions and checkpoints on separate rotations collided: every 8 batches a
    compaction took the turn of the same checkpoint, and those tables were never checkpointed.)"""
    tables = sorted(set(output_tables) | set(state_tables) | set(BOOKKEEPING_TABLES))
    return [("compact", t) for t in COMPACTED_TABLES] + [("checkpoint", t) for t in tables]


def maintain(tables: Tables, pipeline: str, batch: int, turn: tuple[str, str], first: Future | None = None) -> None:
    """One upkeep step. ``first``: a commit to the same table that must land before (one writer per table
    at a time). (``seen_ids`` is compacted by the batches' own commits to it, see ``steps.dedup``.)"""
    if first is not None:
        wait([first])
    op, table = turn
    try:
        if op == "compact":
            done = tables.compact(pipeline, table, over_files=COMPACT_OVER_FILES,
                                  target_size=COMPACT_TARGET_BYTES.get(table))
            if done:
                return
        # (a compaction turn with nothing to compact checkpoints; a log of a few commits needs none)
        tables.checkpoint(pipeline, table, min_version=CHECKPOINT_FROM_VERSION)
    except MillpondError as exc:
        logger.warning("%s: table upkeep skipped in batch %d: %s", pipeline, batch, exc)
