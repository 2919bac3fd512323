"""The Spark engine against the streaming peers (issue 39): Structured Streaming on the same Connect server, Flink
and Beam on the same events, each with the Spark engine's batches run by Connect clients of the bench's server
(``bench.spark_engine``). Records (see bench/README.md): ``sessions_<n>_<b>batches_spark_engine_vs_structured_
streaming``, ``sessions_<n>_spark_engine_vs_flink``, ``sessions_<n>_spark_engine_vs_beam`` and
``sessions_<n>_<b>batches_spark_engine_vs_beam``.
"""

from __future__ import annotations

import shutil
import uuid
from typing import TYPE_CHECKING, Any

from millpond.lake.tables import storage_options

if TYPE_CHECKING:
    from bench.workload import Workload


def _size(n: int) -> str:
    return f"{n // 1_000_000}m" if n >= 1_000_000 and n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n % 1000 == 0 else str(n))


class SparkPeerMeasures:
    """Measure methods of ``bench.harness.Bench`` (mixed in beside ``SparkEngineMeasures``)."""

    # Structured Streaming -----------------------------------------------------------------------
    def engine_as_tasks(self, wl: Workload, batches: list[int], doc: dict[str, Any]) -> list[dict[str, Any]]:
        """``wl``'s batches of one pipeline, each in a fresh Connect client preloaded as a DAG task's process
        (``preload_s`` not counted): spawn -> the batch's marker per batch."""
        out = []
        for i in batches:
            res = self.client({"mode": "batches", "pipelines": [doc], "steps": self._steps(wl, [i]), "preload": True})
            b = res["batches"][0]
            out.append({"batch": i, "task_s": round(b["ended_at"] - res["spawned_at"] - res["preload_s"], 4),
                        "startup_s": round(res["startup_s"] - res["preload_s"], 4), "connect_s": res["connect_s"],
                        "batch_s": b["seconds"], "path": b["path"], "phases": b["phases"], "counts": b["counts"],
                        "peak_rss_gib": res["peak_rss_gib"]})
        return out

    def structured_streaming_on_connect(self, wl: Workload) -> dict[str, Any]:
        """Structured Streaming in one Connect client of the bench's server: per batch, its files land in the
        source folder and one ``availableNow`` run of the query processes them (``connect_client``)."""
        base = self.workdir / f"ss-connect-{wl.label}-{uuid.uuid4().hex[:6]}"
        staged = base / "staged"
        shutil.copytree(self.local_copy(wl), staged)
        names = sorted(p.name for p in staged.iterdir())
        batches = [[f for f in names if f.startswith(f"b{i:05d}-")] for i in range(wl.spec.batches)]
        uri = self.settings.table_uri(f"bench_ss_{uuid.uuid4().hex[:8]}", "panes")
        try:
            res = self.client({"mode": "structured_streaming", "src": str(base / "src"), "staged": str(staged),
                               "checkpoint": str(base / "checkpoint"), "uri": uri,
                               "storage_options": storage_options(self.settings), "batches": batches})
        finally:
            shutil.rmtree(base, ignore_errors=True)
        rows = 0
        try:
            from deltalake import DeltaTable

            rows = DeltaTable(uri, storage_options=storage_options(self.settings)).to_pyarrow_table().num_rows
        except Exception:  # noqa: BLE001 - no pane closed at a small size: no table
            rows = 0
        res["rows_written"] = rows
        res["events_per_s"] = round(wl.input_events / res["seconds"], 1)
        return res

    def measure_spark_engine_structured_streaming(self) -> None:
        """The same events as ``spark_stream_batches`` micro-batches: Millpond's Spark engine as Airflow runs it
        (a fresh, preloaded Connect client per batch) vs Structured Streaming on the same server (one client,
        one ``availableNow`` run per batch as its files land)."""
        n, nb = self.plan.spark_stream_events, self.plan.spark_stream_batches
        if not n or nb < 1:
            return
        self.connect_url()
        # the default workload (late tail and duplicates): ours fires early, on-time and late panes and retracts
        wl = self.workload(n, self.plan.keys(n), batches=nb, seed=13)
        self.local_copy(wl)
        self.log(f"Spark engine vs Structured Streaming: {wl.input_events} events in {nb} micro-batches, "
                 f"{wl.spec.keys} keys, sessions, same Connect server")
        # each side's whole sequence ``spark_stream_runs`` times, alternating; the best sequence of each counts
        ss_runs, ours_runs = [], []
        for _ in range(max(1, self.plan.spark_stream_runs)):
            ss = self.structured_streaming_on_connect(wl)
            self.log(f"  Structured Streaming {ss['seconds']}s (per batch "
                     + " ".join(f"{b['seconds']:.2f}" for b in ss["batches"]) + "; of which triggers "
                     + " ".join(f"{b['triggers_s']:.2f}" for b in ss["batches"])
                     + f"; {ss['rows_written']} sessions written)")
            ours = self.engine_as_tasks(wl, list(range(nb)), self._doc("sessions", wl))
            self.log(f"  ours {sum(b['task_s'] for b in ours):.2f}s as {nb} tasks (per task "
                     + " ".join(f"{b['task_s']:.2f}" for b in ours)
                     + f"; run_batch {sum(b['batch_s'] for b in ours):.2f}s)")
            ss_runs.append(ss)
            ours_runs.append(ours)
        ss = min(ss_runs, key=lambda r: r["seconds"])
        ours = min(ours_runs, key=lambda r: sum(b["task_s"] for b in r))
        seconds = round(sum(b["task_s"] for b in ours), 4)
        counts: dict[str, int] = {}
        for b in ours:
            for k, v in b["counts"].items():
                counts[k] = counts.get(k, 0) + v
        phases: dict[str, float] = {}
        for b in ours:
            for k, v in b["phases"].items():
                phases[k] = round(phases.get(k, 0.0) + v, 4)
        ours_eps = round(wl.input_events / seconds, 1)
        self.measures["spark_engine_structured_streaming"] = {"events": wl.input_events, "batches": nb,
                                                              "ours": ours, "structured_streaming": ss}
        note = "" if n == 1_000_000 else f" ({wl.input_events} events: this plan's size, not 1M)"
        self._spark_record(
            f"sessions_{_size(n)}_{nb}batches_spark_engine_vs_structured_streaming", ours_eps, ss["events_per_s"],
            "Spark Structured Streaming on the same Connect server: file source over a local copy (each batch's files "
            "land, then one availableNow run from the checkpoint), watermark 2m, dropDuplicatesWithinWatermark, "
            "session_window 5m, sum, append, foreachBatch -> Delta via delta-rs", "events/s", False,
            target_measure="sessions_1m_10batches_spark_engine_vs_structured_streaming",
            path=sorted({b["path"] for b in ours}), events=wl.input_events, keys=wl.spec.keys, batches=nb,
            ours_seconds=seconds, peer_seconds=ss["seconds"], ours_task_seconds=[b["task_s"] for b in ours],
            ours_run_batch_seconds=[b["batch_s"] for b in ours],
            peer_batch_seconds=[b["seconds"] for b in ss["batches"]],
            peer_trigger_seconds=[b["triggers_s"] for b in ss["batches"]],
            peer_startup_s=ss["startup_s"], peer_connect_s=ss["connect_s"], phases=phases, counts=counts,
            peer_sessions_written=ss["rows_written"],
            ours_runs_seconds=[round(sum(b["task_s"] for b in r), 4) for r in ours_runs],
            peer_runs_seconds=[r["seconds"] for r in ss_runs],
            notes="best of each side's sequences, run alternating; ours: each batch a fresh Connect client "
                  "preloaded as a DAG task's process, spawn -> marker (less "
                  "preload_s), summed; early panes (AfterDelay 1m), late panes (AtCount 1) and retractions "
                  "(accumulating_and_retracting) on. Peer: one client (its start and connect not counted), the first "
                  "batch's landing -> the last run's end; append mode emits each session once, when the watermark "
                  "closes it (no early or late panes: Spark refuses update mode for session windows). Workload with "
                  "the late tail and duplicates" + note)

    # Flink ---------------------------------------------------------------------------------------
    def measure_spark_engine_flink(self) -> None:
        """Flink 2.x (``Bench.flink``) on the events of the Spark engine's 1M batch; ours on the Spark engine (a
        fresh client, run_batch seconds) once before and once after Flink's run, the slower counted."""
        n = self.plan.flink_events
        if not n or not self.plan.spark_engine_events:
            return
        self.connect_url()
        wl = self.workload(n, self.plan.keys(n))
        self.log(f"Flink vs the Spark engine: {wl.input_events} events in one batch, {wl.spec.keys} keys, sessions")
        runs = [self.spark_engine_batch("sessions", wl)]
        self.log(f"  ours {runs[0]['seconds']}s {runs[0]['phases']}")
        flink = self.flink_or_note(wl, "Flink peer (Spark engine)")
        if flink is None:
            return
        runs.append(self.spark_engine_batch("sessions", wl))
        self.log(f"  ours {runs[1]['seconds']}s {runs[1]['phases']}")
        ours = max(runs, key=lambda r: r["seconds"])
        check = self.session_sums_check(wl, ours["pipeline"], flink.pop("final"))
        self.log(f"  check: {check['vs_ours_current']['different_sums']} of {check['vs_ours_current']['matched']} "
                 "of our fired sessions differ from Flink's")
        self.measures["spark_engine_flink"] = {"events": wl.input_events, "ours": ours,
                                               "ours_runs_seconds": [r["seconds"] for r in runs], "flink": flink,
                                               "check": check}
        note = "" if n == 1_000_000 else f" ({wl.input_events} events: this plan's size, not 1M)"
        self._spark_record(
            f"sessions_{_size(n)}_spark_engine_vs_flink", ours["events_per_s"], flink["events_per_s"],
            f"Apache Flink {flink['flink']} DataStream on a local mini-cluster (parallelism {flink['parallelism']}), "
            "as sessions_1m_vs_flink", "events/s", False, target_measure="sessions_1m_spark_engine_vs_flink",
            path=ours["path_ran"], events=wl.input_events, keys=wl.spec.keys, ours_seconds=ours["seconds"],
            ours_runs_seconds=[r["seconds"] for r in runs], peer_seconds=flink["seconds"],
            peer_wall_seconds=flink["wall_s"], peer_cpu_s=flink["cpu_s"], phases=ours["phases"],
            counts=ours["batches"][0]["counts"],
            sums_equal_ours=check["vs_ours_current"]["different_sums"] == 0,
            notes="ours: run_batch of a fresh pipeline in a fresh Connect client of the bench's server (connect "
                  "excluded), the slower of a run before and one after Flink's; Flink as in sessions_1m_vs_flink "
                  "(net job runtime)" + note)

    # Beam ----------------------------------------------------------------------------------------
    def measure_spark_engine_beam(self) -> None:
        """The Beam records with the Spark engine as ours: the one-batch (``sessions_<n>_vs_beam``) and the
        ``stream_batches``-batch workloads, each + a flush batch, in one client (as ``millpond run``). Beam's
        figure is this run's own if ``measure_beam`` / ``measure_streaming`` ran, else Beam runs here."""
        n, nb = self.plan.stream_events, self.plan.stream_batches
        if not n or not self.plan.beam:
            return
        self.connect_url()
        prior = {1: (self.measures.get("beam") or {}).get("beam"),
                 nb: (self.measures.get("streaming") or {}).get("beam")}
        out: dict[str, Any] = {}
        for batches in dict.fromkeys((1, nb)):
            wl = self.workload(n, self.plan.keys(n), batches=batches, seed=13, late_fraction=0.0)
            self.log(f"Beam vs the Spark engine: {wl.input_events} events in {batches} micro-batch(es) + flush")
            runs = [self.spark_engine_batch("sessions", wl, flush=True)]
            beam, reused = prior.get(batches), True
            if beam is None:
                reused = False
                try:
                    beam = self.beam(wl)
                except Exception as exc:  # noqa: BLE001
                    self.notes.append(f"Beam peer (Spark engine, {batches} batches) failed: {exc}")
                    self.log(f"  Beam failed: {exc}")
                    continue
                self.log(f"  Beam {beam['seconds']:.1f}s")
            runs.append(self.spark_engine_batch("sessions", wl, flush=True))
            ours = max(runs, key=lambda r: r["seconds"])
            self.log(f"  ours {[r['seconds'] for r in runs]}s (the slower counts) {ours['phases']}")
            out[str(batches)] = {"ours": ours, "ours_runs_seconds": [r["seconds"] for r in runs], "beam": beam,
                                 "beam_reused": reused}
            name = (f"sessions_{_size(n)}_spark_engine_vs_beam" if batches == 1
                    else f"sessions_{_size(n)}_{batches}batches_spark_engine_vs_beam")
            self._spark_record(
                name, ours["events_per_s"], beam["events_per_s"],
                "Beam 2.77 Python BundleBasedDirectRunner, TestStream one bundle per batch, then watermark +inf; "
                "accumulating", "events/s", False,
                target_measure="sessions_100k_spark_engine_vs_beam" if batches == 1 else
                "sessions_100k_10batches_spark_engine_vs_beam",
                path=ours["path_ran"], events=wl.input_events, batches=batches, ours_seconds=ours["seconds"],
                ours_runs_seconds=[r["seconds"] for r in runs], peer_seconds=round(beam["seconds"], 3),
                phases=ours["phases"],
                notes="ours: the batch(es) and a flush batch at watermark +inf of a fresh pipeline in one fresh "
                      "Connect client (run_batch seconds, connect excluded), the slower of two runs; Beam: "
                      + ("this run's in-process record's Beam figure (same workload)" if reused else
                         "one run here") + "; workload without the late tail (Beam stalls on it); Beam does not dedup")
        if out:
            self.measures["spark_engine_beam"] = out

