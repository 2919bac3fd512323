"""The driver path's per-key step on every core of the machine.

The step is Python, so one process uses one core. Forking after a chunk's elements exist as Python
objects hands them to the children for free (copy-on-write, nothing serialized); each child runs a
contiguous range of keys and returns its output already assembled into Arrow tables, which pickle as
buffers. The ranges are contiguous and their results come back in range order, so the output is the
same as one process's, whatever the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: helper processes forked for a chunk's per-key step (``MILLPOND_DRIVER_WORKERS``); default one per
#: extra core, 0 keeps the step in the job's process
WORKERS = int(os.environ.get("MILLPOND_DRIVER_WORKERS", str(max(0, (os.cpu_count() or 1) - 1))))
#: a range smaller than this (elements + state rows) is not worth a fork (~20-50 ms on a large heap)
MIN_RANGE = int(os.environ.get("MILLPOND_DRIVER_MIN_RANGE", "20000"))

_work: Callable[[int, int], object] | None = None


def can_fork() -> bool:
    """Linux only: macOS's fork is unsafe once system frameworks have started threads."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def ranges(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous index ranges of about equal total weight (none empty)."""
    n = len(weights)
    if parts <= 1 or n <= 1:
        return [(0, n)] if n else []
    cum = np.cumsum(np.asarray(weights, np.int64))
    total = int(cum[-1])
    cuts = [0] + [int(np.searchsorted(cum, total * i / parts, side="left")) + 1 for i in range(1, parts)] + [n]
    cuts = sorted(set(min(max(c, 0), n) for c in cuts))
    return list(zip(cuts, cuts[1:], strict=False))


def _run(lo: int, hi: int) -> object:
    assert _work is not None, "called outside map_ranges"
    return _work(lo, hi)


def map_ranges(work: Callable[[int, int], T], weights: Sequence[int], workers: int | None = None,
               min_range: int | None = None) -> list[T]:
    """``work(lo, hi)`` over contiguous ranges of items (``weights``: the cost of each), results in range
    order: the first range in this process, the others in forked children running at the same time."""
    global _work
    workers = WORKERS if workers is None else workers
    min_range = MIN_RANGE if min_range is None else min_range
    total = sum(weights)
    parts = 1 + min(workers, max(0, total // max(1, min_range) - 1))
    if parts <= 1 or not can_fork():
        return [work(0, len(weights))]
    spans = ranges(weights, parts)
    if len(spans) <= 1:
        return [work(*spans[0])] if spans else []
    _work = work
    try:
        pool = ProcessPoolExecutor(max_workers=len(spans) - 1, mp_context=multiprocessing.get_context("fork"))
        try:
            futures = [pool.submit(_run, lo, hi) for lo, hi in spans[1:]]  # the fork happens here
            out: list[T] = [work(*spans[0])]
            for (lo, hi), f in zip(spans[1:], futures, strict=True):
                try:
                    out.append(f.result())
                except BrokenProcessPool as exc:  # a child died (e.g. killed): its range runs here
                    logger.warning("per-key worker for keys %d..%d died (%s); running them in the job", lo, hi, exc)
                    out.append(work(lo, hi))
            return out
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        _work = None
