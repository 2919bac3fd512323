"""Cost follows the batch, not the state (issue 39, item 7): one small batch on the Spark engine against a
``windows`` table of few stored windows and of many, the same batch (events, touched keys) each time.

Each run is a fresh sessions pipeline (gap 30m, on-time panes only, so the stored sessions stay open: no timer
of theirs is due at the measured batch). Its first batch (a Connect client, as every run here) stores the
sessions of ``TEMPLATE_KEYS`` keys; the bench then replaces its ``windows`` table by ``n`` stored sessions, one
per key ``u0000000``.., each a copy of one of those rows under another key (what a first batch with one element
per key would have stored), written as the Spark engine writes the table: files of contiguous key ranges of
``spark_state.FILE_ROWS`` rows with their statistics (``lake.spark_io.write_table``), committed in one commit.
The measured batch, in a fresh client on the warm server, then lands ``events`` elements on ``touched`` keys
that each extend their key's stored session:

- ``hot``: the touched keys are the first ones in key order (Zipf's hot keys, as the bench's workloads name
  them: ``u`` + rank), so they share a few files;
- ``spread``: the touched keys are spread evenly over all ``n`` keys, the worst case for a layout by key
  ranges: every file holds one, so the batch reads and rewrites them all (copy-on-write without deletion
  vectors cannot do better; see docs/architecture.md). It runs with at most ``SPREAD_MAX`` stored windows.

One run at the small size goes first, not counted: the server's first plan-strategy batches compile their code.

Records: ``state_scale_<events>_batch_<n>_vs_<n0>_windows_<pattern>`` (the batch's seconds with ``n`` stored
windows against with ``n0``; target <= 2x).
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from millpond.lake.file_commits import commit_files, live_files
from millpond.lake.objectstore import ObjectStore
from millpond.lake.schemas import WINDOWS_STATS_COLUMNS
from millpond.lake.snapshot_files import Storage
from millpond.lake.spark_io import write_table
from millpond.lake.tables import Tables
from millpond.model.state import WINDOWS_SCHEMA
from millpond.model.timeutil import US
from millpond.runtime.engines.spark_state import FILE_ROWS

from bench.workload import DEFAULT_START, WorkloadSpec, land

#: (stored windows, few then many), the batch's events and the keys it touches, by the bench plan's name
SIZES = {"smoke": ((1_000, 5_000), 500, 50), "quick": ((20_000, 200_000), 10_000, 200),
         "default": ((100_000, 1_000_000), 10_000, 1_000), "full": ((100_000, 10_000_000), 10_000, 1_000)}
PATTERNS = ("hot", "spread")
#: the most stored windows the spread pattern runs with
SPREAD_MAX = 1_000_000
#: the smoke test's plan: the machinery once, at its smallest
SMOKE_PATTERNS = ("hot",)
TEMPLATE_KEYS = 1_000
MINUTE = 60 * US
DOC = {"value_type": "int", "window": {"type": "sessions", "gap": "30m"}, "trigger": "AtWatermark()",
       "accumulation": "accumulating_and_retracting", "aggregation": "sum", "allowed_lateness": "1h",
       "batch_interval": "5m", "watermark": {"policy": "processing_time", "lag": "2m"}}
TARGET = "the batch's time with {big:,} stored windows <= 2x with {small:,}"


def _events(keys: list[str], per_key: int, lo_us: int, batch: int, seed: int) -> pa.Table:
    """``per_key`` elements of each key at event times in [lo, lo + 3m), arriving up to 30 s later."""
    rng = np.random.default_rng(seed)
    n = len(keys) * per_key
    event = lo_us + rng.integers(0, 3 * MINUTE, n, dtype=np.int64)
    arrival = np.sort(event + rng.integers(0, 30 * US, n, dtype=np.int64))
    return pa.table({"id": pa.array([f"b{batch}-{i}" for i in range(n)]),
                     "key": pa.array(np.repeat(np.array(keys, dtype=object), per_key)[rng.permutation(n)]),
                     "value": pa.array(rng.integers(1, 100, n, dtype=np.int64)), "event_time": pa.array(event),
                     "arrival_time": pa.array(arrival), "batch": pa.array(np.full(n, batch, np.int32))})


def key_names(indexes: np.ndarray) -> list[str]:
    return [f"u{i:07d}" for i in indexes]


def touched_keys(n: int, touched: int, pattern: str) -> list[str]:
    """The keys the measured batch touches among ``n`` stored ones."""
    if pattern == "hot":
        return key_names(np.arange(touched))
    return key_names(np.linspace(0, n - 1, touched).astype(np.int64))


class StateScaleMeasures:
    """Measure methods of ``bench.harness.Bench`` for the state's size against a batch's cost (mixed in)."""

    def replace_windows(self, name: str, n: int) -> float:
        """The pipeline's ``windows`` replaced by ``n`` stored sessions (copies of its rows under keys
        ``u0000000``..), as key-range files; the seconds it took."""
        t = time.perf_counter()
        tables = Tables(self.settings)
        template = tables.read_arrow(name, "windows").sort_by("key")
        storage, uri = Storage.of(self.settings), self.settings.table_uri(name, "windows")

        def write(lo: int) -> list[str]:  # one file's rows made where they are written: 10M rows never held
            index = np.arange(lo, min(n, lo + FILE_ROWS))
            rows = template.take(pa.array(index % template.num_rows))
            return write_table(storage, uri, rows.set_column(rows.schema.get_field_index("key"), "key",
                                                             pa.array(key_names(index))))

        with ThreadPoolExecutor(4) as pool:
            actions = [a for chunk in pool.map(write, range(0, n, FILE_ROWS)) for a in chunk]
        removes = live_files(tables, name, "windows", tables.open(name, "windows").version())
        commit_files(tables, name, "windows", [json.loads(a) for a in actions], WINDOWS_SCHEMA, None,
                     removes=removes, stats_columns=WINDOWS_STATS_COLUMNS)
        return time.perf_counter() - t

    def state_scale_run(self, n: int, events: int, touched: int, pattern: str) -> dict[str, Any]:
        """One fresh pipeline: seeded, its state replaced by ``n`` windows, then the measured batch."""
        name = f"bench_state_{uuid.uuid4().hex[:8]}"
        prefix = f"bench/{name}/"
        spec = WorkloadSpec(events=events, keys=n, batches=2, interval_us=5 * MINUTE, start_us=DEFAULT_START)
        seed = _events(key_names(np.arange(10**7 - TEMPLATE_KEYS, 10**7)), 1, DEFAULT_START + MINUTE, 0, 1)
        batch = _events(touched_keys(n, touched, pattern), events // touched, DEFAULT_START + 6 * MINUTE, 1, 2)
        land(ObjectStore(self.settings), self.settings.bucket_landing, prefix, spec,
             pa.concat_tables([seed, batch]))
        doc = {**DOC, "name": name, "source": {"prefix": prefix}}
        plan = {"mode": "batches", "pipelines": [doc], "overrides": {"engine_one_task_below": 0}}  # the plan, always
        self.client({**plan, "steps": [[0, DEFAULT_START + 5 * MINUTE, None]]})
        replaced = self.replace_windows(name, n)
        res = self.client({**plan, "steps": [[0, DEFAULT_START + 10 * MINUTE, None]]})
        b = res["batches"][0]
        after = Tables(self.settings).open(name, "windows")
        stored = pc.sum(pa.table(after.get_add_actions(flatten=True)).column("num_records")).as_py()
        return {"n": n, "pattern": pattern, "seconds": b["seconds"], "phases": b["phases"], "path": b["path"],
                "state_rows_read": b["counts"].get("state_rows_read"), "replace_s": round(replaced, 2),
                "windows_after": stored, "files_after": len(after.file_uris())}

    def measure_state_scale(self) -> None:
        if not self.plan.spark_engine_events:  # a plan without the Spark engine's measures
            return
        (small, big), events, touched = SIZES.get(self.plan.name, SIZES["default"])
        self.connect_url()
        self.log(f"state scale: a {events:,}-event batch touching {touched:,} keys, with {small:,} and {big:,} "
                 "stored windows (Spark engine, Connect clients)")
        # the server's first plan-strategy batches compile the plans' code (the warm-up batch was one task): one
        # run not counted, so that the small state's run is not the one that pays for it (the smoke's toy sizes
        # measure nothing: no warm-up)
        if self.plan.name != "smoke":
            warm = self.state_scale_run(small, events, touched, "hot")
            self.log(f"  warm-up run ({small:,} windows, not counted): {warm['seconds']:.2f}s")
        runs: dict[str, list[dict[str, Any]]] = {}
        for pattern in SMOKE_PATTERNS if self.plan.name == "smoke" else PATTERNS:
            # spread keys rewrite every file: past 1M stored windows that shows nothing more, at minutes a run
            many = big if pattern == "hot" else min(big, SPREAD_MAX)
            runs[pattern] = [self.state_scale_run(n, events, touched, pattern) for n in (small, many)]
            for r in runs[pattern]:
                self.log(f"  {pattern} {r['n']:,} windows: {r['seconds']:.2f}s (state rows read "
                         f"{r['state_rows_read']}, {r['files_after']} files after; replaced in {r['replace_s']}s) "
                         + " ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
            few, lots = runs[pattern]
            self.record(f"state_scale_{_size(events)}_batch_{_size(many)}_vs_{_size(small)}_windows_{pattern}",
                        lots["seconds"], few["seconds"], f"the same batch with {small:,} stored windows", "s", True,
                        target=TARGET.format(big=many, small=small), engine="spark (Connect client)",
                        path=["spark_engine"], events=events, touched_keys=touched, runs=runs[pattern],
                        notes=f"{pattern} keys; one run each, fresh pipelines on the warm server")
        self.measures["state_scale"] = runs


def _size(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}m"
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)
