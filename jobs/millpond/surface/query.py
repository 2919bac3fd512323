"""SQL over the lake: DataFusion (through delta-rs ``QueryBuilder``) on the project's Delta tables.

Tables are addressed as ``<pipeline>.<name>``, each read at the version its pipeline's last committed
batch names (the ``batches`` marker), so a query never sees half a batch; a table the marker does not name
(``batches``, ``operations``, a pipeline without a marker) is read at its latest version.
``<pipeline>.<name>@v3`` or ``@'2026-01-01T12:00Z'`` reads the snapshot named (Delta time travel),
``--as-of`` does so for every table without its own ``@``. No Spark and no JVM: an answer in well under a
second, so it suits a terminal and a DAG.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from millpond.config import Settings, load_settings
from millpond.errors import MillpondError
from millpond.lake.catalog import (
    committed_versions,
    execute_sql,
    lake_pipelines,
    lake_tables,
    open_committed,
    open_snapshot,
)
from millpond.lake.tables import Tables
from millpond.model.timeutil import to_datetime, to_us
from millpond.surface.cli import command

FORMATS = ("table", "csv", "json")

# One pass over the SQL: literals, quoted identifiers and comments are skipped untouched; a
# ``a.b`` (optionally ``@v3`` / ``@'timestamp'`` / ``@2026-01-01T12:00:00Z``) is a candidate table.
_TOKEN = re.compile(
    r"""
    (?P<skip>'(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/)
  | (?P<ref>(?<![\w.])(?P<pipe>[A-Za-z_]\w*)\.(?P<name>[A-Za-z_]\w*)(?![\w.(])
      (?:@(?P<at>v\d+|\d+(?![\d-])|'[^']*'|\d{4}-\d{2}-\d{2}(?:T[\d:.]+)?(?:Z|[+-]\d{2}:?\d{2})?))?)
    """,
    re.X | re.S,
)
_FROM_BEFORE = re.compile(r"(?i)\b(?:from|join)\s+$")


@dataclass(frozen=True)
class TableRef:
    """One table the query reads: which table, at which snapshot."""

    pipeline: str
    name: str
    version: int | None = None
    timestamp: datetime | None = None

    @property
    def label(self) -> str:
        base = f"{self.pipeline}.{self.name}"
        if self.version is not None:
            return f"{base}@v{self.version}"
        if self.timestamp is not None:
            return f"{base}@{self.timestamp.isoformat()}"
        return base

    @property
    def sql_name(self) -> str:
        """The quoted identifier the table is registered under (DataFusion has no such schema)."""
        return '"' + self.label.replace('"', "") + '"'


def parse_as_of(text: str | int | None) -> tuple[int | None, datetime | None]:
    """``3``/``v3`` -> version 3; anything else -> a timestamp (ISO-8601 or epoch seconds)."""
    if text is None:
        return None, None
    if isinstance(text, int):
        return text, None
    raw = text.strip().strip("'\"")
    if re.fullmatch(r"[vV]?\d+", raw) and not re.fullmatch(r"\d{9,}", raw):
        return int(raw.lstrip("vV")), None
    try:
        return None, to_datetime(to_us(raw))
    except ValueError as exc:
        raise MillpondError(f"--as-of {text!r}: expected a version (3 or v3) or a timestamp (ISO-8601)") from exc


# -- discovery -------------------------------------------------------------------------------
def configured_pipelines(settings: Settings) -> list[str]:
    """Pipeline names from ``conf/pipelines/*.yaml`` (read as plain YAML: no engine import)."""
    names = []
    for path in sorted(Path(settings.conf_dir, "pipelines").glob("*.y*ml")):
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        names.append(str(doc.get("name") or path.stem) if isinstance(doc, dict) else path.stem)
    return names


def known_pipelines(settings: Settings, sql: str) -> list[str]:
    """The pipelines among the first parts of ``sql``'s dotted names: configured, or holding a table in the
    lake. Only those names are looked up, not every pipeline of the lake (a lake of many pipelines would
    make every query list them all)."""
    named = {m.group("pipe") for m in _TOKEN.finditer(sql) if m.group("ref") is not None}
    configured = set(configured_pipelines(settings))
    return sorted(p for p in named if p in configured or lake_tables(settings, p))


# -- the query -------------------------------------------------------------------------------
def rewrite(sql: str, pipelines: Iterable[str], as_of: str | int | None = None) -> tuple[str, list[TableRef]]:
    """Replace every ``pipeline.table[@snapshot]`` by the quoted name it will be registered under.

    A dotted name is a table if its first part is a known pipeline, if it has an ``@`` snapshot, or
    if it follows FROM or JOIN (so an unknown table gets a clear error, not "no such schema");
    anything else (``p.key`` with alias ``p``) is left alone.
    """
    known = set(pipelines)
    default_version, default_ts = parse_as_of(as_of)
    refs: dict[str, TableRef] = {}

    def sub(m: re.Match[str]) -> str:
        if m.group("skip") is not None:
            return m.group(0)
        at = m.group("at")
        is_table = m.group("pipe") in known or at is not None or _FROM_BEFORE.search(sql, 0, m.start()) is not None
        if not is_table:
            return m.group(0)
        version, ts = parse_as_of(at) if at is not None else (default_version, default_ts)
        ref = TableRef(m.group("pipe"), m.group("name"), version, ts)
        refs.setdefault(ref.sql_name, ref)
        return ref.sql_name

    return _TOKEN.sub(sub, sql), list(refs.values())


def open_ref(tables: Tables, ref: TableRef):
    """The snapshot a reference names (see :func:`millpond.lake.catalog.open_snapshot`)."""
    return open_snapshot(tables, ref.pipeline, ref.name, ref.version, ref.timestamp, ref.label)


def _plain(table: pa.Table) -> pa.Table:
    """DataFusion returns string_view/binary_view; plain types print and convert everywhere."""
    fields = []
    for f in table.schema:
        t = f.type
        if pa.types.is_string_view(t) or pa.types.is_large_string(t):
            t = pa.string()
        elif pa.types.is_binary_view(t):
            t = pa.binary()
        fields.append(pa.field(f.name, t, f.nullable))
    target = pa.schema(fields)
    return table if target.equals(table.schema) else table.cast(target)


def run_query(settings: Settings, sql: str, as_of: str | int | None = None) -> pa.Table:
    """Execute ``sql`` over the lake and return the result as an Arrow table. A table without a snapshot of
    its own (``@``, ``as_of``) is read as of its pipeline's last committed batch (``open_committed``)."""
    tables = Tables(settings)
    text, refs = rewrite(sql, known_pipelines(settings, sql), as_of)
    committed = {p: committed_versions(tables, p)
                 for p in sorted({r.pipeline for r in refs if r.version is None and r.timestamp is None})}
    snapshots, empty = {}, set()
    try:
        for ref in refs:
            if ref.version is None and ref.timestamp is None:
                snapshots[ref.sql_name], uncommitted = open_committed(tables, ref.pipeline, ref.name,
                                                                      committed[ref.pipeline], ref.label)
                if uncommitted:
                    empty.add(ref.sql_name)
            else:
                snapshots[ref.sql_name] = open_ref(tables, ref)
        return _plain(execute_sql(snapshots, text, empty))
    except MillpondError as exc:  # time travel past the retention: one line naming the setting
        gone = re.search(r"not found|no files in log segment|did not exist yet|invalid table version|unknown table",
                         str(exc), re.I)
        why = next(filter(None, (_beyond_retention(tables, r) for r in refs)), "") if gone else ""
        if why:
            raise MillpondError(why) from exc
        raise


def _beyond_retention(tables: Tables, ref: TableRef) -> str:
    """Why a time-travel reference may no longer be readable ('' while it is within retention)."""
    from millpond.runtime.upkeep import RETENTION_SETTING, beyond_retention, retained_s, span_text

    if ref.version is not None:
        why = beyond_retention(tables, ref.pipeline, ref.name, ref.version)
        return f"{why}: its files may have been vacuumed, its log expired; ask for a later version" if why else ""
    if ref.timestamp is None or not tables.exists(ref.pipeline, ref.name):
        return ""
    keep = retained_s(tables, ref.pipeline, ref.name)
    if to_us(ref.timestamp) / 1_000_000 > datetime.now(UTC).timestamp() - keep:
        return ""
    return (f"{ref.label}: that time is older than {ref.pipeline}'s retention of {span_text(keep)} "
            f"({RETENTION_SETTING}): its files may have been vacuumed, its log expired; ask for a later time")


def history(settings: Settings, table: str, limit: int | None = None) -> pa.Table:
    """The Delta log of ``pipeline.table``: one row per commit, newest first."""
    pipeline, _, name = table.partition(".")
    if not pipeline or not name:
        raise MillpondError(f"history: expected pipeline.table, got {table!r}")
    tables = Tables(settings)
    dt = open_ref(tables, TableRef(pipeline, name))
    rows = []
    for h in dt.history(limit):
        params = h.get("operationParameters") or {}
        metrics = h.get("operationMetrics") or {}
        rows.append({
            "version": int(h.get("version", -1)),
            "timestamp": datetime.fromtimestamp(h["timestamp"] / 1000, UTC) if h.get("timestamp") else None,
            "operation": h.get("operation"),
            "parameters": json.dumps(params, sort_keys=True, default=str) if params else "",
            "rows_added": _int(metrics.get("num_added_rows", metrics.get("num_target_rows_inserted"))),
            "files_added": _int(metrics.get("num_added_files")),
            "files_removed": _int(metrics.get("num_removed_files")),
            "app_txn": _txn_text(h),
        })
    schema = pa.schema([
        ("version", pa.int64()), ("timestamp", pa.timestamp("us", tz="UTC")), ("operation", pa.string()),
        ("parameters", pa.string()), ("rows_added", pa.int64()), ("files_added", pa.int64()),
        ("files_removed", pa.int64()), ("app_txn", pa.string()),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


def _int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _txn_text(h: dict[str, Any]) -> str:
    txns = h.get("txn") or h.get("appTransactions") or []
    if isinstance(txns, dict):
        txns = [txns]
    return ", ".join(f"{t.get('appId')}={t.get('version')}" for t in txns if isinstance(t, dict))


# -- output ----------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, datetime):
        return v.isoformat(sep=" ")
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else str(v)
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=_json_default)
    return str(v)


def _json_default(v: Any) -> Any:
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def format_table(table: pa.Table) -> str:
    """An aligned text table (numbers right-aligned), then the row count."""
    names = table.column_names
    rows = [[_cell(r[n]) for n in names] for r in table.to_pylist()]
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)
               for f in table.schema]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]

    def line(cells: list[str]) -> str:
        return " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric,
                                                                              strict=True)).rstrip()

    out = [line(names), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def format_csv(table: pa.Table) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.column_names)
    for r in table.to_pylist():
        writer.writerow(["" if v is None else v.isoformat() if isinstance(v, datetime) else _cell(v)
                         for v in r.values()])
    return buf.getvalue().rstrip("\n")


def format_json(table: pa.Table) -> str:
    """A JSON array of objects; timestamps as ISO-8601 strings."""
    return json.dumps(table.to_pylist(), default=_json_default, indent=None)


def render(table: pa.Table, fmt: str = "table") -> str:
    if fmt not in FORMATS:
        raise MillpondError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return {"table": format_table, "csv": format_csv, "json": format_json}[fmt](table)


# -- command line ----------------------------------------------------------------------------
def _configure_query(p: argparse.ArgumentParser) -> None:
    p.add_argument("sql", help='SQL over pipeline.table names, e.g. "SELECT count(*) FROM video_sessions.panes"')
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--as-of", dest="as_of", default=None,
                   help="read every table at this version (3, v3) or time (ISO-8601) unless it has its own @")


@command("query", "run SQL over the lake's Delta tables (pipeline.table, time travel with @v3)", _configure_query)
def _query(args: argparse.Namespace) -> int:
    if not args.sql.strip():
        raise MillpondError('query: no SQL given (e.g. make query SQL="SELECT * FROM video_sessions.panes")')
    print(render(run_query(load_settings(), args.sql, args.as_of), args.format))
    return 0


def _configure_history(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", help="pipeline.table (its Delta commits), or pipeline (its batches and the files "
                                 "not read as input)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--format", choices=FORMATS, default="table")


@command("history", "show a table's Delta commits, or a pipeline's batches and files not read as input",
         _configure_history)
def _history(args: argparse.Namespace) -> int:
    if "." not in args.table:
        from millpond.surface.inputs import history as pipeline_history
        from millpond.surface.inputs import operations

        batches, files = pipeline_history(load_settings(), args.table)
        print(render(batches.slice(max(0, batches.num_rows - args.limit)) if args.limit else batches, args.format))
        ops = operations(load_settings(), args.table)
        if ops.num_rows:
            print(f"\noperations on {args.table}'s tables (backfills, reprocesses):")
            print(render(ops, args.format))
        print(f"\nfiles of {args.table} not read as input (skipped, held by an operator, or quarantined whole):")
        print(render(files, args.format))
        return 0
    print(render(history(load_settings(), args.table, args.limit), args.format))
    return 0


def _configure_tables(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", default=None)


@command("tables", "list the pipelines and tables in the lake", _configure_tables)
def _tables(args: argparse.Namespace) -> int:
    settings = load_settings()
    pipelines = [args.pipeline] if args.pipeline else lake_pipelines(settings)
    for p in pipelines:
        for t in lake_tables(settings, p):
            sys.stdout.write(f"{p}.{t}\n")
    return 0
