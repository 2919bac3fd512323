"""Throughput of Apache Flink on the bench's `sessions` workload (run by ``python -m bench`` in the Flink venv).

    var/flink-venv/<hash>/bin/python tests/reference/flink_bench.py \
        --pipeline P.json --input DIR --out DIR [--parallelism 2]

Flink's Table API has no early or late firings for session windows (``Session window doesn't support
EMIT strategy currently``, Flink 2.3), so the peer is the DataStream job ``FlinkSessionsBench.java``:
sessions with the pipeline's gap and allowed lateness, ``AtWatermark(early=AfterDelay(d),
late=AtCount(1))`` as a Flink trigger, sums accumulated, earlier panes retracted. It runs on the JVM
against the jars of the ``apache-flink`` wheel in this venv (compiled once with the JDK's ``javac``,
cached beside the venv), on a local mini-cluster, reading DIR's JSONL files (the landing files).

Prints one JSON object: ``seconds`` (the job's net runtime as Flink's JobManager reports it: from
submission to the last pane written; excludes interpreter and JVM start and the mini-cluster's
start-up), ``wall_s`` (the ``execute()`` call: includes the mini-cluster's start), ``cpu_s`` (the JVM's CPU
seconds over that call, all threads), pane counts, and
writes ``final.tsv`` to DIR (key, window start ms, window end ms, sum: each window's last pane after
retractions), for the harness to compare with other systems.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "FlinkSessionsBench.java"
#: the only trigger shape the Java job implements
TRIGGER = re.compile(r"^AtWatermark\(early=AfterDelay\('([^']+)'\), late=AtCount\(1\)\)$")
sys.path.insert(0, str(HERE))
from beam_runner import parse_duration  # noqa: E402 - the contract's durations, stdlib only


class Unsupported(Exception):
    """The pipeline is not the shape the Flink job implements."""


def job_args(spec: dict) -> list[str]:
    """GAP_MS LAG_MS EARLY_DELAY_MS LATENESS_MS of a `sessions` pipeline; strict about its shape."""
    trigger = TRIGGER.match(spec.get("trigger", ""))
    window = spec.get("window", {})
    watermark = spec.get("watermark", {})
    wanted = {"window.type": (window.get("type"), "sessions"), "aggregation": (spec.get("aggregation"), "sum"),
              "accumulation": (spec.get("accumulation"), "accumulating_and_retracting"),
              "watermark.policy": (watermark.get("policy"), "processing_time")}
    wrong = [f"{k}={got!r} (want {want!r})" for k, (got, want) in wanted.items() if got != want]
    if trigger is None:
        wrong.append(f"trigger={spec.get('trigger')!r}")
    if wrong:
        raise Unsupported("; ".join(wrong))
    ms = [parse_duration(v) // 1000 for v in (window["gap"], watermark.get("lag", 0), trigger.group(1),
                                              spec.get("allowed_lateness", 0))]
    return [str(x) for x in ms]


def java_tools() -> tuple[str, str]:
    """java and javac of one JDK (JAVA_HOME, else the java on PATH)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java:
        raise Unsupported("no java: the Flink peer needs a JDK 17")
    javac = Path(java).resolve().parent / "javac"
    if not javac.exists():
        raise Unsupported(f"no javac beside {java}: the Flink peer compiles its job with a JDK 17")
    return java, str(javac)


def compiled(flink_lib: Path, javac: str) -> Path:
    """The job's classes, compiled once per source version into the venv."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    classes = Path(sys.prefix) / "millpond-classes" / digest
    if (classes / "FlinkSessionsBench.class").exists():
        return classes
    build = Path(tempfile.mkdtemp(prefix="classes-", dir=classes.parent if classes.parent.exists() else None))
    proc = subprocess.run([javac, "-nowarn", "-cp", f"{flink_lib}/*", "-d", str(build), str(SOURCE)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(build, ignore_errors=True)
        raise RuntimeError(f"javac failed: {proc.stderr.strip()[-2000:]}")
    classes.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(classes, ignore_errors=True)
    shutil.move(str(build), classes)
    return classes


def final_windows(out: Path) -> dict:
    """Replay the panes (each file is one subtask's emission order, and a key lives in one subtask):
    a pane replaces its window's value, a retraction removes it. Writes final.tsv; returns counts."""
    live: dict[tuple[str, str, str], int] = {}
    panes = retractions = early = 0
    for path in sorted(out.glob("panes-*.tsv")):
        with path.open() as fh:
            for line in fh:
                key, start, end, value, sign, is_early = line.rstrip("\n").split("\t")
                if sign == "-1":
                    retractions += 1
                    if live.get((key, start, end)) == int(value):
                        del live[(key, start, end)]
                    continue
                panes += 1
                early += is_early == "1"
                live[(key, start, end)] = int(value)
    with (out / "final.tsv").open("w") as fh:
        fh.write("key\tstart_ms\tend_ms\tvalue\n")
        for (key, start, end), value in live.items():
            fh.write(f"{key}\t{start}\t{end}\t{value}\n")
    return {"panes": panes, "retractions": retractions, "early_panes": early, "final_windows": len(live),
            "final_sum": sum(live.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="pipeline document (JSON)")
    parser.add_argument("--input", required=True, help="folder of landing JSONL files")
    parser.add_argument("--out", required=True, help="folder for the panes and final.tsv")
    parser.add_argument("--parallelism", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--heap", default="3g", help="JVM -Xmx")
    args = parser.parse_args(argv)
    import pyflink

    try:
        spec = json.loads(Path(args.pipeline).read_text())
        numbers = job_args(spec)
        java, javac = java_tools()
    except Unsupported as exc:
        print(f"unsupported: {exc}", file=sys.stderr)
        return 3
    lib = Path(pyflink.__file__).resolve().parent / "lib"
    classes = compiled(lib, javac)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [java, f"-Xmx{args.heap}", "-cp", f"{lib}/*:{classes}", "FlinkSessionsBench", str(Path(args.input).resolve()),
           str(out.resolve()), str(args.parallelism), *numbers]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"flink job failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-3000:]}", file=sys.stderr)
        return 1
    timing = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    events = sum(1 for p in Path(args.input).glob("*.jsonl") for _ in p.open("rb"))
    print(json.dumps({"seconds": timing["net_runtime_s"], "wall_s": round(timing["wall_s"], 3),
                      "cpu_s": round(timing["cpu_s"], 3), "events": events,
                      "parallelism": args.parallelism, "flink": pyflink.version.__version__,
                      **final_windows(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
