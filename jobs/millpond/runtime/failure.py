"""A batch that fails for a reason the code did not foresee (a bug, or input no rule covers) fails with one
line: the pipeline, the batch, what it was processing when it can tell (the steps add ``millpond: ...``
notes to the exception: the file, the key), the error, and the way forward. The traceback stays on the
exception's cause for the task log."""

from __future__ import annotations

from millpond.errors import MillpondError
from millpond.model.timeutil import iso

NOTE = "millpond: "
GUIDE = "docs/operations.md, 'Bad input and stuck files'"


class BatchFailed(MillpondError):
    """A batch failed unexpectedly; its plan stays committed, so a rerun does the same work."""


def where(exc: BaseException) -> str:
    """What the batch was processing, from the steps' notes on the exception ('' if none said)."""
    notes = [n[len(NOTE):] for n in getattr(exc, "__notes__", ()) if n.startswith(NOTE)]
    return ", ".join(dict.fromkeys(notes))


def batch_failed(pipeline: str, batch: int | None, processing_time: int, exc: BaseException) -> BatchFailed:
    """The one-line error for an unexpected failure of batch ``batch`` of ``pipeline``."""
    at = where(exc)
    error = " ".join(f"{type(exc).__name__}: {_last_error(str(exc))}".split())[:300]
    which = f"batch {batch}" if batch else "a batch"
    file_hint = f"`millpond quarantine-file {pipeline} FILE`" if "file " not in at else \
        f"`millpond quarantine-file {pipeline} {at.split('file ', 1)[1].split(',')[0]}`"
    return BatchFailed(
        f"{pipeline} {which} at {iso(processing_time)} failed" + (f" while processing {at}" if at else "")
        + f": {error}. Its plan is committed, so a rerun does the same work: fix the cause and rerun "
        f"(`millpond batch {pipeline} --at {iso(processing_time)}`), or move past a file that keeps failing "
        f"with {file_hint} ({GUIDE})")


def _last_error(text: str) -> str:
    """The error itself when the message carries a traceback (a Spark task's Python error does)."""
    if "Traceback (most recent call last)" not in text:
        return text
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    return lines[-1] if lines else text
