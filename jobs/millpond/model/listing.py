"""How a pipeline lists its landing prefix: incrementally (the default) or whole.

A batch takes the files that arrived before its processing time and that no batch took yet. Listing the
whole prefix every batch costs what the prefix's history holds (a year of 5-minute batches: ~400k keys).
Keys named ``<prefix>arrival=<time>...``, as the injectors, the demo and the replay write them, sort by
arrival time, so a batch lists only those from its cursor on — the previous batch's processing time minus
``lookback`` (a file may be written that long after the arrival its key names), held back by a file the
previous batch saw still being written — plus every key that is not named that way. A batch whose
processing time enters a new ``full_listing_every`` period lists the whole prefix once, so a tagged file
written later than the lookback is still taken then, never lost (Databricks Auto Loader's incremental
listing with its periodic backfill listing, in the same spirit). Pure: the lake does the listing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from millpond.model.timeutil import parse_duration

INCREMENTAL, FULL = "incremental", "full"
#: the source block's keys that say how to list (none of them changes what a batch computes)
LISTING_KEYS = ("listing", "lookback", "full_listing_every")
DEFAULT_LOOKBACK = "1h"
DEFAULT_FULL_EVERY = "1d"


@dataclass(frozen=True)
class Listing:
    mode: str = INCREMENTAL
    #: how long after the arrival its key names a file may still be written and be listed incrementally
    lookback: int = parse_duration(DEFAULT_LOOKBACK)
    #: one whole listing per period of processing time (0: never)
    full_every: int = parse_duration(DEFAULT_FULL_EVERY)

    @classmethod
    def from_source(cls, source: dict[str, Any]) -> Listing:
        mode = source.get("listing", INCREMENTAL)
        if mode not in (INCREMENTAL, FULL):
            raise ValueError(f"source.listing = {mode!r}: use {INCREMENTAL} (list from the last batch on) or "
                             f"{FULL} (list the whole prefix every batch)")
        out = {}
        for key, default in (("lookback", DEFAULT_LOOKBACK), ("full_listing_every", DEFAULT_FULL_EVERY)):
            try:
                out[key] = parse_duration(source.get(key, default))
            except ValueError as exc:
                raise ValueError(f"source.{key}: {exc}") from None
            if out[key] < 0:
                raise ValueError(f"source.{key} = {source[key]!r}: a duration of zero or more")
        return cls(mode, out["lookback"], out["full_listing_every"])

    def cursor(self, previous_processing_time: int | None, oldest_pending: int | None,
               processing_time: int) -> int | None:
        """The arrival time from which a batch at ``processing_time`` lists tagged keys (None: the whole
        prefix): nothing before the pipeline's first batch, the start of each full-listing period, or in
        ``full`` mode."""
        if self.mode == FULL or previous_processing_time is None:
            return None
        if self.full_every and processing_time // self.full_every != previous_processing_time // self.full_every:
            return None
        cursor = previous_processing_time - self.lookback
        return cursor if oldest_pending is None else min(cursor, oldest_pending)
