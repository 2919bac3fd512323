"""A Delta table's data files with what their add actions say (row count, per-column maximum), without reading a row:
a snapshot's files, and the files a range of commits added, from those commits' log entries.

Why: the Spark engine reads a stage's upstream ``panes`` on executors, file by file (``lake.spark_io.read_table``
with ``only``), and plans which files here. The files a range's data-changing commits added are exactly the rows
the change feed gives for an append-only table (delta-rs ``load_cdf``, ``Tables.read_added``, reads them in one
process); a compaction (``dataChange`` false) adds none. Row counts size the batch before it is read; a column's
per-file maximum skips the files a comparison above a batch does not need.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from millpond.errors import MillpondError, ObjectMissing
from millpond.lake.snapshot_files import data_files
from millpond.lake.table import EXPIRY_KEY, log_store
from millpond.lake.tables import Tables


@dataclass(frozen=True)
class DataFile:
    """One data file: where it is, its partition values, and its statistics (None: not recorded)."""

    uri: str
    partition_values: dict[str, Any]
    rows: int | None
    #: the largest value of each numeric column the statistics name
    maxs: dict[str, int | float] = field(default_factory=dict)
    #: the least value of each numeric column the statistics name
    mins: dict[str, int | float] = field(default_factory=dict)

    @property
    def location(self) -> tuple[str, dict[str, Any]]:
        """(URI, partition values), as ``spark_io.read_table(only=...)`` takes it."""
        return self.uri, self.partition_values


def snapshot_files(tables: Tables, pipeline: str, name: str, version: int | None) -> list[DataFile]:
    """The data files of ``pipeline.name`` at ``version`` ([] without the table or a version)."""
    if version is None:
        return []
    dt = tables.open(pipeline, name, version)
    if dt is None:
        return []
    located = data_files(dt)  # fails on the features a file-by-file reader cannot follow
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    return [DataFile(uri, parts, a.get("num_records"), _numbers(a, "max."), _numbers(a, "min."))
            for (uri, parts), a in zip(located, actions, strict=True)]


def _numbers(stats: dict[str, Any], prefix: str = "") -> dict[str, int | float]:
    """The numeric statistics of ``stats`` whose names start with ``prefix``, by column (a timestamp, a string or
    a NaN is not kept: nothing here compares them)."""
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix) and isinstance(v, int | float)
            and not isinstance(v, bool) and v == v}


def added_files(tables: Tables, pipeline: str, name: str, after: int, upto: int) -> list[DataFile]:
    """The data files that the data-changing commits after version ``after`` up to and including ``upto`` added,
    oldest commit first (an expiry, ``Table.expire``, adds none: it only removes files). Needs the commits' log entries,
    kept for the pipeline's retention (a stage's plan checks that first, ``steps.upstream.check_history``)."""
    if upto <= after:
        return []
    uri = tables.uri(pipeline, name).rstrip("/")
    with ThreadPoolExecutor(max_workers=min(8, upto - after)) as pool:
        entries = list(pool.map(lambda v: _commit_actions(tables, uri, v), range(after + 1, upto + 1)))
    out = []
    for version, actions in zip(range(after + 1, upto + 1), entries, strict=True):
        if any(EXPIRY_KEY in (a.get("commitInfo") or {}) for a in actions):
            continue  # an expiry (``expire:``) only removes files whose rows were added before
        if any("cdc" in a for a in actions):  # an update or a merge: its inserts are in change files
            raise MillpondError(f"{pipeline}.{name}: commit {version} rewrote rows (it has change-data files); "
                                "only appends, compactions and rewinds are read file by file")
        for a in actions:
            add = a.get("add")
            if add and add.get("dataChange", True):
                out.append(_added(uri, add))
    return out


def _commit_actions(tables: Tables, uri: str, version: int) -> list[dict[str, Any]]:
    """The actions of one commit's log entry (newline-delimited JSON)."""
    settings = tables.settings
    key = f"{uri.split('/', 3)[3]}/_delta_log/{version:020d}.json"
    try:
        body = log_store(settings).get_bytes(settings.bucket_lake, key)
    except ObjectMissing as exc:
        raise MillpondError(f"{uri}: the log no longer holds commit {version} (beyond the table's retention)") from exc
    return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def _added(uri: str, add: dict[str, Any]) -> DataFile:
    path = unquote(add["path"])
    stats = json.loads(add.get("stats") or "{}")
    return DataFile(path if "://" in path else f"{uri}/{path}", dict(add.get("partitionValues") or {}),
                    stats.get("numRecords"), _numbers(stats.get("maxValues") or {}),
                    _numbers(stats.get("minValues") or {}))


def rows_of(files: list[DataFile]) -> int:
    """The files' rows by their statistics (a file without them counts 0: an estimate, for sizing)."""
    return sum(f.rows or 0 for f in files)


def column_max(files: list[DataFile], column: str) -> int | float | None:
    """The largest value of a numeric column over the files (0: no rows); None when a file with rows has no
    statistic for it (the caller reads it)."""
    known = [f.maxs.get(column) for f in files if f.rows != 0]
    if any(v is None for v in known):
        return None
    return max(known, default=0)


def magnitude(files: list[DataFile], column: str) -> int | float | None:
    """The largest absolute value of a numeric column over the files (0: no rows); None when a file with rows has
    no statistics for it."""
    known = [(f.mins.get(column), f.maxs.get(column)) for f in files if f.rows != 0]
    if any(lo is None or hi is None for lo, hi in known):
        return None
    return max((max(abs(lo), abs(hi)) for lo, hi in known), default=0)


def time_spans(tables: Tables, pipeline: str, name: str, version: int | None, column: str
               ) -> list[tuple[int, int | None, int | None]]:
    """(rows, least, greatest) of a timestamp ``column`` per data file of ``pipeline.name`` at ``version``, in
    microseconds, from the files' statistics (None where a file has none); [] without the table or a version.
    What a decision needs that must not read the rows (``runtime.steps.dedup.seen_keep_from``)."""
    dt = None if version is None else tables.open(pipeline, name, version)
    if dt is None:
        return []
    actions = pa.table(dt.get_add_actions(flatten=True))

    def micros(stat: str) -> list[int | None]:
        if stat not in actions.column_names:
            return [None] * actions.num_rows
        col = actions.column(stat)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("us", tz=col.type.tz))
        return col.cast(pa.int64()).to_pylist()

    rows = actions.column("num_records").to_pylist() if "num_records" in actions.column_names else [None] * len(actions)
    return [(n or 0, lo, hi) for n, lo, hi in zip(rows, micros(f"min.{column}"), micros(f"max.{column}"), strict=True)]
