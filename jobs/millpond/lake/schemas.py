"""The contracts of a pipeline's bookkeeping and output tables: their Arrow schemas and their roles.

Every reader and writer of these tables takes the schema from here (``docs/contracts.md`` describes them
for other engines)."""

from __future__ import annotations

import pyarrow as pa

from millpond.model.panes import TS

PLAN_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        ("processing_time", TS),
        ("files", pa.list_(pa.string())),
        ("file_arrivals", pa.list_(pa.int64())),
        ("versions", pa.string()),
        # added later (null in rows written before): JSON objects {file: reason}
        ("skipped", pa.string()),  # objects under the prefix that are not input, reported once
        ("held", pa.string()),  # files quarantined whole by an operator (`millpond quarantine-file`)
    ]
)
QUARANTINE_SCHEMA = pa.schema(
    [("source_file", pa.string()), ("line", pa.int64()), ("raw", pa.string()), ("reason", pa.string()),
     ("batch", pa.int64())]
)
SEEN_SCHEMA = pa.schema([("id", pa.string()), ("event_time", TS), ("batch", pa.int64())])
BATCHES_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        ("processing_time", TS),
        ("watermark", TS),
        ("input_watermark", TS),
        ("max_event_time", TS),
        ("files", pa.int64()),
        ("input", pa.int64()),
        ("accepted", pa.int64()),
        ("duplicates", pa.int64()),
        ("late", pa.int64()),
        ("quarantined", pa.int64()),
        ("panes", pa.int64()),
        ("retractions", pa.int64()),
        ("state_rows_read", pa.int64()),
        ("phases", pa.string()),
        ("versions", pa.string()),
        ("skipped", pa.int64()),  # added later (null in rows written before): objects not taken, see the plan
        ("spec", pa.string()),  # added later: the pipeline's semantic spec (``model.versions``) the batch ran
        ("state_format", pa.int64()),  # added later: the state format it wrote (null: format 1)
        ("engine", pa.string()),  # added later: the engine that ran the batch, local or spark (null: before)
        ("strategy", pa.string()),  # added later: how it ran: in-process, plan or one-task
    ]
)
#: tables whose versions a batch's plan pins (its reads of state use them)
STATE_TABLES = ("windows", "seen_ids")
#: read whole by every batch's plan
BOOKKEEPING_TABLES = ("batches", "ingest_log")
#: the current view's partitions: a batch's MERGE rewrites the hours it touches
CURRENT_PARTITIONS = ("window_end_day", "window_end_hour")
#: the ``windows`` columns whose file statistics a batch's reads of state prune by
WINDOWS_STATS_COLUMNS = ("key", "window_start", "window_end", "event_timer", "ptime_timer")
#: the tables a windowed pipeline's batch writes (the marker names their versions)
OUTPUT_TABLES = ("panes", "current", "late", "quarantine", "windows", "seen_ids", "ingest_log")


def late_schema(value_type: str) -> pa.Schema:
    return pa.schema(
        [("id", pa.string()), ("key", pa.string()),
         ("value", value_arrow_type(value_type)),
         ("event_time", TS), ("arrival_time", TS), ("reason", pa.string()), ("batch", pa.int64())]
    )


def current_schema(value_type: str) -> pa.Schema:
    return pa.schema(
        [("key", pa.string()), ("window_start", TS), ("window_end", TS),
         ("value", value_arrow_type(value_type)),
         ("pane_index", pa.int64()), ("timing", pa.string()), ("batch", pa.int64()), ("deleted", pa.bool_())]
    )


def current_file_schema(value_type: str) -> pa.Schema:
    """The current view's rows with its partition columns (``CURRENT_PARTITIONS``), as data files are written."""
    return current_schema(value_type).append(pa.field("window_end_day", pa.date32())).append(
        pa.field("window_end_hour", pa.int32()))


def value_arrow_type(value_type: str) -> pa.DataType:
    """The Arrow type of a value column of type ``int`` or ``float``."""
    return pa.int64() if value_type == "int" else pa.float64()

#: a pipeline's operations on its own tables (a reprocess's rewind): never rewound, so it keeps them all
OPERATIONS_SCHEMA = pa.schema([
    ("at", pa.timestamp("us", tz="UTC")),
    ("operation", pa.string()),
    ("by", pa.string()),
    ("detail", pa.string()),  # JSON: what the operation did (the rewind's batches and table versions)
])
