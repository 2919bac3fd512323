"""Engines run a batch's per-key step behind one interface: ``run(spec_json, clock, events, state, sink)``.

``local`` runs it in the job's process over every core; ``spark`` on a Spark session. Both give identical
tables (``tests/test_cores.py``, ``tests/test_fast_paths.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import pyarrow as pa

from millpond.config import Settings
from millpond.model.clock import BatchClock
from millpond.runtime.assembly import Assembly


class Engine(Protocol):
    name: str

    def run(self, spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, sink: Assembly) -> None:
        """Process every key of ``events`` with its stored ``state`` rows; add the output rows to ``sink``."""


def select_engine(settings: Settings, spark, n_events: int, value_type: str,
                  before_fork: Callable[[], object] | None = None) -> Engine:
    """Spark when the deployment says so and a session is at hand, unless the batch is smaller than
    ``engine.local_below``; else the local engine."""
    if spark is not None and settings.engine == "spark" and n_events >= settings.engine_local_below:
        from millpond.runtime.engines.spark import SparkEngine

        return SparkEngine(spark, value_type, settings.columnar_windows)
    from millpond.runtime.engines.local import LocalEngine

    return LocalEngine(settings, before_fork)
