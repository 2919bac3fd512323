"""What became of a pipeline's landing files, and the way past one that keeps failing.

``millpond quarantine-file P FILE`` holds a file: the next batch of P (or the rerun of the batch that keeps
failing on it) quarantines it whole instead of reading it, and its plan records the hold. ``millpond
history P`` lists P's batches with their counts, spec changes and freshness breaches, then every file not read
as input: skipped (not a landing file), held by an operator, or quarantined whole (unreadable), each with its
batch and reason.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from millpond.config import Settings, load_settings
from millpond.errors import MillpondError
from millpond.lake.catalog import lake_tables
from millpond.lake.lease import Lease
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import BATCHES_SCHEMA, OPERATIONS_SCHEMA, PLAN_SCHEMA, QUARANTINE_SCHEMA
from millpond.lake.tables import Tables
from millpond.model.versions import changes
from millpond.quality.freshness import declared, history_markers
from millpond.runtime import rewind
from millpond.runtime.steps.plan import plan_of, plan_row, taken_files
from millpond.surface.cli import command

BOOKKEEPING = ("ingest_log", "batches")
HISTORY_COLUMNS = ("batch", "processing_time", "watermark", "files", "input", "accepted", "duplicates", "late",
                   "quarantined", "skipped", "panes", "engine", "strategy")


def hold_file(settings: Settings, pipeline: str, prefix: str, key: str, reason: str) -> str:
    """Record that the next batch of ``pipeline`` quarantines ``key`` whole; what was done, as a sentence.
    Refused while a batch holds the lease, for a file a committed batch took, and for a file in the plan
    of a batch that has begun committing its outputs (its rerun must redo exactly the same work)."""
    key = key if key.startswith(prefix) else prefix + key.lstrip("/")
    lease = Lease.acquire(settings, pipeline, wait=True)
    try:
        tables = Tables(settings)
        log = tables.read_whole(pipeline, "ingest_log", PLAN_SCHEMA)
        done = tables.read_whole(pipeline, "batches", BATCHES_SCHEMA)
        last = max(done.column("batch").to_pylist(), default=0)
        nxt = last + 1
        earlier = log.filter(pc.field("batch") <= last) if log.num_rows else log
        if key in taken_files(earlier):
            raise MillpondError(f"{key} was already taken by a committed batch of {pipeline}: nothing to hold "
                                f"(its rows are in {pipeline}.quarantine or the outputs)")
        plan = plan_of(log, nxt)
        if plan is not None and key in plan["held"]:
            return f"{pipeline}: {key} is already held for batch {nxt}"
        if plan is not None and key in plan["files"]:
            _refuse_if_committing(settings, tables, pipeline, nxt)
        elif not any(o.key == key for o in ObjectStore(settings).list(settings.bucket_landing, key)):
            raise MillpondError(f"no landing file {settings.bucket_landing}/{key} (files of {pipeline} are under "
                                f"{prefix!r})")
        lease.check()
        hold = {"files": [], "arrivals": [], "versions": None, "held": {key: reason}}
        tables.append(pipeline, "ingest_log", plan_row(nxt, None, hold))
    finally:
        lease.release()
    return f"{pipeline}: batch {nxt} will quarantine {key} whole ({reason}); run that batch again to move past it"


def _refuse_if_committing(settings: Settings, tables: Tables, pipeline: str, batch: int) -> None:
    app = rewind.app_id(pipeline, rewind.epoch(tables, pipeline))
    for name in lake_tables(settings, pipeline):
        if name not in BOOKKEEPING and (tables.txn_version(pipeline, name, app) or 0) >= batch:
            raise MillpondError(f"batch {batch} of {pipeline} has already committed to {pipeline}.{name}: its "
                                "rerun must read the same files; rerun it as it is")


def history(settings: Settings, pipeline: str, freshness: dict[str, int] | None = None) -> tuple[pa.Table, pa.Table]:
    """(the batches with their counts, the files not read as input with batch and reason). A pipeline that
    declares ``freshness`` (``freshness``: its thresholds in microseconds; default: its file's in the conf dir)
    gets a ``freshness`` column: per batch, the thresholds it exceeded ('' when fresh)."""
    tables = Tables(settings)
    done = tables.read_whole(pipeline, "batches", BATCHES_SCHEMA).sort_by("batch")
    batches = pa.table({c: done.column(c) if c in done.column_names
                        else pa.nulls(done.num_rows, BATCHES_SCHEMA.field(c).type) for c in HISTORY_COLUMNS})
    specs = done.column("spec").to_pylist() if "spec" in done.column_names else [None] * done.num_rows
    batches = batches.append_column("spec_change", pa.array(spec_changes(specs), pa.string()))
    limits = declared(settings, pipeline) if freshness is None else freshness
    if limits:
        rows = done.select(["batch", "processing_time", "watermark"]).to_pylist()
        batches = batches.append_column("freshness", pa.array(history_markers(pipeline, rows, limits), pa.string()))
    log = tables.read_whole(pipeline, "ingest_log", PLAN_SCHEMA)
    committed = set(done.column("batch").to_pylist())
    found: dict[tuple[int, str], dict[str, Any]] = {}  # a hold is in its request row and in the plan
    for r in log.to_pylist():
        state = "committed" if r["batch"] in committed else "pending"
        for what in ("skipped", "held"):
            for key, why in json.loads(r.get(what) or "{}").items():
                found[(r["batch"], key)] = {"batch": r["batch"], "file": key, "fate": what, "reason": why,
                                            "state": state}
    whole = tables.read_arrow(pipeline, "quarantine", schema=QUARANTINE_SCHEMA, filters=pc.field("line") == 0)
    for r in whole.to_pylist():
        found.setdefault((r["batch"], r["source_file"]), {
            "batch": r["batch"], "file": r["source_file"], "fate": "quarantined", "reason": r["reason"],
            "state": "committed"})
    rows = sorted(found.values(), key=lambda x: (x["batch"], x["file"]))
    schema = pa.schema([("batch", pa.int64()), ("file", pa.string()), ("fate", pa.string()), ("reason", pa.string()),
                        ("state", pa.string())])
    return batches, pa.Table.from_pylist(rows, schema=schema)


def operations(settings: Settings, pipeline: str) -> pa.Table:
    """The pipeline's operations on its own tables (reprocesses: when, by whom, rewound to which batch)."""
    ops = Tables(settings).read_arrow(pipeline, "operations", schema=OPERATIONS_SCHEMA).sort_by("at").to_pylist()
    rows = []
    for o in ops:
        d = json.loads(o["detail"] or "{}")
        rows.append({"at": o["at"], "operation": o["operation"], "by": o["by"], "from": d.get("from"),
                     "rewound_to_batch": (d.get("to_batch") or 0) if o["operation"] == "reprocess" and not d.get("noop")
                     else None,
                     "was_at_batch": d.get("last_batch")})
    schema = pa.schema([("at", OPERATIONS_SCHEMA.field("at").type), ("operation", pa.string()), ("by", pa.string()),
                        ("from", pa.string()), ("rewound_to_batch", pa.int64()), ("was_at_batch", pa.int64())])
    return pa.Table.from_pylist(rows, schema=schema)


def spec_changes(specs: list[str | None]) -> list[str]:
    """Per batch, how its spec differs from the batch before ('' unchanged; 'recorded' for the first spec
    recorded): where a pipeline's spec changed, for ``millpond history P``."""
    out, before = [], None
    for text in specs:
        if text is None:
            out.append("")
            continue
        spec = json.loads(text)
        if before is None:
            out.append("recorded")
        else:
            breaking, safe = changes(before, spec)
            out.append(", ".join(breaking + safe))
        before = spec
    return out


def _configure_hold(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="a pipeline name from conf/pipelines, or a path to a pipeline YAML")
    p.add_argument("file", help="the landing file's key (as the failure names it), or its name under the prefix")
    p.add_argument("--reason", default="", help="why, for the quarantine row (default: none given)")


@command("quarantine-file", "quarantine a landing file whole in the next batch (a file that keeps failing)",
         _configure_hold)
def _hold(args: argparse.Namespace) -> int:
    from millpond.config.pipelines import pipeline_named

    settings = load_settings()
    spec = pipeline_named(settings.conf_dir, args.pipeline)
    print(hold_file(settings, spec.name, spec.source_prefix, args.file, args.reason))
    return 0
