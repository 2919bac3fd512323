"""Read: the planned landing files, fetched and parsed in parallel; bad rows set aside with their reason.

A file never fails the batch for its content (``lake.landing``); one that cannot be read at all, a file
deleted since it was planned, and a file an operator held (``millpond quarantine-file``) each become one
quarantined row naming the file and why (line 0)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.errors import ObjectMissing
from millpond.lake.landing import event_schema, missing_file, parse_file_table
from millpond.runtime import progress

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

HELD = "quarantined by an operator"


def held_rows(plan: dict[str, Any]) -> list[tuple]:
    """The quarantined rows of the files an operator held for this batch (both engines)."""
    return [(key, 0, "", f"{HELD}: {reason}" if reason else HELD) for key, reason in sorted(plan["held"].items())]


def read_files(job: BatchContext, plan: dict[str, Any], processing_time: int) -> tuple[pa.Table, list[tuple]]:
    """The planned files' elements as one table (files in key order, each in line order: a stable sort by
    arrival then orders by (arrival, file, line)) and the quarantined rows."""
    def one(item: tuple[str, int]) -> tuple[pa.Table, list[tuple]]:
        key, arrival = item
        try:
            data = job.store.get_bytes(job.settings.bucket_landing, key)
            return parse_file_table(key, data, value_type=job.spec.value_type, file_arrival_us=arrival,
                                    processing_time=processing_time)
        except ObjectMissing:
            return event_schema(job.spec.value_type).empty_table(), [missing_file(key)]
        except Exception as exc:
            exc.add_note(f"millpond: file {key}")  # for the batch's one-line failure (``runtime.failure``)
            raise

    parts: dict[str, pa.Table] = {}
    bad: list[tuple] = held_rows(plan)
    tick = progress.counter(job.label, "ingest", len(plan["files"]), "files")
    pool = ThreadPoolExecutor(max_workers=8)
    try:
        for key, (g, b) in zip(plan["files"], pool.map(one, zip(plan["files"], plan["arrivals"], strict=True)),
                               strict=True):
            parts[key] = g
            bad += b
            tick(g.num_rows + len(b))
    finally:
        # On a failure (a store that stopped answering), files not yet started are dropped, not each waited
        # for in turn: the batch fails within one store wait.
        pool.shutdown(wait=True, cancel_futures=True)
    if not parts:
        return event_schema(job.spec.value_type).empty_table(), bad
    return pa.concat_tables([parts[k] for k in sorted(parts)]), bad
