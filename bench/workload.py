"""Synthetic event streams for the benchmarks: Zipf keys, bounded disorder, a late tail, duplicates.

Vectorised with numpy/pyarrow so that generating 10M events costs seconds, not the benchmark's
budget. The same workload is landed in the store (as an injector would: several JSONL files per
batch, each tagged ``arrival=``) and written to local JSONL for the peers, so every system sees
byte-identical input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.model.timeutil import US

#: 2026-01-01T00:00:00Z: batch-aligned for any interval dividing a day
DEFAULT_START = 1767225600 * US


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Arrivals are uniform over ``batches`` intervals of ``interval_us``."""

    events: int
    keys: int
    batches: int = 1
    interval_us: int = 300 * US
    start_us: int = DEFAULT_START
    zipf_s: float = 1.0
    #: mean delay of event time behind arrival (exponential), capped at ``disorder_bound_s``
    mean_delay_s: float = 30.0
    disorder_bound_s: float = 120.0
    #: share of events that arrive far behind (uniform in [bound, late_max_s]): the late tail
    late_fraction: float = 0.02
    late_max_s: float = 3600.0
    #: share of events delivered twice (same id; an injector retry up to a minute later)
    duplicate_fraction: float = 0.01
    files_per_batch: int = 4
    seed: int = 7

    def describe(self) -> dict:
        return asdict(self)


def zipf_ranks(rng: np.random.Generator, n: int, keys: int, s: float) -> np.ndarray:
    """``n`` draws of ranks 0..keys-1 with P(rank r) proportional to 1/(r+1)^s (bounded Zipf)."""
    weights = 1.0 / np.power(np.arange(1, keys + 1, dtype=np.float64), s)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), keys - 1)


def generate(spec: WorkloadSpec) -> pa.Table:
    """Events sorted by arrival: id, key, value, event_time (us), arrival_time (us), batch (0-based)."""
    rng = np.random.default_rng(spec.seed)
    n = spec.events
    span = spec.batches * spec.interval_us
    arrival = spec.start_us + np.sort(rng.integers(0, span, n, dtype=np.int64))
    delay = np.minimum(rng.exponential(spec.mean_delay_s, n), spec.disorder_bound_s)
    late = rng.random(n) < spec.late_fraction
    delay[late] = rng.uniform(spec.disorder_bound_s, spec.late_max_s, int(late.sum()))
    event_time = arrival - (delay * US).astype(np.int64)
    ranks = zipf_ranks(rng, n, spec.keys, spec.zipf_s)
    values = rng.integers(1, 121, n, dtype=np.int64)
    ids = np.arange(n, dtype=np.int64)
    ndup = int(n * spec.duplicate_fraction)
    if ndup:
        src = rng.choice(n, ndup, replace=False)
        retry = arrival[src] + rng.integers(0, 60 * US, ndup, dtype=np.int64)
        retry = np.minimum(retry, spec.start_us + span - 1)
        arrival = np.concatenate([arrival, retry])
        event_time = np.concatenate([event_time, event_time[src]])
        ranks = np.concatenate([ranks, ranks[src]])
        values = np.concatenate([values, values[src]])
        ids = np.concatenate([ids, ids[src]])
        order = np.argsort(arrival, kind="stable")
        arrival, event_time, ranks, values, ids = (a[order] for a in (arrival, event_time, ranks, values, ids))
    id_strings = pc.binary_join_element_wise(f"s{spec.seed}-", pc.cast(pa.array(ids), pa.string()), "")
    key_strings = pc.binary_join_element_wise("u", pc.utf8_lpad(pc.cast(pa.array(ranks), pa.string()), 7, "0"), "")
    return pa.table({
        "id": id_strings,
        "key": key_strings,
        "value": pa.array(values),
        "event_time": pa.array(event_time),
        "arrival_time": pa.array(arrival),
        "batch": pa.array(((arrival - spec.start_us) // spec.interval_us).astype(np.int32)),
    })


def _iso(us: pa.Array) -> pa.Array:
    # a naive timestamp's cast to string is ~30x faster than strftime: "YYYY-MM-DD HH:MM:SS.ffffff"
    text = pc.cast(pc.cast(us, pa.timestamp("us")), pa.string())
    return pc.binary_join_element_wise(pc.replace_substring(text, " ", "T", max_replacements=1), "Z", "")


#: rows formatted per Arrow pass in ``jsonl_bytes`` (bounds its intermediate string columns)
JSONL_SLICE = 500_000


def jsonl_bytes(events: pa.Table) -> bytes:
    """The events as JSONL (the contract's landing format), built column-wise by Arrow."""
    if events.num_rows > JSONL_SLICE:
        return b"".join(_jsonl_bytes(events.slice(lo, JSONL_SLICE)) for lo in range(0, events.num_rows, JSONL_SLICE))
    return _jsonl_bytes(events)


def _jsonl_bytes(events: pa.Table) -> bytes:
    if not events.num_rows:
        return b""
    parts = [
        '{"id": "', events.column("id"), '", "key": "', events.column("key"), '", "value": ',
        pc.cast(events.column("value"), pa.string()), ', "event_time": "', _iso(events.column("event_time")),
        '", "arrival_time": "', _iso(events.column("arrival_time")), '"}\n',
    ]
    lines = pc.binary_join_element_wise(*parts, "")
    arr = lines.combine_chunks() if isinstance(lines, pa.ChunkedArray) else lines
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset: arr.offset + len(arr) + 1]
    return arr.buffers()[2].to_pybytes()[offsets[0]: offsets[-1]]


def batch_files(spec: WorkloadSpec, events: pa.Table, batch: int) -> list[tuple[int, pa.Table]]:
    """(arrival tag, events) of the files an injector would write for one batch interval."""
    part = events.filter(pc.equal(events.column("batch"), batch))
    n = part.num_rows
    if not n:
        return []
    k = max(1, min(spec.files_per_batch, n))
    bounds = np.linspace(0, n, k + 1).astype(int)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            chunk = part.slice(lo, hi - lo)
            out.append((int(chunk.column("arrival_time")[0].as_py()), chunk))
    return out


def land(store: ObjectStore, bucket: str, prefix: str, spec: WorkloadSpec, events: pa.Table,
         batches: list[int] | None = None) -> int:
    """Write the given batches (default all) to the landing bucket; return the number of files."""
    count = 0
    for b in range(spec.batches) if batches is None else batches:
        for j, (arrival, chunk) in enumerate(batch_files(spec, events, b)):
            key = f"{prefix}{arrival_tag(arrival)}-b{b:05d}-{j:02d}.jsonl"
            store.put_bytes(bucket, key, jsonl_bytes(chunk))
            count += 1
    return count


def write_local(spec: WorkloadSpec, events: pa.Table, folder: Path) -> list[Path]:
    """The same files in a local folder, named so lexical order is arrival order (file sources)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in range(spec.batches):
        for j, (_arrival, chunk) in enumerate(batch_files(spec, events, b)):
            path = folder / f"b{b:05d}-{j:02d}.jsonl"
            path.write_bytes(jsonl_bytes(chunk))
            paths.append(path)
    return paths


@dataclass
class Workload:
    label: str
    spec: WorkloadSpec
    prefix: str
    input_events: int
    #: the generated events, only while a peer needs them in memory (see ``events``)
    table: pa.Table | None = field(default=None, repr=False)

    @property
    def events(self) -> pa.Table:
        """The landed events as a table, for the peers that take them from memory (Structured
        Streaming's local copy, Beam); regenerated on first use (generation is deterministic), so a
        10M-event workload is not held through the runs that read the landing files."""
        if self.table is None:
            self.table = generate(self.spec)
        return self.table
