"""Data files written outside delta-rs (by Spark's executors, ``lake.spark_io.write_table``) carry Delta statistics
for every column a reader may filter on. A filtered read by delta-rs skips a file without a column's min/max, so
without them the local engine's reads of state (timers, the dedup's event-time range) and a user's filtered
query would miss those files' rows."""

from __future__ import annotations

import json
from datetime import date

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import AddAction
from millpond.lake.snapshot_files import Storage
from millpond.lake.spark_io import write_table
from millpond.model.timeutil import MAX_TS

TS = pa.timestamp("us", tz="UTC")
ROWS = pa.table({
    "id": ["a", "b", "c"],
    "n": pa.array([1, 5, 9], pa.int64()),
    "x": pa.array([0.5, 2.5, None], pa.float64()),
    "flag": [True, False, True],
    "day": pa.array([date(2026, 1, 1), date(2026, 1, 2), date(2026, 1, 3)]),
    # sub-millisecond times at both ends (statistics name milliseconds), and the end of time
    "at": pa.array([1767225600000999, 1767225600123456, MAX_TS], pa.int64()).cast(TS),
})


def _table_of_executor_files(path) -> DeltaTable:
    write_deltalake(str(path), ROWS.schema.empty_table())
    actions = [json.loads(a) for a in write_table(Storage("", "", "", "", 5.0), f"file://{path}", ROWS)]
    dt = DeltaTable(str(path))
    dt.create_write_transaction([AddAction(a["path"], a["size"], a["partition_values"], a["modification_time"], True,
                                           a["stats"]) for a in actions], "append", ROWS.schema)
    return DeltaTable(str(path))


def test_a_filtered_read_finds_the_rows_of_files_executors_wrote(tmp_path) -> None:
    dt = _table_of_executor_files(tmp_path / "t")
    first, second = (pa.scalar(v, pa.int64()).cast(TS) for v in (1767225600000999, 1767225600123456))
    filters = {
        "at >= the second row's time": pc.field("at") >= second,
        "at <= the first row's time": pc.field("at") <= first,
        "at >= the end of time": pc.field("at") >= pa.scalar(MAX_TS, pa.int64()).cast(TS),
        "id": pc.field("id") == "b",
        "n": pc.field("n") > 4,
        "x": pc.field("x") > 2.0,
        "flag": pc.field("flag") == False,  # noqa: E712 - an expression, not a comparison
        "day": pc.field("day") == pa.scalar(date(2026, 1, 3)),
    }
    for name, expr in filters.items():
        assert dt.to_pyarrow_dataset().to_table(filter=expr).num_rows == ROWS.filter(expr).num_rows >= 1, name



def test_a_numeric_column_s_bounds_come_from_the_statistics_of_snapshot_and_change_feed(tables, pipeline_name
                                                                                         ) -> None:
    """A stage's tally (``runtime.engines.spark_upstream.plain_tally``) sizes its sums from the largest magnitude
    of the upstream's value columns, read from the files' statistics instead of a Spark job over the rows: the
    least and the greatest value of each numeric column, listed the same by a snapshot and by the change feed,
    and no bound at all when a file with rows lacks them (the caller then counts with a job)."""
    from millpond.lake.delta_files import DataFile, added_files, column_max, magnitude, snapshot_files

    first = pa.table({"n": pa.array([3, -70, 5], pa.int64()), "x": [0.5, -2.5, 1.0], "s": ["a", "b", "c"]})
    second = pa.table({"n": pa.array([40, 2], pa.int64()), "x": [9.25, float("nan")], "s": ["d", "e"]})
    tables.append(pipeline_name, "panes", first)
    before = tables.version(pipeline_name, "panes")
    tables.append(pipeline_name, "panes", second)
    upto = tables.version(pipeline_name, "panes")
    snapshot = snapshot_files(tables, pipeline_name, "panes", upto)
    added = added_files(tables, pipeline_name, "panes", before, upto)
    assert len(snapshot) == 2 and len(added) == 1 and added[0].rows == 2
    assert sorted((f.mins["n"], f.maxs["n"]) for f in snapshot) == [(-70, 5), (2, 40)]
    assert (added[0].mins["n"], added[0].maxs["n"]) == (2, 40) and "s" not in added[0].maxs
    assert magnitude(snapshot, "n") == 70 and magnitude(added, "n") == 40 and column_max(snapshot, "n") == 40
    assert magnitude([f for f in snapshot if f.rows == 3], "x") == 2.5
    blind = DataFile("s3://b/blind.parquet", {}, 4)  # a file with rows and no statistics
    assert magnitude([*snapshot, blind], "n") is None and column_max([*snapshot, blind], "n") is None
    assert magnitude([DataFile("s3://b/empty.parquet", {}, 0)], "n") == 0
