"""The Spark engine's measures: batches as PySpark jobs on a warm Spark Connect server, run by Connect clients in
processes of their own (``bench.connect_client``), as Airflow tasks are.

The bench starts one Connect server (``orchestration.spark_server``, ``local[*]`` and the deployment's
settings, as ``make up`` does) on free loopback ports the first time a measure needs it, warms it with one
throwaway batch, and stops it at the end. The bare-Spark peer runs on the same server, so both sides have the
same resources. Records (see bench/README.md): ``sessions_1m_spark_engine_vs_bare_spark``, ``driver_rss_1m``,
``driver_rss_10m_vs_1m`` (``--full``), ``tiny_batch_spark_engine_s``, ``validation_share_1m_spark``,
``batch50_vs_batch5_spark``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import millpond
from millpond.model.timeutil import MAX_TS
from millpond.orchestration.processes import free_port, read_pid
from millpond.orchestration.spark_server import SparkConnectServer, stack_token

from bench.workload import write_local

if TYPE_CHECKING:
    from bench.workload import Workload

GIB = 1024**3
BENCH_ROOT = Path(__file__).resolve().parents[1]

SPARK_ENGINE_TARGETS = {
    "sessions_1m_spark_engine_vs_bare_spark": "ours <= 1.5x bare Spark's time on the same Connect server",
    "driver_rss_1m": "<= 1.5 GiB (the Connect client's peak RSS)",
    "driver_rss_10m_vs_1m": "10M <= 1.25x the 1M figure, both <= 1.5 GiB",
    "tiny_batch_spark_engine_s": "<= 1.1x a bare-Spark client's start -> trivial job (median, task start -> "
                                 "commit marker)",
    "validation_share_1m_spark": "<= 0.25 of the batch's time",
    "batch50_vs_batch5_spark": "batch 50 <= 1.2x batch 5",
}


def _size(n: int) -> str:
    return f"{n // 1_000_000}m" if n >= 1_000_000 and n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n % 1000 == 0 else str(n))


class SparkEngineMeasures:
    """Measure methods of ``bench.harness.Bench`` for the Spark engine (mixed in; the harness's run list calls
    them)."""

    # the server ---------------------------------------------------------------------------------
    def log_sequence(self, seq: list[dict[str, Any]], beside: list[dict[str, Any]]) -> None:
        """One over-time run's batch seconds, with the fresh pipeline's run beside its last batches."""
        self.log("  batch seconds: " + " ".join(f"{b['seconds']:.2f}" for b in seq)
                 + " | fresh pipeline beside the last five: " + " ".join(f"{b['seconds']:.2f}" for b in beside))

    def connect_url(self) -> str:
        """The bench's Connect server (started and warmed on first use)."""
        server: SparkConnectServer | None = self.connect_server
        if server is None and self.connect_borrowed:
            return self.connect_borrowed
        if server is None:
            home = self.workdir / "spark-connect"
            home.mkdir(parents=True, exist_ok=True)
            server = SparkConnectServer(self.settings.with_overrides(
                home=home, spark_connect_port=free_port(), spark_ui_port=free_port(), spark_connect=""))
            t = time.perf_counter()
            server.start()
            self.connect_server = server
            if self.sampler is not None:  # its JVM is not ours: the other measures' memory windows leave it out
                self.sampler.also_exclude.append(lambda: read_pid(server.pidfile))
            self.log(f"Spark Connect server ({server.master}) up in {time.perf_counter() - t:.1f}s at {server.url}")
            self._warm_up(server.url)
        return server.url

    def _warm_up(self, url: str) -> None:
        """One throwaway 1k-event batch: the server's Python workers and data sources are warm, as in a stack
        that has run batches before."""
        wl = self.workload(1_000, 100, batches=1, seed=5)
        t = time.perf_counter()
        self.client({"mode": "batches", "pipelines": [self._doc("sessions", wl)], "steps": self._steps(wl, [0])},
                    url=url)
        self.log(f"  warm-up batch in a fresh client: {time.perf_counter() - t:.1f}s")

    def connect_token(self) -> str:
        """The token clients of the bench's server present: its own server's, or the borrowed one's (the
        settings')."""
        if self.connect_server is not None:
            return stack_token(self.connect_server.settings)
        return self.settings.spark_connect_token

    def close_connect_server(self) -> None:
        if self.connect_server is not None:
            self.connect_server.stop()
            self.connect_server = None

    # clients ------------------------------------------------------------------------------------
    def _doc(self, kind: str, wl: Workload) -> dict[str, Any]:
        return {**self.pipeline(kind, wl).raw, "name": f"bench_{kind}_se_{uuid.uuid4().hex[:8]}"}

    @staticmethod
    def _steps(wl: Workload, batches: list[int], pipeline: int = 0) -> list[list[Any]]:
        return [[pipeline, wl.spec.start_us + (i + 1) * wl.spec.interval_us, None] for i in batches]

    def client(self, request: dict[str, Any], url: str | None = None, timeout: float = 3600) -> dict[str, Any]:
        """Run one Connect client process; its result, with ``spawned_at`` (the wall clock just before the
        spawn: a task's start) and ``process_s`` (spawn to exit)."""
        folder = self.workdir / "clients"
        folder.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:8]
        req, out = folder / f"{tag}-req.json", folder / f"{tag}-out.json"
        req.write_text(json.dumps({"url": url or self.connect_url(), **request}, default=str))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(millpond.__file__).resolve().parents[1]),
                                                          str(BENCH_ROOT), env.get("PYTHONPATH")]))
        if self.connect_token():  # the bench's server serves only holders of its token, as the stack's
            env["MILLPOND_SPARK_CONNECT_TOKEN"] = self.connect_token()
        spawned = time.time()
        proc = subprocess.run([sys.executable, "-m", "bench.connect_client", str(req), str(out)], env=env,
                              cwd=BENCH_ROOT, capture_output=True, text=True, timeout=timeout)
        exited = time.time()
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
            raise RuntimeError(f"Connect client failed ({proc.returncode}): {tail}")
        res = json.loads(out.read_text())
        req.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
        res["spawned_at"], res["process_s"] = spawned, round(exited - spawned, 4)
        res["startup_s"] = round(res["connected_at"] - res["connect_s"] - spawned, 4)
        res["peak_rss_gib"] = round(res["peak_rss_bytes"] / GIB, 3)
        return res

    def spark_engine_batch(self, kind: str, wl: Workload, validate: bool = False, preload: bool = False,
                           render_docs: bool = True, flush: bool = False) -> dict[str, Any]:
        """All of ``wl``'s batches of a fresh pipeline in one fresh client; the one-batch figures flattened.
        ``preload``: the client first imports what a DAG task's process inherits (``bench.connect_client``);
        ``render_docs``: as ``run_batch``'s (the DAG's task passes False: its publish renders the pages);
        ``flush``: one more batch at watermark +inf (every window fires), as the Beam comparisons end."""
        doc = self._doc(kind, wl)
        steps = self._steps(wl, list(range(wl.spec.batches)))
        if flush:
            steps.append([0, wl.spec.start_us + (wl.spec.batches + 1) * wl.spec.interval_us, MAX_TS])
        res = self.client({"mode": "batches", "pipelines": [doc], "steps": steps, "validate": validate,
                           "preload": preload, "render_docs": render_docs})
        res["pipeline"] = doc["name"]
        res["seconds"] = round(sum(b["seconds"] for b in res["batches"]), 4)
        res["events"] = wl.input_events
        res["events_per_s"] = round(wl.input_events / res["seconds"], 1)
        res["path_ran"] = sorted({b["path"] for b in res["batches"]})
        res["phases"] = {k: round(sum(b["phases"].get(k, 0.0) for b in res["batches"]), 4)
                         for k in dict.fromkeys(k for b in res["batches"] for k in b["phases"])}
        return res

    def bare_on_connect(self, kind: str, wl: Workload, runs: int = 1, batch: int | None = None,
                        preload: bool = False) -> dict[str, Any]:
        return self.client({"mode": "bare", "kind": kind, "prefix": wl.prefix, "batch": batch, "runs": runs,
                            "preload": preload})

    def bare_on_executors(self, kind: str, wl: Workload, runs: int = 1) -> dict[str, Any]:
        """The fair bare-Spark peer: a fresh client whose job reads a local copy of the landing files on the
        executors (``spark.read.json``), dedups, aggregates and writes Parquet to local disk."""
        out = self.workdir / "bare-exec" / wl.label
        out.parent.mkdir(parents=True, exist_ok=True)
        res = self.client({"mode": "bare_exec", "kind": kind, "src": str(self.local_copy(wl)), "out": str(out),
                           "runs": runs})
        for r in res["runs"]:
            shutil.rmtree(r.pop("out"), ignore_errors=True)
        return res

    def local_copy(self, wl: Workload) -> Path:
        """The workload's landing files, byte for byte, in a local folder (made once): what the peers that read
        files themselves read (Spark cannot read s3a here)."""
        folder = self.workdir / "local-copy" / wl.label
        if not folder.exists():
            write_local(wl.spec, wl.events, folder.with_name(folder.name + ".tmp"))
            folder.with_name(folder.name + ".tmp").rename(folder)
            wl.table = None  # regenerated on demand: not held through the runs
        return folder

    def _spark_record(self, measure: str, *args: Any, **extra: Any) -> None:
        extra.setdefault("path", ["spark_engine"])
        self.record(measure, *args, target=SPARK_ENGINE_TARGETS.get(measure), engine="spark (Connect client)", **extra)

    # measures -----------------------------------------------------------------------------------
    def measure_spark_engine_sessions(self) -> None:
        """1M events of the sessions kind as one batch on the Spark engine vs bare Spark on the same server;
        the client's peak RSS at 1M (and at 10M under ``--full``)."""
        n = self.plan.spark_engine_events
        if not n:
            return
        url = self.connect_url()
        wl = self.workload(n, self.plan.keys(n))
        self.log(f"Spark engine: one batch of {wl.input_events} events, {wl.spec.keys} keys, sessions (Connect client)")
        # each side ``spark_engine_runs`` times, alternating (ours, bare, ours, bare, ...), each run in a fresh
        # client; the faster run of each side counts. The server's first runs of a plan are its slowest (the JIT
        # compiles Spark's code and the plan's generated classes: ~2x here), so each side gets as many turns,
        # and a load that comes and goes hits both alike
        # the executor-read peer reads a local copy, written before the clock
        self.local_copy(wl)
        runs: list[dict[str, Any]] = []
        bare_runs: list[dict[str, Any]] = []
        exec_runs: list[dict[str, Any]] = []
        bare_rss = 0.0
        for _ in range(max(1, self.plan.spark_engine_runs)):
            runs.append(self.spark_engine_batch("sessions", wl))
            self.log(f"  ours {runs[-1]['seconds']}s {runs[-1]['phases']}; client peak RSS "
                     f"{runs[-1]['peak_rss_gib']} GiB")
            ex = self.bare_on_executors("sessions", wl)
            exec_runs += ex["runs"]
            self.log(f"  bare Spark reading on the executors {ex['runs'][0]['seconds']}s "
                     f"({ex['runs'][0]['windows']} sessions written)")
            bare = self.bare_on_connect("sessions", wl, runs=1)
            bare_runs += bare["runs"]
            bare_rss = max(bare_rss, bare["peak_rss_gib"])
            self.log(f"  bare Spark reading in the client {bare['runs'][0]['seconds']}s; client peak RSS "
                     f"{bare['peak_rss_gib']} GiB")
        bare = {**bare, "runs": bare_runs, "peak_rss_gib": bare_rss}
        bare_s = min(r["seconds"] for r in bare_runs)
        exec_s = min(r["seconds"] for r in exec_runs)
        ours = min(runs, key=lambda r: r["seconds"])
        ours_runs = [r["seconds"] for r in runs]
        peak_rss = max(r["peak_rss_gib"] for r in runs)
        out: dict[str, Any] = {"url": url, "events": wl.input_events, "ours": ours,
                               "ours_other_runs": [r for r in runs if r is not ours], "bare_spark": bare,
                               "bare_spark_executors": {"runs": exec_runs}}
        note = "" if n == 1_000_000 else f" ({wl.input_events} events: this plan's size, not 1M)"
        self._spark_record(
            "sessions_1m_spark_engine_vs_bare_spark_executors", ours["seconds"], exec_s,
            "bare Spark on the same Connect server, reading on the executors: spark.read.json over a local copy of "
            "the same landing files, dropDuplicates(id), groupBy(key, session_window 5m), sum, written as Parquet "
            "to local disk", "s", True,
            events=wl.input_events, keys=wl.spec.keys, phases=ours["phases"],
            ours_runs_seconds=ours_runs, peer_runs_seconds=[r["seconds"] for r in exec_runs],
            peer_windows=exec_runs[0]["windows"], peer_reads="executors",
            notes="the fair bare-Spark peer (what a Spark user would write); ours: run_batch of a fresh pipeline in a "
                  "fresh Connect client (connect excluded); peer: a fresh Connect client's job, read to Parquet "
                  f"written; {len(runs)} run(s) of each, alternating (ours, this peer, the client-read peer), the "
                  "faster of each side counted" + note)
        self._spark_record(
            "sessions_1m_spark_engine_vs_bare_spark", ours["seconds"], bare_s,
            "bare Spark reading in the client: dropDuplicates + groupBy(key, session_window) + sum over the same "
            "landing files (pyarrow read, createDataFrame, toArrow) in a Connect client of the same server", "s", True,
            peer_reads="client (every row crosses the client: a weak peer; the fair one is "
                       "sessions_1m_spark_engine_vs_bare_spark_executors)",
            events=wl.input_events, keys=wl.spec.keys, phases=ours["phases"], counts=ours["batches"][0]["counts"],
            ours_runs_seconds=ours_runs, peer_runs_seconds=[r["seconds"] for r in bare["runs"]],
            notes="ours: run_batch of a fresh pipeline in a fresh Connect client (connect excluded, "
                  f"{ours['connect_s']}s); peer: its read, dedup, sessions and sum in a fresh Connect client; "
                  f"{len(runs)} run(s) of each, alternating (ours first), the faster of each side counted" + note)
        self._spark_record(
            "driver_rss_1m", peak_rss, bare["peak_rss_gib"],
            "the bare-Spark peer's client process (it holds the events as Arrow)", "GiB", True,
            events=wl.input_events,
            notes="peak RSS (kernel high-water mark) of the Connect client process that ran the batch, "
                  "interpreter and imports included; the server JVM is not in it" + note)
        big = self.plan.spark_engine_big_events
        if big:
            wl10 = self.workload(big, self.plan.keys(big))
            self.log(f"Spark engine: one batch of {wl10.input_events} events (client RSS)")
            res = self.spark_engine_batch("sessions", wl10)
            self.log(f"  ours {res['seconds']}s {res['phases']}; client peak RSS {res['peak_rss_gib']} GiB")
            out["ours_big"] = res
            self._spark_record(
                "driver_rss_10m_vs_1m", res["peak_rss_gib"], peak_rss,
                f"the same client's peak at {wl.input_events} events", "GiB", True,
                events=wl10.input_events, seconds=res["seconds"], phases=res["phases"],
                notes=f"peak RSS of the Connect client at {wl10.input_events} vs {wl.input_events} events; "
                      "target: ratio <= 1.25 and both <= 1.5 GiB")
        self.measures["spark_engine_sessions"] = out

    def measure_spark_engine_tiny(self) -> None:
        """A 1k-event batch per fresh client process, as an Airflow task runs one: start -> commit marker."""
        n, runs = self.plan.tiny_events, self.plan.spark_tiny_runs
        if not n or not runs:
            return
        runs = max(2, runs)
        url = self.connect_url()
        wl = self.workload(n * runs, max(10, n // 10), batches=runs, seed=11)
        self.log(f"Spark engine tiny batches: {runs} x {n} events, one fresh client process each")
        doc = self._doc("sessions", wl)
        samples: list[dict[str, Any]] = []
        trivial: list[dict[str, Any]] = []
        for i in range(runs):
            # as the DAG's task: forked from Airflow's scheduler, which imported the libraries first
            # (``orchestration.airflow_preload``; Great Expectations brings pyspark's Connect client), so a task
            # does not import them; ``preload_s``, not in ``task_s``
            res = self.client({"mode": "batches", "pipelines": [doc], "steps": self._steps(wl, [i]),
                               "preload": True}, url=url)
            b = res["batches"][0]
            samples.append({"task_s": round(b["ended_at"] - res["spawned_at"] - res["preload_s"], 4),
                            "preload_s": res["preload_s"], "startup_s": round(res["startup_s"] - res["preload_s"], 4),
                            "connect_s": res["connect_s"], "batch_s": b["seconds"],
                            "in_process_s": round(res["connect_s"] + b["seconds"], 4), "process_s": res["process_s"],
                            "phases": b["phases"], "peak_rss_gib": res["peak_rss_gib"]})
            # the peer, right after: a fresh client, preloaded alike, that connects and runs a trivial job
            res = self.client({"mode": "trivial", "preload": True}, url=url)
            trivial.append({"task_s": round(res["runs"][0]["ended_at"] - res["spawned_at"] - res["preload_s"], 4),
                            "startup_s": round(res["startup_s"] - res["preload_s"], 4),
                            "connect_s": res["connect_s"], "job_s": res["runs"][0]["seconds"]})
        steady = samples[1:]  # the first batch also creates the tables
        trivial_steady = trivial[1:]
        bare = []
        for _ in range(max(1, self.plan.spark_tiny_bare_runs)):
            res = self.bare_on_connect("sessions", wl, batch=0, preload=True)  # a task alike: preloaded too
            bare.append(round(res["runs"][0]["ended_at"] - res["spawned_at"] - res["preload_s"], 4))

        def med(key: str) -> float:
            return round(statistics.median(s[key] for s in steady), 4)

        phases = {k: round(statistics.median(s["phases"].get(k, 0.0) for s in steady), 4)
                  for k in steady[0]["phases"]}
        def tmed(key: str) -> float:
            return round(statistics.median(s[key] for s in trivial_steady), 4)

        self.log(f"  task start -> marker {[s['task_s'] for s in samples]}s; in-process "
                 f"{[s['in_process_s'] for s in samples]}s; bare client start -> trivial job "
                 f"{[s['task_s'] for s in trivial]}s; bare session_window client {bare}s")
        self.measures["spark_engine_tiny"] = {"samples": samples, "trivial_job_samples": trivial,
                                              "bare_spark_task_s": bare}
        self._spark_record(
            "tiny_batch_spark_engine_s", med("task_s"), tmed("task_s"),
            "a bare-Spark client's start -> trivial job (spark.range(1).count()) on the same server: a fresh "
            "Python process, preloaded alike, spawn -> result less preload_s", "s",
            True, samples=[s["task_s"] for s in samples], preload_s=med("preload_s"), startup_s=med("startup_s"),
            connect_s=med("connect_s"),
            batch_s=med("batch_s"), in_process_s=med("in_process_s"), phases=phases,
            peer_samples=[s["task_s"] for s in trivial], peer_startup_s=tmed("startup_s"),
            peer_connect_s=tmed("connect_s"), peer_job_s=tmed("job_s"),
            bare_session_window_s=round(statistics.median(bare), 4), bare_session_window_samples=bare,
            notes=f"median of batches 2..{runs} ({n} events each, no validation), each a fresh Python process "
                  "(spawn -> the marker's commit, less preload_s: the libraries Airflow's scheduler imports "
                  "before it forks a task, imported first as there); startup_s = interpreter + imports, "
                  "in_process_s = connect + run_batch; phases: the batch's own. Peer: the median of its runs "
                  "2..n, each right after one of ours (the floor any Spark task pays); bare_session_window_s: "
                  "the old peer (a bare session_window over the same 1k events, pyarrow read in the client)")

    def measure_spark_engine_validation(self) -> None:
        """The validated batch's validation phase over its whole time, 1M events on the Spark engine: the median
        share of ``spark_validation_runs`` batches, each of a fresh pipeline in a fresh client."""
        n = self.plan.spark_validation_events
        if not n:
            return
        self.connect_url()
        wl = self.workload(n, self.plan.keys(n))
        runs = max(1, self.plan.spark_validation_runs)
        self.log(f"Spark engine: a validated batch of {wl.input_events} events (Connect client), {runs} run(s)")
        results = []
        for _ in range(runs):
            # as the DAG's task: Great Expectations is imported before the task starts (Airflow's scheduler
            # preloads it, ``orchestration.airflow_preload``; a fresh interpreter would spend seconds on the
            # import alone), and the batch's Data Docs pages are left to the publish after its commit
            res = self.spark_engine_batch("sessions", wl, validate=True, preload=True, render_docs=False)
            res["share"] = res["phases"].get("validation", 0.0) / res["seconds"]
            self.log(f"  validation {res['phases'].get('validation', 0.0):.2f}s of {res['seconds']}s "
                     f"({res['share']:.3f}); {res['phases']}; libraries preloaded in {res['preload_s']}s first")
            results.append(res)
        res = sorted(results, key=lambda r: r["share"])[len(results) // 2]  # the median run (odd counts)
        val = res["phases"].get("validation", 0.0)
        self.measures["spark_engine_validation"] = res
        note = "" if n == 1_000_000 else f" ({wl.input_events} events: this plan's size, not 1M)"
        self._spark_record("validation_share_1m_spark", round(res["share"], 3), None, None,
                           "fraction of batch time", True, validation_seconds=round(val, 3),
                           batch_seconds=res["seconds"], events=wl.input_events, phases=res["phases"],
                           peak_rss_gib=res["peak_rss_gib"], preload_s=res["preload_s"],
                           shares=[round(r["share"], 3) for r in results],
                           runs_seconds=[[round(r["phases"].get("validation", 0.0), 3), r["seconds"]] for r in results],
                           notes="validate=True as the DAG's task runs it: a fresh client that first imports "
                                 "what Airflow's scheduler preloads for its tasks (Great Expectations among them; "
                                 "preload_s, not in the batch's time), pages left to the publish (render_docs=False);"
                                 " the median of `shares`, each a fresh pipeline's batch" + note)

    def measure_spark_engine_over_time(self) -> None:
        """``batch50_vs_batch5`` on the Spark engine: each repeat is one client running a fresh pipeline's
        ``nb`` batches, its last five interleaved with the first five of another fresh pipeline."""
        nb, reps = self.plan.over_time_batches, max(1, self.plan.spark_over_time_repeats)
        if nb < 5 or not self.plan.spark_over_time_repeats:
            return
        self.connect_url()
        wl = self.workload(self.plan.over_time_events * nb, self.plan.over_time_keys, batches=nb, seed=17)
        self.log(f"Spark engine over time: {nb} batches of ~{self.plan.over_time_events} events, {reps} runs")
        runs, fresh = [], []
        for _ in range(reps):
            steps = self._steps(wl, list(range(nb - 5)))
            for j in range(5):
                steps += self._steps(wl, [nb - 5 + j]) + self._steps(wl, [j], pipeline=1)
            res = self.client({"mode": "batches", "pipelines": [self._doc("sessions", wl), self._doc("sessions", wl)],
                               "steps": steps})
            seq = [b for b in res["batches"] if b["pipeline"] == 0]
            beside = [b for b in res["batches"] if b["pipeline"] == 1]
            runs.append(seq)
            fresh.append(beside)
            self.log_sequence(seq, beside)
        secs = [statistics.median(r[i]["seconds"] for r in runs) for i in range(nb)]
        fifth = statistics.median(f[4]["seconds"] for f in fresh)
        mid = len(secs) // 2
        self.measures["spark_engine_over_time"] = {
            "events": wl.input_events, "median_batch_seconds": [round(x, 4) for x in secs],
            "runs": [{"batch_seconds": [b["seconds"] for b in r]} for r in runs],
            "fresh_beside_last_five": [[b["seconds"] for b in f] for f in fresh],
            "batches": runs[-1], "fresh_batches": fresh[-1]}
        self.record(
            f"batch{nb}_vs_batch5_spark", round(secs[-1], 4), round(fifth, 4),
            f"batch 5 of a fresh pipeline on the same events, run right after our batch {nb} (same client)", "s",
            True, target=SPARK_ENGINE_TARGETS["batch50_vs_batch5_spark"], engine="spark (Connect client)",
            path=sorted({b["path"] for b in runs[-1]}), runs=reps,
            per_run_ratio=[round(r[-1]["seconds"] / f[4]["seconds"], 3) for r, f in zip(runs, fresh, strict=True)],
            same_sequence_ratio=round(secs[-1] / secs[4], 3),
            median_last5_vs_batches3to7=round(statistics.median(secs[-5:]) / statistics.median(secs[2:7]), 3),
            median_last5_vs_middle5=round(statistics.median(secs[-5:]) / statistics.median(secs[mid - 2:mid + 3]), 3),
            phases_last=runs[-1][-1]["phases"], phases_fresh5=fresh[-1][4]["phases"],
            notes=f"as batch{nb}_vs_batch5, on the Spark engine: one Connect client per repeat runs all the batches "
                  f"(as `millpond run` does), median of {reps} repeats")
