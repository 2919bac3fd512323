"""`make bench`: our engine against peers on the same data, in one run (see bench/README.md)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from millpond.config import PROJECT_ROOT

from bench.harness import PLANS, main_bench, ratio_table, write_readme_table


def _configure(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="~3-minute smoke (small sizes); writes var/bench/")
    size.add_argument("--full", action="store_true", help="add 10M events (long; needs several GiB of memory)")
    p.add_argument("--airflow", action="store_true",
                   help="add airflow_dag_run_1k_s: DAG runs in a private Airflow (~1 minute to start; --full has it)")
    p.add_argument("--no-beam", action="store_true", help="skip the Beam peer (its venv is built on first use)")
    p.add_argument("--no-flink", action="store_true", help="skip the Flink peer (its venv is built on first use)")
    p.add_argument("--lake-bytes", type=int, metavar="BATCHES", dest="lake_bytes",
                   help="run lake_bytes_* over this many batches (the lake counted after a quarter and at the end; "
                        "--full: 2000; default: skipped)")
    p.add_argument("--lake-bytes-expire", metavar="DURATION", dest="lake_bytes_expire",
                   help="the lake_bytes pipeline's expire: (event time; default 1d; none: its output is kept for good)")
    p.add_argument("--only", action="append", metavar="MEASURE",
                   help="run only this measure method (e.g. measure_flink; repeatable)")
    p.add_argument("--out", help="results JSON (default bench/results.json; var/bench/results-quick.json for --quick)")
    p.add_argument("--readme", metavar="RESULTS", nargs="?", const=str(PROJECT_ROOT / "bench/results.json"),
                   help="only regenerate the records table at the top of bench/README.md from a results JSON "
                        "(default bench/results.json); a complete --full run does it itself")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    _configure(parser)
    args = parser.parse_args(argv)
    if args.readme:
        write_readme_table(json.loads(Path(args.readme).read_text()))
        return 0
    plan = PLANS["quick" if args.quick else "full" if args.full else "default"]
    if args.no_beam:
        plan = replace(plan, beam=False)
    if args.no_flink:
        plan = replace(plan, flink_events=0)
    if args.airflow:
        plan = replace(plan, airflow=True)
    if args.lake_bytes is not None:
        plan = replace(plan, lake_bytes_batches=args.lake_bytes)
    if args.lake_bytes_expire is not None:
        plan = replace(plan, lake_bytes_expire=None if args.lake_bytes_expire == "none" else args.lake_bytes_expire)
    default_out = (PROJECT_ROOT / "var/bench/results-quick.json") if args.quick else (
        PROJECT_ROOT / "bench/results.json")
    out = Path(args.out) if args.out else default_out
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    steps = [m for o in args.only for m in o.split(",")] if args.only else None
    # a terminated bench stops what it started (its store, Spark) as an interrupted one does
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    doc = main_bench(plan, out, log=log, steps=steps)
    print(ratio_table(doc["records"]))
    for note in doc["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
