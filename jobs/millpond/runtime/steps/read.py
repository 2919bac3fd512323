"""Read: the planned landing files, fetched and parsed in parallel; bad rows set aside with their reason."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.lake.landing import event_schema, parse_file_table

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext


def read_files(job: BatchContext, plan: dict[str, Any], processing_time: int) -> tuple[pa.Table, list[tuple]]:
    """The planned files' elements as one table (files in key order, each in line order: a stable sort by
    arrival then orders by (arrival, file, line)) and the quarantined rows."""
    def one(item: tuple[str, int]) -> tuple[pa.Table, list[tuple]]:
        key, arrival = item
        data = job.store.get_bytes(job.settings.bucket_landing, key)
        return parse_file_table(key, data, value_type=job.spec.value_type, file_arrival_us=arrival,
                                processing_time=processing_time)

    parts: dict[str, pa.Table] = {}
    bad: list[tuple] = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for key, (g, b) in zip(plan["files"], pool.map(one, zip(plan["files"], plan["arrivals"], strict=True)),
                               strict=True):
            parts[key] = g
            bad += b
    if not parts:
        return event_schema(job.spec.value_type).empty_table(), bad
    return pa.concat_tables([parts[k] for k in sorted(parts)]), bad
