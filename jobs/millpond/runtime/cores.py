"""The driver path's per-key step on every core of the machine.

The step is Python, so one process uses one core. A chunk's keys are cut into contiguous ranges of
about equal expected cost; forked children inherit the batch's Arrow columns and the work function
(copy-on-write, nothing serialized on the way in), each makes its own range's Python objects and runs
it, and returns its output already assembled into Arrow tables, which pickle as buffers. The results
come back in range order, so the output is the same as one process's, whatever the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


def _child(send, lo: int, hi: int) -> None:
    """In a forked child: run the range, send back (True, result) or (False, exception, traceback)."""
    try:
        assert _work is not None, "called outside map_ranges"
        message: tuple = (True, _work(lo, hi))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the job
        message = (False, exc, traceback.format_exc())
    try:
        send.send(message)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
        send.send((False, RuntimeError(repr(message[1])), message[-1]))
    finally:
        send.close()


def map_ranges(work: Callable[[int, int], T], weights: Sequence[int], workers: int, min_range: int,
               before_fork: Callable[[], object] | None = None) -> list[T]:
    """``work(lo, hi)`` over contiguous ranges of items (``weights``: the cost of each), results in range
    order: the first range in this process, each other one in a forked child of its own, at the same time.
    A child's exception is raised here; a child that dies (killed, out of memory) has its range run here.
    ``before_fork`` runs only if children are forked (e.g. to wait for the caller's other threads).
    ``workers``: forked children at most (``engine.driver_workers``); ``min_range``: the least work, in
    weight, worth a fork (``engine.driver_min_range``)."""
    global _work
    total = sum(weights)
    parts = 1 + min(workers, max(0, total // max(1, min_range) - 1))
    if parts <= 1 or not can_fork():
        return [work(0, len(weights))]
    spans = ranges(weights, parts)
    if len(spans) <= 1:
        return [work(*spans[0])] if spans else []
    if before_fork is not None:
        before_fork()
    ctx = multiprocessing.get_context("fork")
    _work = work
    children = []
    try:
        for lo, hi in spans[1:]:
            recv, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_child, args=(send, lo, hi), daemon=True, name=f"millpond-keys-{lo}")
            child.start()
            send.close()
            children.append((child, recv, lo, hi))
        out: list[T] = [work(*spans[0])]
        for child, recv, lo, hi in children:
            try:
                message = recv.recv()
            except EOFError:
                child.join()
                logger.warning("per-key worker for keys %d..%d died (exit code %s); running them in the job",
                               lo, hi, child.exitcode)
                out.append(work(lo, hi))
                continue
            if not message[0]:
                raise message[1] from RuntimeError(f"in the per-key worker for keys {lo}..{hi}:\n{message[2]}")
            out.append(message[1])
        return out
    finally:
        _work = None
        for child, recv, _, _ in children:
            recv.close()
            if child.is_alive():
                child.kill()
            child.join()
