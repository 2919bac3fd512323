"""Errors a user can act on: each renders as one line that says what to do."""

from __future__ import annotations


class MillpondError(RuntimeError):
    """A failure with a one-line, actionable message (no stack trace for the user)."""


class StoreUnreachable(MillpondError):
    pass


class ApiRefused(MillpondError):
    """A service's HTTP API answered with an error status (``status``), which a caller may handle by number."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class BadCredentials(MillpondError):
    pass


class BucketMissing(MillpondError):
    pass


class PrerequisiteMissing(MillpondError):
    pass


class ObjectMissing(MillpondError):
    """An object that was listed is gone (deleted in between)."""


class LeaseLost(MillpondError):
    """Another run of the same pipeline owns the lease: this one must not commit."""


class PipelineChanged(MillpondError):
    """The pipeline's spec changed in a way that reinterprets its stored state: the batch writes nothing."""
