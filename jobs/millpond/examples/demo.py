"""Deterministic demo data for the shipped pipelines: what `make run` lands before each batch.

Events for an interval depend only on (pipeline, interval start), so a backfill lands exactly what
a live run would have, and re-landing an interval rewrites the same file (same key, same bytes).
"""

from __future__ import annotations

import hashlib
import json
import random
from datetime import datetime

from millpond.config import Settings
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.spec import PipelineSpec
from millpond.model.timeutil import US, iso, to_us


def _rng(*parts: object) -> random.Random:
    seed = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(seed[:8], "big"))


def demo_events(spec: PipelineSpec, start: int, end: int) -> list[dict]:
    """Events arriving in [start, end): bounded disorder, a tail of late events, some duplicates."""
    cfg = spec.demo or {}
    if cfg.get("generator") == "zeitgeist":  # per-second search traffic with spikes and dips
        from millpond.examples.zeitgeist import demo_events as zeitgeist_events

        return zeitgeist_events(spec.name, cfg, start, end)
    rng = _rng(spec.name, start, end)
    n = int(cfg.get("events_per_batch", 200))
    keys = int(cfg.get("keys", 20))
    late = float(cfg.get("late_fraction", 0.02))
    dup = float(cfg.get("duplicate_fraction", 0.01))
    zipf = cfg.get("generator") == "zipf"
    weights = [1 / (i + 1) for i in range(keys)] if zipf else None
    out: list[dict] = []
    for i in range(n):
        arrival = start + int(rng.random() * (end - start))
        delay = int(rng.expovariate(1 / 30) * US)  # mean 30 s behind
        if rng.random() < late:
            delay += int(rng.uniform(10, 60) * 60 * US)  # minutes late: behind the watermark
        k = rng.choices(range(keys), weights)[0] if weights else rng.randrange(keys)
        prefix = "q" if zipf else "user"
        value = 1 if zipf else rng.randint(5, 120)
        out.append({"id": f"{spec.name}-{start}-{i}", "key": f"{prefix}{k:04d}", "value": value,
                    "event_time": iso(arrival - delay), "arrival_time": iso(arrival)})
        if rng.random() < dup:
            out.append(dict(out[-1]))  # an injector retry: same id, delivered twice
    return out


def land_demo_events(settings: Settings, spec: PipelineSpec, start: datetime, end: datetime) -> int:
    """Write the interval's demo events as one JSONL file in the landing bucket; return the count."""
    s, e = to_us(start), to_us(end)
    events = demo_events(spec, s, e)
    body = "".join(json.dumps(ev, sort_keys=True) + "\n" for ev in events).encode()
    ObjectStore(settings).put_bytes(settings.bucket_landing, f"{spec.source_prefix}{arrival_tag(s)}-demo.jsonl", body)
    return len(events)
