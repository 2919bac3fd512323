"""Where a running batch is, in its task log: each step as it starts and ends, with its counts, and a long
read every few seconds (files done of the total). A batch that waits on a service then shows which step it
waits in. Logger ``millpond.batch`` at INFO (an Airflow task log shows it); a dozen lines a batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("millpond.batch")

#: a long step reports how far it is at most this often
EVERY_S = 10.0


def _counts(counts: dict[str, object]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items() if v is not None)


def begin(label: str, step: str, **counts: object) -> None:
    """A step starts (``label``: the pipeline and batch)."""
    detail = _counts(counts)
    log.info("%s: %s started%s", label, step, f" ({detail})" if detail else "")


def done(label: str, step: str, seconds: float, **counts: object) -> None:
    """A step ended after ``seconds``."""
    detail = _counts(counts)
    log.info("%s: %s done in %.2fs%s", label, step, seconds, f" ({detail})" if detail else "")


def counter(label: str, step: str, total: int, unit: str, every_s: float = EVERY_S) -> Callable[[int], None]:
    """A callback for each item of a step done (with the rows it gave): says how far the step is, every
    ``every_s`` seconds while it runs; the step's end is told by ``done``."""
    state = {"n": 0, "rows": 0, "last": time.monotonic()}

    def tick(rows: int = 0) -> None:
        state["n"] += 1
        state["rows"] += rows
        now = time.monotonic()
        if now - state["last"] >= every_s and state["n"] < total:
            state["last"] = now
            log.info("%s: %s %d of %d %s (%d rows so far)", label, step, state["n"], total, unit, state["rows"])

    return tick
