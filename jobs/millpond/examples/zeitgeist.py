"""Zeitgeist (MillWheel, section 2): spiking and dipping search queries, as a :class:`Computation`.

Each query (the key) counts its searches per one-second bucket and keeps a model of its per-second
rate (an exponentially weighted mean and variance) in persistent state.

- Spikes are reported on arrival: when a bucket's running count crosses the model's upper bound
  (more data can only make it larger), once per bucket, no timer needed.
- Dips need a complete picture: an event timer at the end of each bucket fires once the low
  watermark passes it; the bucket's final count (possibly 0) is compared with the lower bound, the
  model is updated, and the next bucket's timer is set, while the query has been seen within
  ``idle``. After an idle spell the chain restarts at the next record's bucket.

Bounds are mean +- k * std, with std at least sqrt(mean) (a Poisson floor, so quiet queries do not
alarm on noise); nothing is reported before ``warmup`` buckets were modelled, and anomalous buckets
move the model's mean by at most ``clamp`` std and leave its variance alone, so a spike neither
teaches the model to expect spikes nor widens its bounds, while a lasting level shift is still
learned (within a minute or so) and a lasting outage keeps being reported as dips for a while.
Records for buckets already finalized are dropped and counted (``dropped`` in the state), as
Zeitgeist does with late data.

As the paper draws it (Figure 1), the counting is its own computation: with ``input: counts`` each record
is a per-second count (a windowed counter's panes, ``source: {pipeline: ..., stream: panes}``; early panes
of a discarding counter add up to the second's count as it grows), and the model works on those.

Output: the stream ``anomalies`` (key, second, kind 'spike'|'dip', count, expected, batch), where
``count`` is the bucket's count when the spike was seen (spikes) or its final count (dips).
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import pyarrow as pa

from millpond.model.computation import Computation, Context, Record, Timer
from millpond.model.panes import TS
from millpond.model.timeutil import US, iso, parse_duration, to_us

ANOMALY_SCHEMA = pa.schema([("key", pa.string()), ("second", TS), ("kind", pa.string()), ("count", pa.int64()),
                            ("expected", pa.float64()), ("batch", pa.int64())])
TAG = "bucket"


class Zeitgeist(Computation):
    """Per-query spike (on arrival) and dip (low-watermark timer) detection against an EWMA model."""

    output_streams = {"anomalies": ANOMALY_SCHEMA}

    def __init__(self, k: float = 4.0, alpha: float = 0.05, warmup: int = 30, idle: str | int = "2m",
                 min_spike: int = 10, bucket: str | int = "1s", clamp: float = 2.0, input: str = "searches") -> None:
        if input not in ("searches", "counts"):
            raise ValueError("zeitgeist: input is searches (one record per search) or counts (a record's value "
                             "is a number of searches in its second: a per-second counter's panes)")
        #: what a record weighs: one search, or its value (the paper's window counter upstream)
        self.weighs_value = input == "counts"
        self.k = float(k)
        self.clamp = float(clamp)
        self.alpha = float(alpha)
        self.warmup = int(warmup)
        self.bucket = parse_duration(bucket)
        self.idle = max(1, parse_duration(idle) // self.bucket)  # in buckets
        self.min_spike = int(min_spike)
        if self.bucket <= 0 or not 0 < self.alpha <= 1 or self.k <= 0:
            raise ValueError("zeitgeist: bucket > 0, 0 < alpha <= 1 and k > 0 please")

    # the model ----------------------------------------------------------------------------------
    def _bounds(self, st: dict[str, Any]) -> tuple[float, float, float] | None:
        """(expected, low, high), or None while the model is still warming up."""
        m = st.get("model")
        if not m or m["n"] < self.warmup:
            return None
        std = max(math.sqrt(m["var"]), math.sqrt(max(m["mean"], 1.0)))
        return m["mean"], m["mean"] - self.k * std, m["mean"] + self.k * std

    def _learn(self, st: dict[str, Any], count: int) -> None:
        bounds = self._bounds(st)
        x, outlier = float(count), bounds is not None and not bounds[1] <= count <= bounds[2]
        if outlier:  # Huber-style: an anomaly moves the mean by at most ``clamp`` std, not the variance
            spread = self.clamp * (bounds[2] - bounds[0]) / self.k
            x = min(max(x, bounds[0] - spread), bounds[0] + spread)
        m = st.setdefault("model", {"mean": 0.0, "var": 0.0, "n": 0})
        m["n"] += 1
        a = max(self.alpha, 1.0 / m["n"])  # a plain average while warming up, then exponential
        diff = x - m["mean"]
        m["mean"] += a * diff
        if not outlier:
            m["var"] = (1 - a) * (m["var"] + diff * a * diff)

    # the hooks ----------------------------------------------------------------------------------
    def process_record(self, ctx: Context, record: Record) -> None:
        st = ctx.state
        b = record.event_time // self.bucket
        if "final" in st and b < st["final"]:
            st["dropped"] = st.get("dropped", 0) + 1  # its bucket was already judged
            return
        counts = st.setdefault("counts", {})
        c = counts[str(b)] = counts.get(str(b), 0) + (int(record.value) if self.weighs_value else 1)
        st["last_seen"] = max(st.get("last_seen", b), b)
        if ctx.timer(TAG) is None:  # idle or new: the chain starts at this bucket
            st["final"] = b
            ctx.set_event_timer(TAG, (b + 1) * self.bucket)
        bounds = self._bounds(st)
        spiked = st.setdefault("spiked", [])
        if bounds and c > bounds[2] and c >= self.min_spike and b not in spiked:
            spiked.append(b)
            ctx.produce("anomalies", {"key": ctx.key, "second": b * self.bucket, "kind": "spike", "count": c,
                                      "expected": round(bounds[0], 6)})

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        st = ctx.state
        b = timer.at // self.bucket - 1  # the bucket that just became complete
        c = st.get("counts", {}).pop(str(b), 0)
        bounds = self._bounds(st)
        if bounds and c < bounds[1]:
            ctx.produce("anomalies", {"key": ctx.key, "second": b * self.bucket, "kind": "dip", "count": c,
                                      "expected": round(bounds[0], 6)})
        self._learn(st, c)
        st["spiked"] = [s for s in st.get("spiked", []) if s > b]
        st["final"] = b + 1
        if b + 1 - st.get("last_seen", b) <= self.idle:
            ctx.set_event_timer(TAG, (b + 2) * self.bucket)


# -- generators: tests and the demo ------------------------------------------------------------------
def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's method in slices of at most 30 (no underflow for large rates)."""
    n = 0
    while lam > 0:
        part = min(lam, 30.0)
        lam -= part
        limit, p = math.exp(-part), rng.random()
        while p > limit:
            n += 1
            p *= rng.random()
    return n


def _rng(*parts: object) -> random.Random:
    seed = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(seed[:8], "big"))


def second_events(query: str, second_us: int, rate: float, *, seed: object = 0, max_delay: int = 3 * US,
                  prefix: str = "zq") -> list[dict[str, Any]]:
    """One query's searches in one second: a Poisson count, uniform in the second, each arriving up to
    ``max_delay`` later. Depends only on its arguments, so any interval regenerates the same events."""
    rng = _rng(seed, query, second_us)
    out = []
    for i in range(_poisson(rng, rate)):
        et = second_us + int(rng.random() * US)
        out.append({"id": f"{prefix}-{query}-{second_us // US}-{i}", "key": query, "value": 1,
                    "event_time": iso(et), "arrival_time": iso(et + int(rng.random() * max_delay))})
    return out


def query_stream(start: int, seconds: int, rates: dict[str, float], *,
                 spikes: dict[tuple[str, int], float] | None = None, dips: set[tuple[str, int]] | None = None,
                 seed: object = 0, max_delay: int = 3 * US) -> list[dict[str, Any]]:
    """Search events for ``seconds`` seconds from ``start`` (µs): per query a steady Poisson rate, times a
    factor at the injected spike seconds ``{(query, second offset): factor}``, and no traffic at all at
    the injected dip seconds ``{(query, second offset)}``. Sorted by arrival."""
    spikes, dips = spikes or {}, dips or set()
    out: list[dict[str, Any]] = []
    for s in range(seconds):
        for q, rate in sorted(rates.items()):
            if (q, s) in dips:
                continue
            out += second_events(q, start + s * US, rate * spikes.get((q, s), 1.0), seed=seed, max_delay=max_delay)
    return sorted(out, key=lambda e: (e["arrival_time"], e["id"]))


def demo_events(name: str, cfg: dict[str, Any], start: int, end: int) -> list[dict[str, Any]]:
    """The demo's searches arriving in [start, end): ``queries`` queries with steady rates between
    ``min_rate`` and ``max_rate`` per second, and in some minutes (a hash of query and minute) a spike
    (3 s at 5x) or a dip (5 s of silence) at a fixed offset."""
    n = int(cfg.get("queries", 8))
    lo, hi = float(cfg.get("min_rate", 4)), float(cfg.get("max_rate", 30))
    max_delay = parse_duration(cfg.get("max_delay", "3s"))
    out: list[dict[str, Any]] = []
    first = (start - max_delay) // US - 1
    for sec in range(first, (end + US - 1) // US):
        minute, offset = divmod(sec, 60)
        for q in range(n):
            query = f"query{q:03d}"
            rate = lo + (hi - lo) * _rng(name, query).random()
            event = _rng(name, query, minute).random()
            if event < 0.10 and 20 <= offset < 23:
                rate *= 5.0
            elif event > 0.92 and 30 <= offset < 35:
                continue
            out += [e for e in second_events(query, sec * US, rate, seed=name, max_delay=max_delay, prefix=name)
                    if start <= to_us(e["arrival_time"]) < end]
    return sorted(out, key=lambda e: (e["arrival_time"], e["id"]))

