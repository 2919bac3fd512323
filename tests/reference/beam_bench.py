"""Throughput of the Beam reference on one workload (run by ``make bench`` in the Beam venv).

    var/beam-venv/<hash>/bin/python tests/reference/beam_bench.py \
        --pipeline P.yaml --events E.jsonl --start T --out panes.jsonl

Same batch cutting and TestStream mapping as ``beam_runner.py`` (one bundle per micro-batch, then a
flush to watermark +infinity); times only the pipeline (plan + run), not interpreter start or
``import apache_beam``. Prints one JSON object: seconds, events, batches, panes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--start", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import beam_runner

    beam_runner.private_home()
    import apache_beam  # noqa: F401 - import cost is not part of the measure
    import yaml

    with open(args.pipeline) as fh:
        spec = yaml.safe_load(fh)
    events = beam_runner.load_events(args.events, spec.get("value_type", "int"))
    started = time.perf_counter()
    plan = beam_runner.plan_batches(spec, events, args.start, None, flush=True)
    try:
        panes = beam_runner.run(spec, plan, args.out)
    except beam_runner.Unsupported as exc:
        print(f"unsupported: {exc}", file=sys.stderr)
        return beam_runner.EXIT_UNSUPPORTED
    except TypeError as exc:
        if "BaseException" not in str(exc):
            raise
        print(f"beam stalled (known bug: no garbage-collection firing, leftover data at window end + lateness; "
              f"after {time.perf_counter() - started:.1f}s): {exc}", file=sys.stderr)
        return beam_runner.EXIT_BEAM_BUG
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "events": len(events), "batches": len(plan["batches"]),
                      "panes": len(panes)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
