"""A batch's commits: each one checked against the lease first, deferred between the plan and the marker,
then flushed together (one thread per table: each is idempotent by the batch's transaction id and readers
trust only the versions the marker names, so their order does not matter; a crash leaves a subset that
the rerun completes). Also the phase timer and the fault-injection points of the exactly-once tests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from millpond.lake.tables import Tables
from millpond.runtime import progress


def crash_point(step: str, batch: int) -> None:
    """Fault injection for the exactly-once tests: ``MILLPOND_CRASH_AFTER=<step>`` (and optionally
    ``MILLPOND_CRASH_BATCH=<n>``) kills the process with SIGKILL, no cleanup, right after that commit."""
    if os.environ.get("MILLPOND_CRASH_AFTER") == step and os.environ.get("MILLPOND_CRASH_BATCH", str(batch)) == str(
        batch
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("MILLPOND_PAUSE_AFTER") == step:  # a slow run, for the single-writer tests
        time.sleep(float(os.environ.get("MILLPOND_PAUSE_S", "5")))


class PhaseTimer:
    """Seconds per named phase of a batch (summed when a phase recurs), for the marker and the task log,
    where each phase's start and end is logged as it happens (``runtime.progress``)."""

    def __init__(self, label: str = "") -> None:
        #: the pipeline and batch, for the log
        self.label = label
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def begin(self, name: str, **counts: object) -> None:
        """Log that phase ``name`` starts (what it works on in ``counts``)."""
        progress.begin(self.label, name, **counts)

    def lap(self, name: str, quiet: bool = False, **counts: object) -> None:
        """Phase ``name`` ends now (it began at the previous lap); ``quiet``: a part of it, not logged."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._t
        if not quiet:
            progress.done(self.label, name, self.phases[name], **counts)  # a recurring phase: its total
        self._t = now

    def split(self, name: str, parts: dict[str, float], **counts: object) -> None:
        """Phase ``name`` ends now, and held ``parts`` timed elsewhere (in a Spark task): they become phases
        of their own, ``name`` keeps the rest (the job's scheduling and round trip)."""
        self.lap(name, quiet=True)
        self.phases[name] = max(0.0, self.phases[name] - sum(parts.values()))
        for part, seconds in parts.items():
            self.phases[part] = self.phases.get(part, 0.0) + seconds
        progress.done(self.label, name, self.phases[name], **counts,
                      **{part: f"{seconds:.2f}s" for part, seconds in parts.items()})


def concurrently(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Independent reads of different tables at once: each mostly waits on the object store, with the
    GIL released. The first failure is raised after all have finished."""
    if len(calls) <= 1:
        return {k: f() for k, f in calls.items()}
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = {k: pool.submit(f) for k, f in calls.items()}
    return {k: f.result() for k, f in futures.items()}


class Commits:
    """The commits of one batch of one pipeline."""

    def __init__(self, tables: Tables, pipeline: str, check: Callable[[], None], batch: int) -> None:
        self.tables, self.name, self.check, self.batch = tables, pipeline, check, batch
        self.deferred: list[tuple[str, str, Callable[[], Any]]] | None = None
        #: tables this run has committed to (their snapshots are current: see ``versions``)
        self.written: set[str] = set()
        #: output tables the last marker found absent: absent still unless this run writes them
        self.absent: set[str] = set()
        #: the plan's commit and the batch's upkeep step, running while the planned files are read
        self.plan_commit: Future | None = None
        self.upkeep: Future | None = None

    def step(self, name: str, write: Callable[[], Any], table: str | None = None) -> None:
        """One commit: only while this run still holds the lease; a crash point after it. Between the
        plan and the marker (``defer``), commits wait for ``flush``."""
        if self.deferred is not None:
            self.deferred.append((name, table or name, write))
            return
        self.commit_now(name, write, table or name)

    def defer(self) -> None:
        self.deferred = []

    def commit_now(self, name: str, write: Callable[[], Any], table: str) -> None:
        self.check()
        write()
        self.written.add(table)
        crash_point(name, self.batch)

    def flush(self, tables: Sequence[str] = ()) -> dict[str, int | None]:
        """Run the deferred commits: each table's in order, different tables in parallel; the first failure
        is raised after every started commit has finished. Meanwhile the versions of ``tables`` that this
        run does not write are read, for the marker."""
        deferred, self.deferred = self.deferred or [], None
        by_table: dict[str, list[tuple[str, str, Callable[[], Any]]]] = {}
        for name, table, write in deferred:
            by_table.setdefault(table, []).append((name, table, write))
        probe = [n for n in tables if n not in by_table and n not in self.written and n not in self.absent]

        def run(steps: list[tuple[str, str, Callable[[], Any]]]) -> None:
            for name, table, write in steps:
                self.commit_now(name, write, table)

        with ThreadPoolExecutor(max_workers=max(1, len(by_table) + len(probe))) as pool:
            futures = [pool.submit(run, steps) for steps in by_table.values()]
            probes = {n: pool.submit(self.tables.version, self.name, n) for n in probe}
        for f in futures:
            f.result()
        return {**{n: None for n in tables if n in self.absent and n not in self.written},
                **{n: f.result() for n, f in probes.items()}}

    def versions(self, names: Sequence[str], probed: dict[str, int | None]) -> dict[str, int | None]:
        """The tables' latest versions for the marker. A table this run committed to is at the version
        of its own snapshot (this run holds the lease: no one else commits); the others were read while
        the commits ran (``probed``) or are asked for now, all at once."""
        versions = {n: self.tables.known_version(self.name, n) if n in self.written else probed[n]
                    for n in names if n in self.written or n in probed}
        unknown = [n for n in names if n not in versions or (n in self.written and versions[n] is None)]
        versions |= concurrently({n: (lambda n=n: self.tables.version(self.name, n)) for n in unknown})
        return {n: versions[n] for n in names}

    def plan_landed(self) -> None:
        """Wait for the plan's commit (raising its error): before anything else commits, and before the
        per-key step forks workers."""
        if self.plan_commit is not None:
            future, self.plan_commit = self.plan_commit, None
            future.result()

    def upkeep_landed(self) -> None:
        """Wait for the upkeep step: before the batch's commits, and before the per-key step forks."""
        if self.upkeep is not None:
            future, self.upkeep = self.upkeep, None
            future.result()
