"""The ``windows`` table on the Spark engine: which of its files a batch reads and replaces, and how it writes
them, so that a batch's cost follows its keys, not the whole stored state.

Layout: the engine writes ``windows`` as files of contiguous key ranges (range-partitioned by key, sorted by key
and window within each, about ``FILE_ROWS`` rows each), whose add actions carry key and timer statistics. A
batch reads, and copy-on-write replaces, only the files that can hold a window it may change:

- a file whose earliest event or processing-time timer is due at the batch's clock (by its statistics), or
  one without statistics: read whatever the batch's keys;
- a file whose key range (min, max) holds a key of the batch's elements: the read job's tasks tag each key with
  the files whose ranges hold it (``lake.spark_ranged.key_tags``) and read only files with a tag, so choosing
  them costs no Spark job of its own.

The other files stay as they are. Of the files read, only the rows the batch can change reach Spark, and only
the files a changed window may be in are replaced, each by a task of its own in Arrow (``lake.spark_ranged``):
the stored rows around them never pass through Spark's rows. A file that outgrows ``FILE_ROWS`` by half is
written back as pieces of about that size. Files written by the local engine's MERGE hold keys of every range;
they are read until a batch on this engine rewrites them. A file without the statistics is always read.
The table's rows are the local engine's either way: only which files hold them differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.lake.snapshot_files import data_files
from millpond.lake.spark_ranged import RangedFile
from millpond.model.clock import BatchClock

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: rows per ``windows`` file the engine writes: small enough that a batch touching few keys rewrites little,
#: large enough that a 10M-window table is a few hundred files
FILE_ROWS = 50_000
#: about how many stored windows a batch reads per element of a file it reads for its keys (those within reach
#: of the key's elements: its window and a neighbour it may merge with): an estimate that sizes tasks only
READ_PER_ELEMENT = 2
#: delta-rs may cut a string statistic to this many characters: a maximum that long is no upper bound
STATS_TRUNCATE = 32
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class StateFiles:
    """The ``windows`` files at the batch's version with their key ranges (``lake.spark_ranged``), and the numbers
    of those read whatever the batch's keys (``always``: a due timer, or no statistics). Of the others, a batch
    reads and may replace only those whose range holds one of its keys."""

    files: list[RangedFile]
    always: frozenset[int]

    def may_read(self, elements: int) -> int:
        """About how many stored rows a batch of ``elements`` accepted elements reads: every row of the files read
        whatever its keys, and of the others at most ``READ_PER_ELEMENT`` an element (not their whole size: a
        batch's cost follows its keys)."""
        due = sum(f.rows for i, f in enumerate(self.files) if i in self.always)
        rest = sum(f.rows for i, f in enumerate(self.files) if i not in self.always)
        return due + min(rest, READ_PER_ELEMENT * elements)


def _us(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return (value.replace(tzinfo=value.tzinfo or UTC) - EPOCH) // timedelta(microseconds=1)
    return int(value)


def due(action: dict[str, Any], clock: BatchClock) -> bool:
    """Whether a file may hold a window whose timer is due at ``clock`` (no statistic: it may)."""
    for column, bound in (("event_timer", clock.watermark), ("ptime_timer", clock.processing_time)):
        rows, nulls = action.get("num_records"), action.get(f"null_count.{column}")
        if rows is not None and nulls is not None and nulls >= rows:
            continue  # no timer of this kind in the file
        low = _us(action.get(f"min.{column}"))
        if low is None or low <= bound:
            return True
    return False


def _key_range(action: dict[str, Any]) -> tuple[str, str | None] | None:
    """(min, max or None for no upper bound) of a file's keys; None without statistics."""
    lo, hi = action.get("min.key"), action.get("max.key")
    if lo is None:
        return None
    return str(lo), (None if hi is None or len(str(hi)) >= STATS_TRUNCATE else str(hi))


def state_files(job: BatchContext, version: int, clock: BatchClock) -> StateFiles:
    """The files of ``windows`` at ``version``, and which of them the batch reads whatever its keys."""
    dt = job.tables.open(job.name, "windows", version)
    if dt is None:
        return StateFiles([], frozenset())
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    files = data_files(dt)  # the same order as the add actions
    always = frozenset(i for i, a in enumerate(actions) if due(a, clock) or _key_range(a) is None)
    return StateFiles([_ranged(files[i], a) for i, a in enumerate(actions)], always)


def _ranged(file: tuple[str, dict[str, Any]], action: dict[str, Any]) -> RangedFile:
    bounds = _key_range(action)
    lo, hi = bounds if bounds is not None else (None, None)
    return RangedFile(file[0], file[1], _remove(action), lo, hi, int(action.get("num_records") or 0))


def _remove(action: dict[str, Any]) -> dict[str, Any]:
    """An add action as ``file_commits.commit_files`` removes it (as ``file_commits.live_files`` gives it)."""
    return {"path": action["path"], "size": action["size_bytes"],
            "partition_values": {k[len("partition."):]: (None if v is None else str(v))
                                 for k, v in action.items() if k.startswith("partition.")}}


#: at most this many changed windows are written as one file by one task, whatever the batch's width (no range
#: bounds to sample for)
FEW_ROWS = 1_000


def file_count(rows: int) -> int:
    """How many range files ``rows`` rows of ``windows`` are written as."""
    return max(1, -(-rows // FILE_ROWS))


def ranged(df, rows: int, partitions: int = 1):
    """``df`` (at most ``rows`` rows of ``windows``) as contiguous key ranges, each sorted by key and window, one
    file each: ``file_count(rows)`` of them, at least the batch's ``partitions`` (its write's tasks), but one for
    ``FEW_ROWS`` rows or fewer (more would only start tasks, some with no row). A file's key statistics then bound
    a narrow range. (A sampling job sets the ranges' bounds; one range needs none.)"""
    ranges = max(partitions, file_count(rows)) if rows > FEW_ROWS else 1
    spread = df.repartition(1) if ranges == 1 else df.repartitionByRange(ranges, "key")
    return spread.sortWithinPartitions("key", "window_start", "window_end")
