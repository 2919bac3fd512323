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


class LeaseHeld(LeaseLost):
    """Another run holds the pipeline's lease, so this one did not start. ``expires``: when the lease lapses
    (epoch seconds) unless its holder renews it; ``holder``: who holds it, as the message names it."""

    def __init__(self, message: str, expires: float = 0.0, holder: str = "") -> None:
        super().__init__(message)
        self.expires, self.holder = expires, holder


class LeaseLapsed(LeaseLost):
    """This run's lease has lapsed, or would before a commit started now could end (its renewals fail):
    another run may take it at any moment, so this one stops before committing."""
