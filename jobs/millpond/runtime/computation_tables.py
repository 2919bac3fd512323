"""A MillWheel computation's tables as both engines write them: their schemas, a production stream's rows, and
the output-watermark row. The local engine (``runtime.computation``) and the Spark engine
(``runtime.engines.spark_computation``) share these definitions, so their tables cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from millpond.errors import MillpondError
from millpond.lake.tables import Tables, Txn
from millpond.model.clock import BatchClock
from millpond.model.panes import TS
from millpond.runtime.assembly import ts_array, us_column

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

STATE_SCHEMA = pa.schema([("key", pa.string()), ("state", pa.string()), ("batch", pa.int64()),
                          ("deleted", pa.bool_())])
TIMERS_SCHEMA = pa.schema([("key", pa.string()), ("tag", pa.string()), ("domain", pa.string()), ("fire_at", TS),
                           ("batch", pa.int64()), ("deleted", pa.bool_())])
WATERMARKS_SCHEMA = pa.schema([("batch", pa.int64()), ("processing_time", TS), ("input_watermark", TS),
                               ("held_by", TS), ("output_watermark", TS)])
#: the columns each table's file statistics cover (what its readers filter on)
STATE_STATS = ("key",)
TIMERS_STATS = ("key", "tag", "domain", "fire_at")


def stream_schema(declared: pa.Schema | None) -> pa.Schema | None:
    """A declared stream's schema with the ``batch`` column every production carries (None: inferred)."""
    if declared is None or "batch" in declared.names:
        return declared
    return declared.append(pa.field("batch", pa.int64()))


def production_table(pipeline: str, stream: str, schema: pa.Schema | None, rows: list[dict[str, Any]]) -> pa.Table:
    """A stream's productions (each with its ``batch``) as rows of ``schema`` (``stream_schema``; None: inferred,
    as ``pa.Table.from_pylist`` does); a production that does not fit is one line naming the stream."""
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise MillpondError(f"{pipeline}: productions to {stream!r} do not fit its schema: {exc}") from exc


def column_types(pipeline: str, stream: str, rows: list[dict[str, Any]]) -> pa.Schema:
    """The type Arrow infers for every name any of ``rows`` has (a Spark task's part of an inferred schema)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    try:
        return pa.schema([(n, pa.array([row.get(n) for row in rows]).type) for n in names])
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise MillpondError(f"{pipeline}: productions to {stream!r} do not fit its schema: {exc}") from exc


def inferred_schema(pipeline: str, stream: str, parts: Sequence[tuple[str, list[str], pa.Schema]]) -> pa.Schema:
    """The schema ``pa.Table.from_pylist`` infers for a batch's productions to a stream (the first row's names,
    each typed by all its values), from the parts of tasks that each saw some keys' rows: (their first key, its
    first row's names, their ``column_types``). Keys are produced in order, so the least first key's row is the
    batch's first."""
    names = min(parts, key=lambda p: p[0])[1]
    fields = []
    for name in names:
        typed = [pa.schema([p[2].field(name)]) for p in parts if name in p[2].names]
        try:
            fields.append(pa.unify_schemas(typed, promote_options="permissive").field(name))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise MillpondError(f"{pipeline}: productions to {stream!r} do not fit its schema: {exc}") from exc
    return pa.schema(fields)


def previous_output(tables: Tables, pipeline: str, batch: int, version: int | None) -> int:
    """The output watermark the batch before committed (the least timestamp before the first)."""
    if version is None or batch <= 1:
        return -(2**63)
    prev = tables.select(pipeline, "watermarks", f"batch = {batch - 1}", columns=["output_watermark"],
                         version=version)
    vals = us_column(prev, "output_watermark")
    return vals[0] if vals else -(2**63)


def commit_watermark(job: BatchContext, txn: Txn, clock: BatchClock, held: int | None, version: int | None) -> None:
    """The batch's ``watermarks`` row: min(input low watermark, the earliest due timer left pending, ``held``),
    never below the previous batch's (monotonic, as MillWheel promises); ``version``: the table's, as planned."""
    out = clock.watermark if held is None else min(clock.watermark, held)
    out = max(out, previous_output(job.tables, job.name, clock.batch, version))
    row = pa.Table.from_arrays([pa.array([clock.batch], pa.int64()), ts_array([clock.processing_time]),
                                ts_array([clock.watermark]), ts_array([held]), ts_array([out])],
                               schema=WATERMARKS_SCHEMA)
    job.commits.step("watermarks", lambda: job.tables.append(job.name, "watermarks", row, txn=txn))
