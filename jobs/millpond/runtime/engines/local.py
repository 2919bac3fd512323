"""The local engine: the per-key step in the job's process, a large chunk's keys spread over the machine's
cores by forked workers (``runtime.cores``), each range assembled where it runs, concatenated in key order."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import pyarrow as pa

from millpond.config import Settings
from millpond.model.clock import BatchClock
from millpond.runtime import cores
from millpond.runtime.assembly import Assembly, key_rows, strategy_of
from millpond.runtime.layout import KeyLayout


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block. The per-key step allocates several objects per
    element and window, which keep the young generations filling up, so the collector keeps rescanning
    the live chunk (a fifth of the step's time) for cycles the step does not make; it runs afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()



class LocalEngine:
    """In-process, over every core: the default for laptops and unit tests, and below ``engine.local_below``."""

    name = "local"

    def __init__(self, settings: Settings, before_fork: Callable[[], object] | None = None) -> None:
        self.settings = settings
        self.before_fork = before_fork

    def run(self, spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, sink: Assembly) -> None:
        """The per-key step chunk by chunk; ``before_fork`` runs before workers are forked."""
        layout = KeyLayout.of(events, state)
        columnar, strategy = self.settings.columnar_windows, strategy_of(spec_json)
        with _gc_paused():
            for lo, hi in layout.chunks():
                def part(a: int, b: int, lo: int = lo) -> Assembly:
                    out = sink.empty_like()
                    rows: list[tuple] = []
                    for key, els, groups, sts in layout.rows(lo + a, lo + b, strategy, clock, columnar):
                        rows += key_rows(spec_json, clock, key, els, sts, groups)
                    out.add(rows)
                    return out

                for piece in cores.map_ranges(part, layout.weights(lo, hi).tolist(), before_fork=self.before_fork,
                                              workers=self.settings.workers,
                                              min_range=self.settings.driver_min_range):
                    sink.absorb(piece)
