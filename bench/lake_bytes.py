"""Storage bounded (issue 38): what a pipeline's lake holds after many batches of a steady workload, with the
upkeep vacuuming what no version within retention needs and expiring the log past it.

One pipeline runs ``lake_bytes_batches`` consecutive short batches (the long-history workload: ~40 events, 4
landing files each) in one process, under a retention of ``lake_bytes_retention_s`` seconds: the bench compresses
days of 5-minute batches into minutes, so the retention is compressed the same way (a deployment's default is
7 days, about 2,000 such batches). The lake's objects and bytes are counted after a quarter of the batches and
after all of them; each batch's time is kept. Records (see bench/README.md): ``lake_bytes_<B>_vs_<B/4>`` (bytes
after B batches against after B/4; target <= 1.5x) and ``batch_time_<B>_vs_<B/4>_retained`` (the median of the
last 50 batches against that of the 50 before the quarter mark; target: unchanged, <= 1.2x).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from millpond.lake.objectstore import ObjectStore


class LakeBytesMeasures:
    """Measure methods of ``bench.harness.Bench`` for the lake's size over many batches (mixed in)."""

    def lake_usage(self, settings, pipeline: str) -> dict[str, Any]:
        """Objects and bytes of the pipeline's tables, and of their logs; per table, its data, log and change-data
        bytes and its data files (what grows: an append-only table's rows, or what retention should have removed)."""
        prefix = f"{settings.table_root}/{pipeline}/"
        found = list(ObjectStore(settings).list(settings.bucket_lake, prefix))
        log = [o for o in found if "/_delta_log/" in o.key]
        tables: dict[str, dict[str, int]] = {}
        for o in found:
            table = tables.setdefault(o.key[len(prefix):].split("/", 1)[0],
                                      {"data_bytes": 0, "log_bytes": 0, "change_bytes": 0, "data_files": 0})
            kind = "log" if "/_delta_log/" in o.key else "change" if "/_change_data/" in o.key else "data"
            table[f"{kind}_bytes"] += o.size
            table["data_files"] += kind == "data"
        return {"objects": len(found), "bytes": sum(o.size for o in found),
                "log_objects": len(log), "log_bytes": sum(o.size for o in log), "tables": tables}

    def measure_lake_bytes(self) -> None:
        nb = self.plan.lake_bytes_batches
        if nb < 8:
            return
        quarter, window = nb // 4, max(2, min(50, nb // 8))
        retention = self.plan.lake_bytes_retention_s
        wl = self.workload(self.plan.long_history_events * nb, 200, batches=nb, seed=23)
        expire, pace = self.plan.lake_bytes_expire, self.plan.lake_bytes_pace_s
        self.log(f"lake bytes: {nb} consecutive batches of ~{self.plan.long_history_events} events, retention "
                 f"{retention:g}s, expire {expire or 'none'}, one batch every {pace:g}s, the lake counted after "
                 f"{quarter} and after {nb}")
        settings = self.settings
        self.settings = settings.with_overrides(retention_s=retention)
        try:
            spec = self.pipeline("sessions", wl, **({"expire": expire} if expire else {}))
            steps = self.batch_steps(spec, wl)
            seq: list[dict[str, Any]] = []
            started = time.monotonic()
            for b in steps:
                seq.append(b)
                if len(seq) == quarter:
                    early = self.lake_usage(self.settings, spec.name)
                time.sleep(max(0.0, started + len(seq) * pace - time.monotonic()))
            late = self.lake_usage(self.settings, spec.name)
        finally:
            self.settings = settings
        secs = [b["seconds"] for b in seq]
        before, last = statistics.median(secs[quarter - window:quarter]), statistics.median(secs[-window:])
        for table in sorted(late["tables"]):
            self.log(f"  {table}: {early['tables'].get(table)} -> {late['tables'][table]}")
        self.log(f"  after {quarter}: {early}; after {nb}: {late}; median batch {before:.3f}s (batches "
                 f"{quarter - window + 1}-{quarter}) and {last:.3f}s (batches {nb - window + 1}-{nb})")
        self.measures["lake_bytes"] = {"events": wl.input_events, "retention_s": retention, "expire": expire,
                                       "pace_s": pace,
                                       "after_quarter": early,
                                       "after_all": late, "batch_seconds": secs,
                                       "maintain_seconds": [b["phases"].get("maintain") for b in seq]}
        self.record(f"lake_bytes_{nb}_vs_{quarter}", late["bytes"], early["bytes"],
                    f"lake bytes of the same pipeline after {quarter} batches", "bytes", True,
                    target=f"bytes after {nb:,} batches <= 1.5x the bytes after {quarter:,}", batches=nb,
                    retention_s=retention, expire=expire, pace_s=pace, objects=[early["objects"], late["objects"]],
                    log_bytes=[early["log_bytes"], late["log_bytes"]], tables=[early["tables"], late["tables"]],
                    notes=f"one pipeline, {nb} batches of ~{self.plan.long_history_events} events, retention "
                          f"{retention:g}s (wall clock), one batch every {pace:g}s, expire {expire or 'none'} (event "
                          "time: output rows of "
                          "windows that ended that long before the watermark are deleted); the lake's objects under "
                          "the pipeline's tables")
        self.record(f"batch_time_{nb}_vs_{quarter}_retained", round(last, 4), round(before, 4),
                    f"median of batches {quarter - window + 1}-{quarter} of the same sequence", "s", True,
                    expire=expire,
                    target=f"per-batch time unchanged: the last {window} batches <= 1.2x batches "
                           f"{quarter - window + 1}-{quarter}", batches=nb, retention_s=retention,
                    notes=f"median of the last {window} batches of the lake_bytes sequence vs the {window} before the "
                          "quarter mark, same process")
