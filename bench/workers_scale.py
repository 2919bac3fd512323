"""Scale with workers (issue 39, item 2): the sessions batch on the Spark engine against a Connect server whose master
is a standalone cluster on this machine, with one worker of one core and then with two workers of one core each
(``orchestration.spark_server.StandaloneCluster``; executors run the shipped environment archive,
``orchestration.executor_env``, as on other hosts).

Each cluster gets its own Connect server, warmed by one throwaway batch; then the batch runs ``runs`` times, each a
fresh pipeline in a fresh Connect client, and the fastest counts (the warm-up batch is one task, so a second
executor's first tasks, which unpack the environment and start its Python workers, fall in the first run). Per-phase
seconds are kept, so that what does not scale with executors (the client's planning and commits, the driver's
scheduling, the server's planning) shows. Record: ``workers_scale_<size>_2_vs_1`` (throughput with two workers over
with one; target >= 1.5x). Beside each batch, alternating, the fair bare-Spark peer's job (the executors read the
files) runs on the same cluster: ``bare_spark_workers_scale_<size>_2_vs_1`` reports how far a second worker of this
box takes bare Spark, the ceiling the target is measured against.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from millpond.config import PROJECT_ROOT
from millpond.orchestration.processes import free_port, read_pid
from millpond.orchestration.spark_server import SparkConnectServer, StandaloneCluster

#: the batch's events by the bench plan's name (0: skip)
EVENTS = {"smoke": 0, "quick": 100_000, "default": 1_000_000, "full": 1_000_000}
RUNS = {"quick": 2, "default": 2, "full": 3}
#: the executors' environment archive, kept across runs (as the tests keep theirs)
EXECUTOR_CACHE = PROJECT_ROOT / "var" / "spark" / "executor-env"
TARGET = "throughput with two one-core workers >= 1.5x with one"
#: bare Spark's own scaling on the same clusters: no line to meet, the box's ceiling for ours
BARE_TARGET = "report: what a second one-core worker gives bare Spark's job on this box"


class WorkersScaleMeasures:
    """Measure methods of ``bench.harness.Bench`` for the Spark engine on one and two workers (mixed in)."""

    @contextlib.contextmanager
    def on_cluster(self, workers: int) -> Iterator[str]:
        """A standalone cluster of ``workers`` one-core workers and a warmed Connect server on it, as the bench's
        server while inside (its URL)."""
        home = self.workdir / f"cluster-{workers}"
        home.mkdir(parents=True, exist_ok=True)
        local = self.settings.with_overrides(home=home, spark_connect="")
        cluster = StandaloneCluster(local, workers=workers, cores=1, memory="2g", name=f"bench-{workers}w")
        saved, t = self.connect_server, time.perf_counter()
        try:
            master = cluster.start()
            server = SparkConnectServer(local.with_overrides(spark_connect_port=free_port(), spark_ui_port=free_port(),
                                                             spark_master=master), executor_cache=EXECUTOR_CACHE)
            self.connect_server = server
            server.start()
            if self.sampler is not None:
                self.sampler.also_exclude.append(lambda: read_pid(server.pidfile))
            self.log(f"  cluster of {workers} one-core worker(s) and its Connect server up in "
                     f"{time.perf_counter() - t:.1f}s")
            self._warm_up(server.url)
            yield server.url
        finally:
            if self.connect_server is not saved:
                self.connect_server.stop()
            self.connect_server = saved
            cluster.stop()

    def measure_workers_scale(self) -> None:
        n = EVENTS.get(self.plan.name, 0)
        if not n:
            return
        runs = RUNS.get(self.plan.name, 1)
        wl = self.workload(n, self.plan.keys(n))
        self.log(f"workers scale: one batch of {wl.input_events} events, sessions, on 1 then 2 one-core workers")
        self.local_copy(wl)  # the bare peer's input, written before the clusters start
        best: dict[int, dict[str, Any]] = {}
        bare: dict[int, dict[str, Any]] = {}
        for workers in (1, 2):
            tries, peers = [], []
            with self.on_cluster(workers):
                for _ in range(runs):  # alternating, so that a slow minute hits both
                    tries.append(self.spark_engine_batch("sessions", wl))
                    peers.append(self.bare_on_executors("sessions", wl)["runs"][0])
            best[workers] = min(tries, key=lambda r: r["seconds"])
            bare[workers] = min(peers, key=lambda r: r["seconds"])
            self.log(f"  {workers} worker(s): " + " ".join(f"{r['seconds']:.2f}s" for r in tries) + "; phases "
                     + " ".join(f"{k} {v:.2f}" for k, v in best[workers]["phases"].items())
                     + "; bare Spark on the executors " + " ".join(f"{r['seconds']:.2f}s" for r in peers))
        one, two = best[1], best[2]
        size = f"{n // 1_000_000}m" if n >= 1_000_000 else f"{n // 1000}k"
        bare_scale = round(bare[1]["seconds"] / bare[2]["seconds"], 3)
        # the box's own ceiling: what two one-core workers give bare Spark's job on the same clusters and events
        self.record(f"bare_spark_workers_scale_{size}_2_vs_1", round(wl.input_events / bare[2]["seconds"], 1),
                    round(wl.input_events / bare[1]["seconds"], 1), "bare Spark's same job on one one-core worker",
                    "events/s", False, target=BARE_TARGET, engine="spark (bare Spark job)", path=["bare_spark"],
                    events=wl.input_events, seconds={"1": bare[1]["seconds"], "2": bare[2]["seconds"]},
                    notes="the fair bare-Spark peer (the executors read a local copy of the landing files, "
                          "dropDuplicates, session_window, sum, Parquet) on the same two clusters, alternating "
                          f"with ours; fastest of {runs} per cluster")
        self.record(f"workers_scale_{size}_2_vs_1", two["events_per_s"], one["events_per_s"],
                    "the same batch on one one-core worker", "events/s", False, target=TARGET,
                    engine="spark (Connect client)", path=["spark_engine"], events=wl.input_events,
                    seconds={"1": one["seconds"], "2": two["seconds"]},
                    phases={"1": one["phases"], "2": two["phases"]}, bare_spark_scale=bare_scale,
                    notes=f"standalone cluster on this machine (2 cores shared with the driver, the client and the "
                          f"store); fastest of {runs} fresh pipelines per cluster, each after a warm-up batch")
        self.measures["workers_scale"] = {"1": one, "2": two}
