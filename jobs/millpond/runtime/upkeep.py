"""Table upkeep, one step a batch from a fixed cycle: compact the tables that gain a file every batch,
keep each table's history to the pipeline's retention in turn (vacuum, checkpoint, expire the log). One
cycle bounds both what a batch pays and how long a table waits (its log tail and a compacted table's file
count stay under a cycle's length; its replaced files and log under its retention plus a cycle). It changes
no rows a reader sees, so it runs beside the batch, which has pinned the versions it reads; best-effort: a
failed step waits for its next turn.

Retention (``retention`` in ``conf/millpond.yaml``, lengthened by a pipeline's ``retention:``): every version
that was a table's latest at any time within it stays readable, files and log alike, so time travel, a
reprocess's rewind and a lagging stage reach back that far; what reaches further is refused in one line
naming the setting (``beyond_retention``), before anything is written."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from pathlib import Path

import yaml

from millpond.config import Settings
from millpond.errors import MillpondError
from millpond.lake.packing import pack
from millpond.lake.schemas import BOOKKEEPING_TABLES
from millpond.lake.tables import Tables
from millpond.model.spec import PipelineSpec, parse_retention

logger = logging.getLogger(__name__)

#: compacted once they pass COMPACT_OVER_FILES, so that what a batch pays does not grow with the number
#: of batches: the bookkeeping tables are read whole, and panes gets a file from every batch, while a
#: delta-rs commit's cost grows with the table's file count (measured: an append took 22 ms at 5 files,
#: 66 ms at 400; 23 ms at 400 versions compacted every 11 commits)
COMPACTED_TABLES = (*BOOKKEEPING_TABLES, "panes")
COMPACT_OVER_FILES = 8
#: compaction in two tiers: a batch's small files are packed into files of up to COMPACT_SMALL_BYTES once more
#: than COMPACT_OVER_FILES of them gather, and files below COMPACT_TARGET_BYTES (those) into files of up to that
#: once as many of them gather. delta-rs re-packs the last, unfilled bin each time, so a turn rewrites at most
#: about its tier's size of an output that grows without bound: small, since the batch waits for its upkeep step
#: before committing, and since the vacuum keeps every file a turn replaced for the retention (one tier, a
#: table packed whole into one file, rewrote it every cycle: a year-old `batches` would have been kept ~180
#: times over for a week). Files of large batches stand alone.
COMPACT_SMALL_BYTES = 256 << 10
COMPACT_TARGET_BYTES = 4 << 20
#: the smallest size an expiring pipeline's panes are packed up to (``compaction_tiers``)
COMPACT_FLOOR_BYTES = 16 << 10
#: a table's first commits replay about as fast as a checkpoint reads: its turns start at this version
CHECKPOINT_FROM_VERSION = 4


def upkeep_turns(output_tables: Sequence[str], state_tables: Sequence[str]) -> list[tuple[str, str]]:
    """The cycle: compact each of COMPACTED_TABLES (if it has more than COMPACT_OVER_FILES small files), then
    checkpoint each table (a checkpoint turn vacuums the table first and expires its log after, see
    ``maintain``). (Compactions and checkpoints on separate rotations collided: every 8 batches a
    compaction took the turn of the same checkpoint, and those tables were never checkpointed.)"""
    tables = sorted(set(output_tables) | set(state_tables) | set(BOOKKEEPING_TABLES))
    return [("compact", t) for t in COMPACTED_TABLES] + [("checkpoint", t) for t in tables]


def maintain(tables: Tables, pipeline: str, batch: int, turn: tuple[str, str], first: Future | None = None,
             retention_s: float | None = None, expire_us: int | None = None,
             writes_since: float | None = None) -> None:
    """One upkeep step. ``first``: a commit to the same table that must land before (one writer per table
    at a time). (``seen_ids`` is compacted by the batches' own commits to it, see ``steps.dedup``.)
    ``retention_s``: the pipeline's (``retention_of``; default: looked up by its name). ``expire_us``: the
    pipeline's ``expire:`` (its panes compact as ``compaction_tiers`` says). ``writes_since``: when the batch
    began writing (none of its data files is older; ``Table.vacuum``).

    A checkpoint turn vacuums first: a checkpoint forgets the files that versions replaced more than the
    table's retention ago, which a vacuum after it would no longer find. It expires the log last."""
    if first is not None:
        wait([first])
    op, table = turn
    try:
        if op == "compact":
            step = None if expire_us is None or table != "panes" else expire_step(expire_us)
            per_step = None if step is None else tables.table(pipeline, table).bytes_per_span("window_end", step)
            compact = (functools.partial(tables.compact, pipeline, table) if step is None  # by size (delta-rs's)
                       else functools.partial(pack, tables, pipeline, table, "window_end"))  # by time (expiring)
            done = any(compact(over_files=COMPACT_OVER_FILES, target_size=size)
                       for size in compaction_tiers(per_step))  # (one tier a turn: the first due)
            if done:
                return
        # (a compaction turn with nothing to compact checkpoints; a log of a few commits needs none)
        keep = retention_of(tables.settings, pipeline) if retention_s is None else retention_s
        tables.table(pipeline, table).vacuum(keep, writes_since)
        tables.checkpoint(pipeline, table, min_version=CHECKPOINT_FROM_VERSION)
        tables.table(pipeline, table).expire_log(keep)
    except MillpondError as exc:
        logger.warning("%s: table upkeep skipped in batch %d: %s", pipeline, batch, exc)


def compaction_tiers(per_step: int | None = None) -> tuple[int, ...]:
    """The file sizes a table's compaction packs up to, tier by tier. ``per_step``: for an expiring pipeline's
    ``panes`` (``expire:``), about how many bytes of panes one expiry step holds (``expire_step``); each tier is
    capped at it (at least COMPACT_FLOOR_BYTES), so that a packed file spans about one step of window ends and
    expires about when its rows would have. Uncapped, a file re-packed with the newest panes until it held its
    tier's size kept every pane of a pipeline whose ``expire`` holds less than that (measured: 300 files, 4.9 MB
    of panes after 2,000 batches under ``expire: 1d``, where a day of panes is ~0.3 MB)."""
    tiers = (COMPACT_SMALL_BYTES, COMPACT_TARGET_BYTES)
    if per_step is None:
        return tiers
    return tuple(dict.fromkeys(min(size, max(COMPACT_FLOOR_BYTES, per_step)) for size in tiers))


# -- expire: a time to live for output rows ---------------------------------------------------------------
#: the output tables ``expire:`` deletes rows of, by the column that says when a row's window ended (a late
#: record's: its event time, since its window had closed)
EXPIRING = {"panes": "window_end", "current": "window_end", "late": "event_time"}


#: an expiry runs when its horizon passes a multiple of this share of ``expire``, so a pipeline holds at most
#: ``expire`` and one such share of windows, and an expiry's rewrite of the files it cuts (and the copies of them
#: the retention keeps) comes that rarely: every 11 days under ``expire: 90d``
EXPIRE_STEPS = 8


def expire_step(expire_us: int) -> int:
    """The step an expiry's horizon moves by (``EXPIRE_STEPS``)."""
    return max(1, expire_us // EXPIRE_STEPS)


def expiry_horizon(expire_us: int, watermark_us: int) -> int:
    """Where an expiry at ``watermark_us`` deletes below: the watermark less ``expire``, down to a multiple of
    its step (the same horizon however the batches fall)."""
    step = expire_step(expire_us)
    return (watermark_us - expire_us) // step * step


def expire_rows(tables: Tables, pipeline: str, batch: int, horizon: int) -> dict[str, int]:
    """Remove the output tables' files whose rows all belong to windows that ended before ``horizon``
    (``expiry_horizon``; ``expire:``; ``Table.expire``: by file statistics, nothing rewritten, so a file goes
    with its last row): run after a batch's marker, when no commit of the pipeline is under way, once the horizon
    passed a step. A window ends ``allowed_lateness`` before it closes and ``expire`` is longer, so no pane can
    reach an expired window. ``panes`` keeps the files holding rows of ``batch`` (its last), so a stage's
    comparison of two versions across a reprocess still finds the batches they share; each commit notes the last
    batch it removed rows of, which such a stage checks (``steps.upstream.check_expired``). Returns the rows
    removed per table; best-effort: what a failed or killed expiry leaves, the next one removes."""
    deleted: dict[str, int] = {}
    for table, column in EXPIRING.items():
        try:
            done = tables.table(pipeline, table).expire(column, horizon, {"batch": batch},
                                                        batch_below=batch if table == "panes" else None)
        except MillpondError as exc:
            logger.warning("%s: expiring %s's rows skipped in batch %d: %s", pipeline, table, batch, exc)
            continue
        if done["rows"]:
            deleted[table] = done["rows"]
    return deleted


# -- retention -------------------------------------------------------------------------------------
#: how a refusal names the setting
RETENTION_SETTING = ("`retention` in conf/millpond.yaml (MILLPOND_RETENTION), or the pipeline file's own "
                     "`retention:`")


def retention_of(settings: Settings, pipeline: str, spec: PipelineSpec | None = None) -> float:
    """Seconds of history the pipeline's tables keep: the deployment's ``retention``, or the pipeline's own
    ``retention:`` when longer (from ``spec``, else from its file in ``conf/pipelines``)."""
    own = spec.retention if spec is not None else _filed_retention(settings.conf_dir, pipeline)
    return max(settings.retention_s, (own or 0) / 1_000_000)


def _filed_retention(conf_dir: Path, pipeline: str) -> int | None:
    """The ``retention:`` (us) of the pipeline file named ``pipeline`` in ``conf_dir/pipelines``, if any."""
    for path in sorted(Path(conf_dir, "pipelines").glob("*.y*ml")):
        try:
            doc = yaml.safe_load(path.read_text()) or {}
            if isinstance(doc, dict) and str(doc.get("name") or path.stem) == pipeline:
                return parse_retention(doc.get("retention"))
        except (OSError, yaml.YAMLError, ValueError):
            continue
    return None


def retained_s(tables: Tables, pipeline: str, table: str, spec: PipelineSpec | None = None) -> float:
    """How far back the table's history is whole: the shorter of the pipeline's retention and the one the
    table's last vacuum recorded (a retention lengthened since has not brought back what that vacuum deleted)."""
    applied = tables.table(pipeline, table).retention()
    return min(retention_of(tables.settings, pipeline, spec), applied if applied is not None else float("inf"))


def beyond_retention(tables: Tables, pipeline: str, table: str, version: int, spec: PipelineSpec | None = None,
                     now: float | None = None) -> str:
    """Why the table at ``version`` may no longer be whole ('' while it is within retention): it was replaced
    longer ago than the pipeline's retention (the shorter of the configured one and the one its last vacuum
    recorded), so its files may have been vacuumed and its log entries expired."""
    replaced = tables.table(pipeline, table).replaced_at(version)
    if replaced is None:
        return ""
    now = time.time() if now is None else now
    keep = retained_s(tables, pipeline, table, spec)
    if replaced > now - keep:
        return ""
    ago = "longer ago than the log keeps" if replaced <= 0 else f"{span_text(now - replaced)} ago"
    return (f"{pipeline}.{table} at version {version} was replaced {ago}, beyond {pipeline}'s retention of "
            f"{span_text(keep)} ({RETENTION_SETTING})")


def span_text(seconds: float) -> str:
    """A duration as text: 7d, 36h, 90m, 12s."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or seconds % size == 0 and seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"
