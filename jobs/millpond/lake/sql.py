"""SQL text for delta-rs's DataFusion: literals and predicates built safely from values."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa


def plain_strings(table: pa.Table) -> pa.Table:
    """Cast ``string_view`` columns (DataFusion's and MERGE's output) to ``string`` for every consumer."""
    fields = [pa.field(f.name, pa.string(), f.nullable) if pa.types.is_string_view(f.type) else f
              for f in table.schema]
    return table.cast(pa.schema(fields)) if fields != list(table.schema) else table


def sql_str(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: Sequence[str]) -> str:
    """``column IN (...)`` for a list of strings (FALSE when empty)."""
    if not values:
        return "FALSE"
    return f'"{column}" IN (' + ", ".join(sql_str(v) for v in values) + ")"


def sql_ts(us: int) -> str:
    """A timestamp literal from microseconds since the epoch."""
    return f"arrow_cast(to_timestamp_micros({int(us)}), 'Timestamp(Microsecond, Some(\"UTC\"))')"
