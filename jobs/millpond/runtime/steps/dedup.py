"""Dedup: a record id counts once, across batches and retries. Within the batch the first by (arrival,
file, line) of each id wins; ids accepted by earlier batches (``seen_ids``, read only over the batch's
event-time range) are duplicates. Ids expire behind the watermark plus the dedup horizon."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.delta_files import time_spans
from millpond.lake.schemas import SEEN_SCHEMA
from millpond.lake.sql import sql_in, sql_ts
from millpond.model.panes import TS
from millpond.model.timeutil import MIN_TS, parse_duration

if TYPE_CHECKING:
    from millpond.runtime.context import BatchContext

#: up to this many ids/keys a SQL IN list (file pruning); above, a scan probed in Arrow
SMALL_IN_LIST = 200
#: ids probed against earlier batches' ``seen_ids`` per call (bounds the Python lists handed over)
SEEN_PROBE_CHUNK = 1_000_000
#: ``seen_ids`` is read by every batch's dedup (an event-time range that spans its files). A batch's own commit
#: to it may fold it: replace its files by the ids within the dedup horizon plus its own, from the rows its
#: dedup read anyway (``seen_keep_from``). Never with this many files or fewer;
SEEN_FOLD_OVER_FILES = 4
#: with more, once the files whose every id has expired (their greatest event time behind the horizon) hold this
#: share of its rows: a fold rewrites every id it keeps, and folding whenever one id had expired rewrote the whole
#: table on every batch (under a day's horizon, 5-minute batches rewrote 288 times what each added); so the table
#: holds about two horizons of ids at most;
SEEN_FOLD_EXPIRED_SHARE = 0.1
#: and, whatever has expired, once it has more than this many files (each accepting batch adds at least one; the
#: dedup of the local engine opens each of them: 57 ms a batch at 32 small files, 20 ms at 4)
SEEN_FOLD_OVER_MANY_FILES = 32


def seen_keep_from(job: BatchContext, w_in: int, seen_version: int | None) -> int | None:
    """Whether this batch replaces seen_ids' files (by its files' statistics at the pinned version: the
    SEEN_FOLD_* rules above; a file without them: a fold), and if so from which event time on earlier
    ids are kept: those within the dedup horizon of the input watermark (a re-delivery older than that is beyond
    allowed lateness anyway); every one (MIN_TS) where ids are kept for good, and then only past
    SEEN_FOLD_OVER_MANY_FILES files: that fold compacts. Only a batch that accepts an id writes seen_ids
    (``steps.commit.commit_inputs``), so only it replaces the files, on every engine: a batch that accepts nothing
    expires nothing (issue 36)."""
    if seen_version is None:
        return None
    horizon = dedup_horizon(job)
    # ids kept for good (the global window, a custom window without a span), or none behind the horizon yet:
    # only compacted, every id kept (MIN_TS), so that a year of batches does not leave a file each
    forever = horizon is None or w_in - horizon <= MIN_TS
    spans = time_spans(job.tables, job.name, "seen_ids", seen_version, "event_time")
    keep_from = MIN_TS if forever else w_in - horizon
    if len(spans) <= SEEN_FOLD_OVER_FILES:
        return None
    if len(spans) > SEEN_FOLD_OVER_MANY_FILES or any(hi is None for _, _, hi in spans):
        return keep_from
    if forever:
        return None
    expired = sum(rows for rows, _lo, hi in spans if hi < keep_from)
    return keep_from if expired and expired >= SEEN_FOLD_EXPIRED_SHARE * sum(rows for rows, _, _ in spans) else None


def by_id(job: BatchContext) -> bool:
    """Whether the batch's elements are deduplicated by id (and their ids kept in ``seen_ids``). A landing
    batch's are: a source may deliver an event twice. A stage's are not: it consumes its upstreams' panes by
    version range, each range once, pinned by its plan and committed under the batch's transaction (a retry
    reads the same range, a rewind of either side moves the ranges, ``steps.upstream``), and its elements' ids
    are unique by construction (``steps.upstream.pane_elements``: upstream epoch, key, window, pane index, kind).
    A dedup by id would only cost a shuffle of every pane row and a ``seen_ids`` row per upstream pane."""
    return job.spec.upstream is None


class Deduped(NamedTuple):
    """What the dedup gives the batch."""

    #: the accepted elements, in (arrival, file, line) order
    accepted: pa.Table
    #: the earlier ids ``seen_ids`` keeps when this batch replaces its files (``seen_keep_from``), else None
    kept: pa.Table | None
    #: asked for (a validated batch): its well-formed input one row per id, its first delivery (``id``, ``key``,
    #: ``value``, ``event_time``), with ``chk_id_copies``: how many times the batch's input held the id, plus one
    #: where an earlier batch accepted it (the raw suite warns on more than one). Else None.
    delivered: pa.Table | None = None


def dedup(job: BatchContext, good: pa.Table, seen_version: int | None, w_in: int, copies: bool = False
          ) -> Deduped:
    """Within the batch the first by (arrival, file, line) of each id wins; ids accepted by earlier
    batches are duplicates; the earlier ids kept are taken by the same read (``Deduped``). A stage's elements
    (``by_id``) are all accepted, in the same order. ``copies``: also give ``Deduped.delivered``."""
    n = good.num_rows
    if not n or not by_id(job):
        accepted = good if not n else good.take(pc.sort_indices(good.column("arrival_time")))
        return Deduped(accepted, None, _delivered(accepted, np.ones(n, np.int64)) if copies else None)
    order = pc.sort_indices(good.column("arrival_time")).to_numpy()  # stable (see _read)
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    firsts = pa.table({"id": good.column("id"), "rank": rank}).group_by("id").aggregate(
        [("rank", "min"), *([("rank", "count")] if copies else [])])
    del rank
    counts = np.ones(n, np.int64) if copies else None  # each first delivery's copies in this batch
    if firsts.num_rows == n:
        keep = order
    else:
        by_arrival = np.argsort(firsts.column("rank_min").to_numpy())
        keep = order[firsts.column("rank_min").to_numpy()[by_arrival]]
        if copies:
            counts = firsts.column("rank_count").to_numpy()[by_arrival]
    del firsts, order
    accepted = good.take(keep)
    del keep
    seen: set[str] = set()
    kept = None
    ids, event_times = accepted.column("id"), accepted.column("event_time")
    if seen_version is not None:  # else no earlier batch has accepted anything
        keep_from = seen_keep_from(job, w_in, seen_version)
        if keep_from is not None:
            seen, kept = seen_and_kept(job, seen_version, ids, event_times, keep_from)
        else:
            for lo in range(0, accepted.num_rows, SEEN_PROBE_CHUNK):
                seen |= seen_before(job, seen_version, ids.slice(lo, SEEN_PROBE_CHUNK).to_pylist(),
                                   event_times.slice(lo, SEEN_PROBE_CHUNK).to_pylist())
    earlier = pc.is_in(ids, value_set=pa.array(sorted(seen), pa.string())) if seen else None
    delivered = None
    if copies:  # an id an earlier batch accepted: one more copy
        again = 0 if earlier is None else pc.cast(earlier, pa.int64()).to_numpy()
        delivered = _delivered(accepted, counts + again)
    return Deduped(accepted if earlier is None else accepted.filter(pc.invert(earlier)), kept, delivered)


#: ``quality.suites.COPIES`` (not imported: that module brings pandas into an executor's one-task batch)
COPIES = "chk_id_copies"


def _delivered(firsts: pa.Table, copies: np.ndarray) -> pa.Table:
    """``Deduped.delivered`` from the first delivery of each id and its count."""
    return firsts.select(["id", "key", "value", "event_time"]).append_column(
        COPIES, pa.array(copies, pa.int64()))


def seen_and_kept(job: BatchContext, version: int, ids: pa.ChunkedArray, event_times: pa.ChunkedArray,
                   keep_from: int) -> tuple[set[str], pa.Table]:
    """``seen_before`` from one read that also holds the earlier ids from ``keep_from`` on: every row from
    the earlier of the batch's first event time and ``keep_from`` on."""
    first, last = pc.min(event_times).as_py(), pc.max(event_times).as_py()
    ts = pc.field("event_time")
    t = job.tables.read_arrow(job.name, "seen_ids", version=version, schema=SEEN_SCHEMA,
                               filters=ts >= pa.scalar(min(first, keep_from), pa.int64()).cast(TS))
    kept = t.filter(ts >= pa.scalar(keep_from, pa.int64()).cast(TS))
    t = t.filter((ts >= pa.scalar(first, pa.int64()).cast(TS)) & (ts <= pa.scalar(last, pa.int64()).cast(TS)))
    hits = t.column("id").filter(pc.is_in(t.column("id"), value_set=pc.cast(ids, pa.string()).combine_chunks()))
    return set(hits.to_pylist()), kept

def seen_before(job: BatchContext, version: int | None, ids: list[str], event_times: list[int]) -> set[str]:
    """Ids already accepted by earlier batches. A record id names one event, whose event time does
    not change: only files whose event-time range overlaps the batch's are read (file statistics)."""
    if version is None or not ids:
        return set()
    if len(ids) <= SMALL_IN_LIST:
        where = (f"event_time >= {sql_ts(min(event_times))} AND event_time <= {sql_ts(max(event_times))} AND "
                 + sql_in("id", ids))
        t = job.tables.select(job.name, "seen_ids", where, columns=["id"], version=version)
    else:
        # A long IN list costs more than reading the range's ids (file statistics prune by event time)
        # and probing them in Arrow.
        lo, hi = (pa.scalar(v, pa.int64()).cast(TS) for v in (min(event_times), max(event_times)))
        t = job.tables.read_arrow(job.name, "seen_ids", columns=["id"], version=version,
                                   filters=(pc.field("event_time") >= lo) & (pc.field("event_time") <= hi))
    hits = t.column("id").filter(pc.is_in(t.column("id"), value_set=pa.array(ids, pa.string())))
    return set(hits.to_pylist())

def dedup_horizon(job: BatchContext) -> int | None:
    """How far behind the watermark a record id must be remembered: past it, a re-delivery is late
    anyway (its window is beyond allowed lateness) and is dropped and counted as late. A pipeline file's
    explicit horizon is never shorter than this default (``model.spec.check_dedup_horizon``)."""
    cfg = job.spec.raw.get("dedup") or {}
    if "horizon" in cfg:
        return parse_duration(cfg["horizon"])
    span = job.strategy.window_fn.span()
    return None if span is None else job.spec.allowed_lateness + span
