"""Where the Spark engine's time goes (issue 39, item 4): its sessions batch's per-phase seconds beside the floor
for the same landing bytes: pyarrow's JSON reader on one core, the engine's own parser
(``lake.landing.parse_file_table``) on one core, and bare Spark's own read on the same Connect server (the
executors parse every column of a local copy with ``spark.read.json`` and aggregate them to one row).

Record: ``spark_engine_<size>_vs_parse_floor`` (the batch's seconds against pyarrow's one-core parse; no
target: it says how far above the floor the batch is, and the record's ``phases`` say where).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.json as pjson
from millpond.lake.landing import parse_file_table

#: runs of each side; the fastest counts
RUNS = 2
SPARK_READ = """
import json, sys, time
from millpond.config import load_settings
from millpond.runtime.engines.spark_client import connect
from pyspark.sql import functions as F
url, src, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
spark = connect(load_settings().with_overrides(spark_connect=url))
schema = "id STRING, key STRING, value BIGINT, event_time TIMESTAMP, arrival_time TIMESTAMP"
out = []
for _ in range(runs):
    t = time.perf_counter()
    df = spark.read.schema(schema).option("timestampFormat", "yyyy-MM-dd'T'HH:mm:ss.SSSSSSX").json(src)
    row = df.agg(F.count(F.lit(1)), F.sum(F.length("id")), F.sum(F.length("key")), F.sum("value"),
                 F.max("event_time"), F.max("arrival_time")).collect()[0]
    out.append({"seconds": round(time.perf_counter() - t, 4), "rows": row[0]})
print(json.dumps(out))
"""


def one_core_parse(files: list[Path]) -> dict[str, float]:
    """Seconds to parse the files on one core: pyarrow's JSON reader, and the engine's parser."""
    t = time.perf_counter()
    rows = sum(pjson.read_json(f, read_options=pjson.ReadOptions(use_threads=False)).num_rows for f in files)
    arrow_s = time.perf_counter() - t
    t = time.perf_counter()
    later = 4_102_444_800 * 10**6  # 2100: no event is ahead of the batch's clock
    for f in files:
        parse_file_table(f.name, f.read_bytes(), value_type="int", file_arrival_us=later, processing_time=later)
    return {"pyarrow_s": round(arrow_s, 4), "engine_parser_s": round(time.perf_counter() - t, 4), "rows": rows}


class TimeFloorMeasures:
    """Measure methods of ``bench.harness.Bench`` for the Spark engine's time against the floor (mixed in)."""

    def spark_read(self, src: Path) -> list[dict[str, Any]]:
        """Bare Spark's own read of the local copy on the bench's Connect server, in a client of its own."""
        url = self.connect_url()
        env = dict(os.environ)
        env["MILLPOND_SPARK_CONNECT_TOKEN"] = self.connect_token()
        proc = subprocess.run([sys.executable, "-c", SPARK_READ, url, str(src), str(RUNS)], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"Spark read failed: {proc.stderr.strip().splitlines()[-1:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def measure_time_floor(self) -> None:
        n = self.plan.spark_engine_events
        if not n:
            return
        self.connect_url()
        wl = self.workload(n, self.plan.keys(n))
        folder = self.local_copy(wl)
        files = sorted(folder.iterdir())
        size = sum(f.stat().st_size for f in files)
        parse = min((one_core_parse(files) for _ in range(RUNS)), key=lambda p: p["pyarrow_s"])
        read = min(self.spark_read(folder), key=lambda r: r["seconds"])
        batches = [self.spark_engine_batch("sessions", wl) for _ in range(RUNS)]
        best = min(batches, key=lambda r: r["seconds"])
        label = f"{n // 1_000_000}m" if n >= 1_000_000 else f"{n // 1000}k"
        self.log(f"time floor ({wl.input_events} events, {size / 1e6:.0f} MB): pyarrow one core "
                 f"{parse['pyarrow_s']:.2f}s, the engine's parser {parse['engine_parser_s']:.2f}s, bare Spark's read "
                 f"{read['seconds']:.2f}s; the Spark engine's batch {best['seconds']:.2f}s: "
                 + " ".join(f"{k} {v:.2f}" for k, v in best["phases"].items()))
        self.record(f"spark_engine_{label}_vs_parse_floor", best["seconds"], parse["pyarrow_s"],
                    "pyarrow's JSON reader on one core, the same bytes", "s", True,
                    target="report: the batch against the floor", engine="spark (Connect client)",
                    path=["spark_engine"], events=wl.input_events, bytes=size, phases=best["phases"],
                    engine_parser_s=parse["engine_parser_s"], spark_read_s=read["seconds"],
                    batch_seconds=[b["seconds"] for b in batches],
                    notes="fastest of the runs; the batch is one fresh pipeline in a fresh client on the warm server")
