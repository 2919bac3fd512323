"""The local engine: the whole batch in the job's process (``LocalEngine``), its per-key step over the machine's
cores (``KeysOnCores``: a large chunk's keys spread over forked workers, ``runtime.cores``, each range assembled
where it runs, concatenated in key order)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from millpond.config import Settings
from millpond.model.clock import BatchClock
from millpond.model.timeutil import to_datetime
from millpond.runtime import cores
from millpond.runtime.assembly import Assembly, key_rows, strategy_of
from millpond.runtime.engines.base import BatchWork, Engine, Outputs
from millpond.runtime.layout import KeyLayout

if TYPE_CHECKING:
    from millpond.runtime.commits import PhaseTimer
    from millpond.runtime.context import BatchContext


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



class KeysOnCores:
    """The per-key step in-process, over every core (the local engine's, and the one-task strategy's on its
    executor, where ``driver_workers`` is 0)."""

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
                    inputs, fired = layout.split(lo + a, lo + b, strategy, clock, columnar)
                    for key, els, groups, sts in inputs:
                        rows += key_rows(spec_json, clock, key, els, sts, groups)
                    out.add(rows, fired)
                    return out

                for piece in cores.map_ranges(part, layout.weights(lo, hi).tolist(), before_fork=self.before_fork,
                                              workers=self.settings.workers,
                                              min_range=self.settings.driver_min_range):
                    sink.absorb(piece)


class LocalEngine(Engine):
    """The batch in this process: the default for laptops and unit tests, and below ``engine.local_below``."""

    name = "local"

    def strategy(self, job: BatchContext, work: BatchWork) -> str:
        return "in-process"

    def run(self, job: BatchContext, work: BatchWork, timer: PhaseTimer) -> Outputs:
        """Read (landing files or a stage's upstream panes), dedup, watermark, the pipeline's per-key step
        (``job.process``: windows or a MillWheel computation), then the inputs' commits."""
        from millpond.runtime.steps import commit, dedup, read, upstream, watermark

        the_plan, t = work.plan, timer
        t.begin("ingest", files=len(the_plan["files"]))
        if job.spec.upstream is not None:
            good, bad = upstream.read_upstreams(job, the_plan), []
        else:
            good, bad = read.read_files(job, the_plan, work.processing_time)
        t.lap("ingest", elements=good.num_rows, quarantined=len(bad))
        seen_version = the_plan["versions"].get("seen_ids")
        accepted, kept, delivered = dedup.dedup(job, good, seen_version, work.w_in, copies=job.validate)
        duplicates = good.num_rows - accepted.num_rows
        del good
        t.lap("dedup", accepted=accepted.num_rows, duplicates=duplicates)
        clock, max_et = watermark.advance_watermark(job, work.batch, work.processing_time, work.w_in, work.prev,
                                                    accepted, the_plan, work.watermark)
        t.lap("watermark", watermark=to_datetime(clock.watermark).isoformat())
        job.commits.defer()
        outputs = job.process(work.batch, work.txn, clock, accepted, the_plan, t, delivered=delivered)
        commit.commit_inputs(job, work.batch, work.txn, bad, accepted, kept, seen_version)
        counts = {"files": len(the_plan["files"]), "input": accepted.num_rows + duplicates + len(bad),
                  "accepted": accepted.num_rows, "duplicates": duplicates, "quarantined": len(bad),
                  "late": 0, "panes": 0, "retractions": 0, "state_rows_read": 0, **outputs}
        return Outputs(counts, clock, max_et, self.name, self.strategy(job, work))
