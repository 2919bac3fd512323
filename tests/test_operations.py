"""Day-2 operations: reset drops a pipeline's tables and lease, and refuses while a batch of it runs."""

from __future__ import annotations

import pyarrow as pa
import pytest
from millpond.errors import LeaseLost
from millpond.lake.catalog import drop_pipeline, lake_tables
from millpond.lake.lease import Lease
from millpond.lake.tables import Txn
from millpond.surface.cli import main


def test_reset_refuses_while_a_batch_runs_then_drops_everything(settings, tables, pipeline_name, capsys) -> None:
    for name in ("panes", "batches"):
        tables.append(pipeline_name, name, pa.table({"batch": pa.array([1], pa.int64())}), txn=Txn("t", 1))
    assert lake_tables(settings, pipeline_name) == ["batches", "panes"]
    running = Lease.acquire(settings, pipeline_name, owner="a-running-batch")
    with pytest.raises(LeaseLost, match="is being run by a-running-batch"):
        drop_pipeline(settings, pipeline_name)
    assert main(["reset", pipeline_name, "--yes"]) == 1  # one line, no traceback, nothing dropped
    assert "is being run by a-running-batch" in capsys.readouterr().err
    assert lake_tables(settings, pipeline_name) == ["batches", "panes"]
    running.release()
    assert main(["reset", pipeline_name, "--yes"]) == 0
    assert "dropped 2 tables" in capsys.readouterr().out
    assert lake_tables(settings, pipeline_name) == []
    assert not tables.exists(pipeline_name, "panes")
    assert main(["reset", pipeline_name, "--yes"]) == 0  # nothing left: says so
    assert "nothing to reset" in capsys.readouterr().out
