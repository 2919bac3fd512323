"""A stage over a big upstream on the Spark engine (issue 36): a stage batch that consumes about 1M upstream
pane rows, against the same stage over about 1k rows (the client's peak RSS: nothing row-sized may reach it)
and against bare Spark doing the same regrouping over the same rows on the same Connect server.

The upstream is the bench's ``fixed`` pipeline (1-minute windows, early panes every minute, accumulating) over
a workload with about one event per key and minute, run on the Spark engine with a flush, so that its
``panes`` table holds about as many rows as the workload has events. The stage, like the shipped
``video_watch_hourly``, regroups every key's panes into hourly totals (``key: all``, fixed 1h windows, sum): one
batch after the upstream's last. The peer reads the upstream's ``panes`` files on the executors
(``lake.spark_io.read_table``), keeps each (key, window)'s last pane (an accumulating upstream's last value is its
total), groups by the hour of ``window_start`` and sums, writing Parquet to local disk. Each side runs
``stage_scale_runs`` times over the same upstream, alternating (ours: a fresh stage each time); the best of each is
recorded."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from millpond.model.timeutil import MAX_TS


def bare_stage(spark, settings, req: dict[str, Any]) -> dict[str, Any]:
    """The peer, in a Connect client (``bench.connect_client``, mode ``bare_stage``)."""
    from millpond.lake import spark_io
    from millpond.lake.tables import Tables
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    out = Path(req["out"])
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    panes = spark_io.read_table(spark, Tables(settings), req["upstream"], "panes")
    last = Window.partitionBy("key", "window_start").orderBy(F.col("pane_index").desc())
    totals = (panes.where("kind = 'value'").withColumn("_n", F.row_number().over(last)).where("_n = 1")
              .groupBy(F.date_trunc("hour", "window_start").alias("hour")).agg(F.sum("value").alias("value")))
    totals.write.parquet(str(out))
    return {"seconds": round(time.perf_counter() - t, 4), "rows": panes.count(), "ended_at": time.time()}


class StageScaleMeasures:
    """Measure methods of ``bench.harness.Bench`` (mixed in)."""

    def _upstream(self, rows: int) -> dict[str, Any]:
        """The upstream's batches + flush on the Spark engine (one client). ``rows``: about the upstream pane rows
        wanted: twice as many events over as many keys give about one (key, minute) window per event and a half."""
        wl = self.workload(2 * rows, max(1, rows), seed=41)
        return {"wl": wl, **self.spark_engine_batch("fixed", wl, flush=True)}

    def _stage_over(self, up: dict[str, Any]) -> dict[str, Any]:
        """A fresh stage's one batch over ``up`` (``_upstream``) in a fresh client (its peak RSS is the stage
        batch's own)."""
        wl = up["wl"]
        stage = {"name": f"bench_stage_{uuid.uuid4().hex[:8]}", "value_type": "int",
                 "source": {"pipeline": up["pipeline"], "stream": "panes", "key": "all", "event_time": "window_start"},
                 "window": {"type": "fixed", "size": "1h"}, "trigger": "AtWatermark(late=AtCount(1))",
                 "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1d",
                 "batch_interval": "5m"}
        at = wl.spec.start_us + (wl.spec.batches + 2) * wl.spec.interval_us
        # preloaded as a DAG task's process is (``orchestration.airflow_preload``): a stage's batch runs as one
        res = self.client({"mode": "batches", "pipelines": [stage], "steps": [[0, at, MAX_TS]], "preload": True})
        b = res["batches"][0]
        return {"upstream": up["pipeline"], "stage": stage["name"], "seconds": b["seconds"], "phases": b["phases"],
                "counts": b["counts"], "peak_rss_gib": res["peak_rss_gib"], "path": b["path"]}

    def measure_stage_scale(self) -> None:
        n = self.plan.stage_scale_rows
        if not n:
            return
        self.connect_url()
        self.log(f"stage on the Spark engine: a stage batch over about {n} upstream pane rows, and about 1k")
        small = self._stage_over(self._upstream(1_000))
        up = self._upstream(n)
        ours, peers = [], []
        for i in range(max(1, self.plan.stage_scale_runs)):  # alternating, so that a slow minute hits both
            ours.append(self._stage_over(up))
            peers.append(self.client({"mode": "bare_stage", "upstream": up["pipeline"],
                                      "out": str(self.workdir / "bare-stage" / f"{up['pipeline']}-{i}")})["runs"][0])
        big, peer = min(ours, key=lambda r: r["seconds"]), min(peers, key=lambda r: r["seconds"])
        self.log(f"  upstream panes consumed: {small['counts'].get('input')} and {big['counts'].get('input')}")
        self.log(f"  1k: {small['seconds']}s, RSS {small['peak_rss_gib']} GiB; {n}: "
                 f"{[r['seconds'] for r in ours]}s, {big['counts'].get('input')} pane rows, RSS "
                 f"{big['peak_rss_gib']} GiB; best {big['phases']}")
        self.log(f"  bare Spark regrouping the same {peer['rows']} rows on the executors: "
                 f"{[r['seconds'] for r in peers]}s")
        rows = big["counts"].get("input", 0)
        self.record("stage_1m_rows_driver_rss_vs_1k", big["peak_rss_gib"], small["peak_rss_gib"],
                    "the same stage batch over about 1k upstream pane rows", "GiB", True, engine="spark",
                    path=[big["path"]], rows=rows, small_rows=small["counts"].get("input", 0),
                    notes="peak RSS of the Connect client process that ran the stage's batch (interpreter included)")
        self.record("stage_1m_rows_spark_engine_vs_bare_spark", big["seconds"], peer["seconds"],
                    "bare Spark on the same Connect server: the upstream's panes read on the executors, each window's "
                    "last pane, summed per hour, written as Parquet", "s", True, engine="spark", path=[big["path"]],
                    rows=rows, phases=big["phases"], peer_rows=peer["rows"], runs=[r["seconds"] for r in ours],
                    peer_runs=[r["seconds"] for r in peers],
                    notes="ours: the stage's batch in a fresh Connect client (connect excluded); its input: the "
                          "elements it made from the upstream's pane rows (retractions included); best of `runs` "
                          "against the best of `peer_runs`, alternating")
        self.measures["stage_scale"] = {"small": small, "big": big, "peer": peer}
