"""Scale with workers (issue 39, item 2): the sessions batch on the Spark engine against a Connect server whose master
is a standalone cluster on this machine, with one worker of one core and then with two workers of one core each
(``orchestration.spark_server.StandaloneCluster``; executors run the shipped environment archive,
``orchestration.executor_env``, as on other hosts).

Each cluster gets its own Connect server, warmed by one throwaway batch; then the batch runs ``runs`` times, each a
fresh pipeline in a fresh Connect client, and the fastest counts (the warm-up batch is one task, so a second
executor's first tasks, which unpack the environment and start its Python workers, fall in the first run). Per-phase
seconds are kept, so that what does not scale with executors (the client's planning and commits, the driver's
scheduling, the server's planning) shows. Record: ``workers_scale_<size>_2_vs_1`` (throughput with two workers over
with one; target >= 1.5x).
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
        best: dict[int, dict[str, Any]] = {}
        for workers in (1, 2):
            with self.on_cluster(workers):
                tries = [self.spark_engine_batch("sessions", wl) for _ in range(runs)]
            best[workers] = min(tries, key=lambda r: r["seconds"])
            self.log(f"  {workers} worker(s): " + " ".join(f"{r['seconds']:.2f}s" for r in tries) + "; phases "
                     + " ".join(f"{k} {v:.2f}" for k, v in best[workers]["phases"].items()))
        one, two = best[1], best[2]
        size = f"{n // 1_000_000}m" if n >= 1_000_000 else f"{n // 1000}k"
        self.record(f"workers_scale_{size}_2_vs_1", two["events_per_s"], one["events_per_s"],
                    "the same batch on one one-core worker", "events/s", False, target=TARGET,
                    engine="spark (Connect client)", path=["spark_engine"], events=wl.input_events,
                    seconds={"1": one["seconds"], "2": two["seconds"]},
                    phases={"1": one["phases"], "2": two["phases"]},
                    notes=f"standalone cluster on this machine (2 cores shared with the driver, the client and the "
                          f"store); fastest of {runs} fresh pipelines per cluster, each after a warm-up batch")
        self.measures["workers_scale"] = {"1": one, "2": two}
