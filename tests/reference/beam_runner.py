"""Reference implementation of a Millpond replay on Apache Beam (differential testing).

Run with the Beam virtualenv's interpreter (see ``beam_env.py``), never with the project's:

    var/beam-venv/<hash>/bin/python tests/reference/beam_runner.py \
        --pipeline P.yaml --events E.jsonl --out panes.jsonl [--start T] [--end T]

Same inputs and batch cutting as ``python -m millpond replay`` (docs/contracts.md): batch i holds
the arrivals in [start + i*interval, start + (i+1)*interval) and its processing time is the
interval end. Each batch becomes one TestStream step group on Beam's BundleBasedDirectRunner:

    advance processing time to the batch's processing time
    add the batch's elements (timestamped by event_time)
    advance the watermark to the batch's watermark

so triggers are evaluated once per batch (one bundle per step). After the last batch the
watermark goes to +infinity (Beam's TestStream always ends there).

Beam's TestClock starts at 0, so the runner feeds Beam *relative* processing times
(``batch processing time - start``): real event times (years after 1970) are then far above Beam's
processing times, which sidesteps Beam's bug of treating a processing-time timer's timestamp as
the watermark. Reported ``processing_time`` values are absolute again.

Output: one JSON object per pane, sorted by (batch, key, window, pane_index), with the pane
columns of the contract: key, window_start, window_end (ISO), value, pane_index, timing, is_last,
kind ("value"; Beam has no retractions), batch and processing_time (inferred from Beam's test
clock at emission; batches count from 1 like the engine's batch counter), watermark (the batch's
watermark), plus ``beam_elements`` (number of elements Beam put in the pane: 0 marks an empty
pane). A pane emitted after the last batch (only when the runner moves the clock on to flush
processing-time timers) has ``batch`` = number of batches + 1.

Exit status: 0 ok; 2 bad input; 3 the configuration has no Beam equivalent (message on stderr,
starting with ``unsupported:``); 4 Beam failed in a known way (e.g. its missing garbage-collection
firing stalls the pipeline on leftover data).

Self-contained on purpose: it imports nothing from millpond (independent reference).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import json
import math
import os
import re
import shutil
import sys
import tempfile
from datetime import UTC, datetime, timedelta

US = 1_000_000
MIN_US = -62135596800 * US  # 0001-01-01T00:00:00Z
MAX_US = 253402300799 * US + 999_999  # 9999-12-31T23:59:59.999999Z
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|d)?\s*$")
_UNITS = {"us": 1, "ms": 1_000, "s": US, "m": 60 * US, "h": 3600 * US, "d": 86400 * US, None: US}

EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3
EXIT_BEAM_BUG = 4


class Unsupported(Exception):
    """The configuration has no faithful Beam equivalent."""


# ---------------------------------------------------------------------------------------------
# time helpers (mirrors the contract, not the engine's code)


def parse_duration(value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return int(round(value * US))
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"not a duration: {value!r}")
    return int(round(float(match.group(1)) * _UNITS[match.group(2)]))


def to_us(value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"not a timestamp: {value!r}")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return (value - _EPOCH) // timedelta(microseconds=1)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isinf(value):
            return MAX_US if value > 0 else MIN_US
        return int(round(value * US))
    text = str(value).strip()
    if text.lower() in ("inf", "+inf", "infinity", "+infinity", "max"):
        return MAX_US
    if text.lower() in ("-inf", "-infinity", "min"):
        return MIN_US
    try:
        return int(round(float(text) * US))
    except ValueError:
        pass
    return to_us(datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00")))


def iso(us: int) -> str:
    if us >= MAX_US:
        return "9999-12-31T23:59:59.999999Z"
    if us <= MIN_US:
        return "0001-01-01T00:00:00Z"
    return (_EPOCH + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------
# config -> Beam


def _duration_arg(node) -> int:
    """Whole seconds: Beam's AfterProcessingTime proto translation needs an int delay."""
    us = parse_duration(ast.literal_eval(node))
    if us % US:
        raise Unsupported("AfterDelay with sub-second precision (Beam needs whole seconds)")
    return us // US


def build_trigger(expr: str, extra_delay: int = 0):
    """Millpond trigger expression -> Beam TriggerFn (``extra_delay`` seconds added to AfterDelay)."""
    from apache_beam.transforms import trigger as tr

    def conv(node):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError(f"not a trigger: {ast.unparse(node)}")
        name = node.func.id
        args = node.args
        kwargs = {k.arg: k.value for k in node.keywords}
        if name == "AtWatermark":
            early = conv(kwargs["early"]) if kwargs.get("early") is not None else None
            late = conv(kwargs["late"]) if kwargs.get("late") is not None else None
            return tr.AfterWatermark(early=early, late=late)
        if name == "AtCount":
            return tr.AfterCount(int(ast.literal_eval(args[0])))
        if name == "AfterDelay":
            return tr.AfterProcessingTime(_duration_arg(args[0]) + extra_delay)
        if name == "Repeat":
            return tr.Repeatedly(conv(args[0]))
        if name == "SequenceOf":
            return tr.AfterEach(*[conv(a) for a in args])
        if name == "FirstOf":
            return tr.AfterAny(*[conv(a) for a in args])
        if name == "AllOf":
            return tr.AfterAll(*[conv(a) for a in args])
        if name == "RepeatUntil":
            return tr.OrFinally(tr.Repeatedly(conv(args[0])), conv(args[1]))
        if name == "AtPeriod":
            raise Unsupported("AtPeriod (aligned processing-time periods) has no Beam equivalent")
        raise Unsupported(f"trigger {name} has no Beam mapping")

    tree = ast.parse(expr.strip(), mode="eval")
    return conv(tree.body)


def build_window(cfg: dict):
    from apache_beam.transforms import window as bw

    cfg = dict(cfg or {"type": "global"})
    kind = cfg.pop("type", "global")
    secs = {k: parse_duration(v) / US for k, v in cfg.items()}
    if kind == "global":
        return bw.GlobalWindows()
    if kind == "fixed":
        return bw.FixedWindows(secs["size"], secs.get("offset", 0))
    if kind == "sliding":
        return bw.SlidingWindows(secs["size"], secs["period"], secs.get("offset", 0))
    if kind == "sessions":
        return bw.Sessions(secs["gap"])
    raise Unsupported(f"window type {kind!r} has no Beam mapping")


def build_accumulation(mode: str):
    from apache_beam.transforms.trigger import AccumulationMode

    if mode == "discarding":
        return AccumulationMode.DISCARDING
    if mode == "accumulating":
        return AccumulationMode.ACCUMULATING
    if mode == "accumulating_and_retracting":
        raise Unsupported("Beam has no accumulating_and_retracting mode (an unknown mode silently accumulates)")
    raise ValueError(f"unknown accumulation {mode!r}")


def aggregate(name: str, values: list):
    """The pane value of an aggregation over a pane's elements (None for an empty min/max/mean)."""
    if name == "sum":
        return sum(values, 0)
    if name == "count":
        return len(values)
    if name == "min":
        return min(values) if values else None
    if name == "max":
        return max(values) if values else None
    if name == "mean":
        return (sum(values, 0) / len(values)) if values else None
    raise Unsupported(f"aggregation {name!r} has no reference implementation")


# ---------------------------------------------------------------------------------------------
# batches


def load_events(path: str, value_type: str) -> list[dict]:
    events = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            raw = json.loads(line)
            try:
                value = raw["value"]
                value = int(value) if value_type == "int" else float(value)
                events.append(
                    {
                        "id": raw.get("id"),
                        "key": str(raw["key"]),
                        "value": value,
                        "event_us": to_us(raw["event_time"]),
                        "arrival_us": to_us(raw["arrival_time"]) if raw.get("arrival_time") is not None else None,
                    }
                )
            except (KeyError, ValueError, TypeError) as exc:
                print(f"beam_runner: skipping bad event on line {n}: {exc}", file=sys.stderr)
    return events


def plan_batches(spec: dict, events: list[dict], start_arg: str | None, end_arg: str | None,
                 flush: bool = True) -> dict:
    """Cut batches exactly as the replay CLI does; returns start, interval and per-batch data.

    Explicit watermarks: one batch per value. Otherwise batches up to the last arrival's (or
    ``--end``). Then, unless ``flush`` is off, one more batch with the watermark at +infinity.
    """
    interval = parse_duration(spec.get("batch_interval", "5m"))
    arrivals = [e["arrival_us"] for e in events if e["arrival_us"] is not None]
    if start_arg is not None:
        start = to_us(start_arg)
    elif arrivals:
        start = min(arrivals) // interval * interval
    else:
        start = 0
    wm_cfg = spec.get("watermark") or {"policy": "processing_time", "lag": 0}
    policy = wm_cfg.get("policy", "processing_time")
    if policy == "explicit":
        wms = [to_us(v) for v in wm_cfg["values"]]
        n = len(wms)
    else:
        stop = to_us(end_arg) if end_arg is not None else (max(arrivals) + 1 if arrivals else start + interval)
        n = max(1, -(-(stop - start) // interval))
        wms = []
    total = n + (1 if flush else 0)
    batches = [{"elements": [], "ptime": start + (i + 1) * interval} for i in range(total)]
    ignored = 0
    for e in events:
        arrival = e["arrival_us"]
        i = 0 if arrival is None else (arrival - start) // interval
        if 0 <= i < n:
            batches[i]["elements"].append(e)
        else:
            ignored += 1
    if ignored:
        print(f"beam_runner: {ignored} events arrive outside the {n} batches: ignored", file=sys.stderr)
    current = MIN_US
    max_event = None
    for i, b in enumerate(batches):
        if i >= n:
            wm = MAX_US
        elif policy == "explicit":
            wm = wms[i]
        elif policy == "processing_time":
            wm = b["ptime"] - parse_duration(wm_cfg.get("lag", 0))
        elif policy == "bounded_out_of_orderness":
            times = [e["event_us"] for e in b["elements"]] + ([max_event] if max_event is not None else [])
            max_event = max(times) if times else None
            wm = MIN_US if max_event is None else max_event - parse_duration(wm_cfg.get("bound", 0))
        else:
            raise Unsupported(f"watermark policy {policy!r}")
        current = max(current, wm)  # watermarks never move back
        b["watermark"] = current
    return {"start": start, "interval": interval, "batches": batches}


# ---------------------------------------------------------------------------------------------
# the Beam pipeline


def _install_step_probe() -> None:
    """Count the TestStream events Beam has read, on an importable class the output DoFn can see.

    The direct runner reads the next TestStream event only when every other transform is idle, so
    a pane emitted while the counter is k was caused by TestStream event k-1 (0-based): that
    tells the micro-batch it belongs to.
    """
    from apache_beam.runners.direct import transform_evaluator as te

    cls = te._TestStreamEvaluator
    if getattr(cls, "_millpond_probe", False):
        return
    original = cls.process_element

    def process_element(self, element):
        cls._millpond_steps += 1
        return original(self, element)

    cls.process_element = process_element
    cls._millpond_steps = 0
    cls._millpond_probe = True


STEP_ORDERS = ("engine", "clock-first")


#: No-op TestStream events after each real one. Beam's direct runner does not drain the pipeline
#: between TestStream events: with its single worker, an element reaches the GroupByKey a few
#: events after it was added (one pipeline stage per event read), so without padding a batch's
#: elements would be grouped after the *next* watermark / clock steps. Empty element events let
#: every stage finish first; 8 is twice the depth of this pipeline.
SETTLE_EVENTS = 8


def run(spec: dict, plan: dict, out_path: str, step_order: str = "engine", settle: int = SETTLE_EVENTS) -> list[dict]:
    """Run the batches through Beam; return the panes in the output format.

    ``step_order`` says how one micro-batch becomes TestStream steps:

    - ``engine`` (default; the engine's documented micro-batch semantics: a batch's elements are
      all added, then the watermark and processing time advance): add the elements (at the
      previous batch's processing time), advance the watermark, then advance the clock to the
      batch's processing time. ``AfterDelay(d)`` maps to ``AfterProcessingTime(d + interval)``
      so that its timer, counted from the element's Beam clock (the previous batch's processing
      time), lands where the engine puts it (element batch's processing time + d), and a timer
      that comes due in a batch fires with that batch's elements in the pane.
    - ``clock-first``: advance the clock, add the elements, advance the watermark. A
      processing-time timer due in a batch then fires *before* that batch's elements are added.
    """
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms import window as bw
    from apache_beam.utils.timestamp import Duration, Timestamp

    if step_order not in STEP_ORDERS:
        raise ValueError(f"step order {step_order!r}: use one of {STEP_ORDERS}")
    start, interval, batches = plan["start"], plan["interval"], plan["batches"]
    windowfn = build_window(spec.get("window"))
    extra_delay = interval // US if step_order == "engine" else 0
    if step_order == "engine" and interval % US:
        raise Unsupported("batch_interval with sub-second precision")
    trigger = build_trigger(spec.get("trigger", "Repeat(AtWatermark())"), extra_delay=extra_delay)
    accumulation = build_accumulation(spec.get("accumulation", "discarding"))
    agg = spec.get("aggregation", "sum")
    aggregate(agg, [])  # validate the name early
    lateness_us = parse_duration(spec.get("allowed_lateness", 0))

    stream = TestStream()
    step_batch: list[int] = []  # TestStream event index -> 0-based batch

    def settle_after(i: int) -> None:
        for _ in range(settle):
            stream.add_elements([])
            step_batch.append(i)

    beam_now = 0  # Beam's TestClock starts at 0: feed it times relative to `start`
    current_wm = MIN_US

    def clock_to(i: int, rel: int) -> None:
        nonlocal beam_now
        if rel > beam_now:
            stream.advance_processing_time(Duration(micros=rel - beam_now))
            step_batch.append(i)
            beam_now = rel
            settle_after(i)

    def add(i: int, elements: list[dict]) -> None:
        if elements:
            stream.add_elements(
                [
                    beam.window.TimestampedValue((e["key"], e["value"]), Timestamp(micros=e["event_us"]))
                    for e in elements
                ]
            )
            step_batch.append(i)
            settle_after(i)

    def watermark_to(i: int, wm: int) -> None:
        nonlocal current_wm
        if wm > current_wm:
            if wm >= MAX_US:
                stream.advance_watermark_to_infinity()
            else:
                stream.advance_watermark_to(Timestamp(micros=wm))
            step_batch.append(i)
            current_wm = wm
            settle_after(i)

    for i, b in enumerate(batches):
        if step_order == "engine":
            add(i, b["elements"])
            watermark_to(i, b["watermark"])
            clock_to(i, b["ptime"] - start)
        else:
            clock_to(i, b["ptime"] - start)
            add(i, b["elements"])
            watermark_to(i, b["watermark"])
    after = len(batches)
    if _may_leave_processing_timers(spec.get("trigger", "")):
        # A pending processing-time timer at the end of input busy-loops Beam: move the clock past
        # any delay once the watermark is final (panes fired here get batch = len(batches) + 1).
        clock_to(after, beam_now + 10 * 86400 * US)
    watermark_to(after, MAX_US)

    _install_step_probe()
    raw_path = os.path.abspath(out_path) + ".raw"
    if os.path.exists(raw_path):
        os.remove(raw_path)
    options = PipelineOptions(flags=[], streaming=True, allow_unsafe_triggers=True)
    pipeline = beam.Pipeline(runner=BundleBasedDirectRunner(), options=options)
    (
        pipeline
        | "events" >> stream
        | "window" >> beam.WindowInto(
            windowfn,
            trigger=trigger,
            accumulation_mode=accumulation,
            allowed_lateness=Duration(micros=lateness_us),
            timestamp_combiner=bw.TimestampCombiner.OUTPUT_AT_EOW,
        )
        | "group" >> beam.GroupByKey()
        | "write" >> beam.ParDo(_make_writer()(raw_path))
    )
    result = pipeline.run()
    result.wait_until_finish()

    raw = []
    if os.path.exists(raw_path):
        with open(raw_path) as fh:
            raw = [json.loads(line) for line in fh if line.strip()]
        os.remove(raw_path)
    value_type = spec.get("value_type", "int")
    panes = []
    for r in raw:
        step = r["step"] - 1  # 0-based TestStream event that caused the pane
        index = step_batch[step] if 0 <= step < len(step_batch) else after
        ptime = batches[index]["ptime"] if index < len(batches) else start + beam_now
        value = aggregate(agg, r["values"])
        if value is not None and (agg == "mean" or value_type == "float"):
            value = float(value)
        panes.append(
            {
                "key": r["key"],
                "window_start": iso(r["start"]),
                "window_end": iso(r["end"]),
                "value": value,
                "pane_index": r["index"],
                "timing": r["timing"],
                "is_last": r["is_last"],
                "kind": "value",
                "batch": index + 1,  # 1-based, as the engine's batch counter
                "processing_time": iso(ptime),
                "watermark": iso(batches[index]["watermark"]) if index < len(batches) else iso(MAX_US),
                "beam_elements": len(r["values"]),
                "beam_step": step,
            }
        )
    panes.sort(key=lambda p: (p["batch"], p["key"], p["window_start"], p["window_end"], p["pane_index"]))
    return panes


def _may_leave_processing_timers(expr: str) -> bool:
    return "AfterDelay" in expr or "AtPeriod" in expr


def _make_writer():
    import apache_beam as beam

    class PaneWriter(beam.DoFn):
        """Append each pane as a JSON line to a file (metrics under-count in streaming)."""

        def __init__(self, path: str) -> None:
            self.path = path

        def process(self, kv, window=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
            from apache_beam.runners.direct import transform_evaluator as te
            from apache_beam.transforms.window import GlobalWindow
            from apache_beam.utils.windowed_value import PaneInfoTiming

            key, values = kv
            if isinstance(window, GlobalWindow):
                start, end = MIN_US, MAX_US
            else:
                start, end = window.start.micros, window.end.micros
            record = {
                "key": key,
                "start": start,
                "end": end,
                "values": list(values),
                "index": pane.index,
                "timing": PaneInfoTiming.to_string(pane.timing),
                "is_last": bool(pane.is_last),
                "nonspeculative_index": pane.nonspeculative_index,
                "step": getattr(te._TestStreamEvaluator, "_millpond_steps", 0),
            }
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    return PaneWriter


def private_home() -> str:
    """Point ``HOME`` at a directory of this process's own, removed when it exits: Beam writes its caches
    under the home, and a run must neither read another's nor leave its own behind."""
    home = tempfile.mkdtemp(prefix="beam-home-")
    os.environ["HOME"] = home
    atexit.register(shutil.rmtree, home, True)
    return home


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--start")
    parser.add_argument("--end")
    parser.add_argument("--no-flush", action="store_true", help="no final batch with the watermark at +infinity")
    parser.add_argument("--settle", type=int, default=SETTLE_EVENTS, help="no-op TestStream events after each step")
    parser.add_argument("--step-order", choices=STEP_ORDERS, default="engine",
                        help="how a batch maps to TestStream steps (see run())")
    args = parser.parse_args(argv)

    if not os.environ.get("MILLPOND_BEAM_KEEP_HOME"):
        private_home()
    import yaml

    try:
        with open(args.pipeline) as fh:
            spec = yaml.safe_load(fh)
        events = load_events(args.events, spec.get("value_type", "int"))
        plan = plan_batches(spec, events, args.start, args.end, flush=not args.no_flush)
    except Unsupported as exc:
        print(f"unsupported: {exc}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except (OSError, ValueError, KeyError) as exc:
        print(f"beam_runner: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        panes = run(spec, plan, args.out, step_order=args.step_order, settle=args.settle)
    except Unsupported as exc:
        print(f"unsupported: {exc}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except TypeError as exc:
        if "BaseException" in str(exc):
            print(
                "beam_runner: Beam stalled (known bug: no garbage-collection firing, leftover data in a "
                f"window at end of input): {exc}",
                file=sys.stderr,
            )
            return EXIT_BEAM_BUG
        raise
    with open(args.out, "w") as fh:
        for p in panes:
            fh.write(json.dumps(p) + "\n")
    print(f"beam_runner: {len(plan['batches'])} batches, {len(panes)} panes -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
