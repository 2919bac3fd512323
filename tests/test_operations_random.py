"""Operations where features meet (issue 37): a seeded generator of operations on an upstream pipeline of
sessions and two stages (hourly totals of it, and totals of those), checked after every step.

The operations: files landed on time, late, re-delivered or poisoned; upstream batches at their scheduled
times, failing after a random commit and retried at the same time, at another time or by the next scheduled
run; stage batches at random times behind their upstreams; reprocesses of the upstream from random points
with late files landed into the past range, whose runs rewind as the DAG task does (once per reprocess), and a
run of the last reprocess done again after later ones committed (it must skip); resets of the stages. After
every step:

- nothing is blocked: every run that no failure was injected into succeeds;
- the upstream's tables at its last marker's versions hold whole batches (each batch's panes as its marker
  counts them) and every accepted id once;
- each stage's ``current`` equals the regrouping of the upstream panes its last plan consumed;
- a change-feed reader written only against delta-rs ``load_cdf`` (no Millpond code), following each
  pipeline's ``panes`` as docs/contracts.md says, sees each pipeline's ``current``.

At the end a reprocess from the start makes the upstream equal to a fresh run over the same files and
schedule, and the stages equal fresh stages over it. ``MILLPOND_OPS_SEEDS`` (comma-separated) and
``MILLPOND_OPS_STEPS`` choose the runs (``make soak`` runs long ones); a failure names its seed and step.
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from millpond.errors import MillpondError
from millpond.lake.catalog import drop_pipeline
from millpond.lake.landing import arrival_tag
from millpond.lake.objectstore import ObjectStore
from millpond.lake.tables import storage_options
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import US, parse_duration, to_datetime, to_us
from millpond.runtime import commits, rewind
from millpond.runtime.job import run_batch

T0 = to_us("2026-04-01T00:00:00Z")
MINUTE = 60 * US
HOUR = 60 * MINUTE
SEEDS = [int(s) for s in os.environ.get("MILLPOND_OPS_SEEDS", "1,2").split(",") if s.strip()]
STEPS = int(os.environ.get("MILLPOND_OPS_STEPS", "60"))
#: the commits a batch makes, any of which a failure may follow
COMMIT_STEPS = ("ingest_log", "quarantine", "seen_ids", "late", "panes", "current", "windows")


def upstream_doc(name: str) -> dict:
    return {"name": name, "source": {"prefix": f"{name}/"}, "value_type": "int", "aggregation": "sum",
            "window": {"type": "sessions", "gap": "2m"}, "accumulation": "accumulating_and_retracting",
            "trigger": "AtWatermark(early=AtCount(2), late=AtCount(1))", "allowed_lateness": "10m",
            "batch_interval": "1m", "watermark": {"policy": "processing_time", "lag": "1m"}}


def stage_doc(name: str, upstream: str, size: str) -> dict:
    source = {"pipeline": upstream, "stream": "panes", "key": "all", "event_time": "window_start"}
    return {"name": name, "source": source,
            "window": {"type": "fixed", "size": size}, "trigger": "AtWatermark(early=AtCount(1), late=AtCount(1))",
            "accumulation": "accumulating", "aggregation": "sum", "allowed_lateness": "1d", "batch_interval": "1m"}


class Injected(MillpondError):
    """The failure a step injects after one of a batch's commits (a crash as the tables see it)."""


# -- a change-feed reader that knows nothing of Millpond (the contract in docs/contracts.md) -------------------
@dataclass
class ChangeFeedReader:
    """Follows one ``panes`` table through delta-rs's change feed alone: in accumulating-and-retracting mode a
    window's value is its value panes minus its retractions; in accumulating mode it is its last value pane.
    An inserted row does what its pane does; a deleted row (a reprocess's RESTORE) undoes it."""

    uri: str
    options: dict
    mode: str
    version: int = -1
    sums: dict = field(default_factory=lambda: defaultdict(int))
    panes: dict = field(default_factory=lambda: defaultdict(dict))

    def follow(self) -> dict[tuple, int]:
        try:
            dt = DeltaTable(self.uri, storage_options=self.options)
        except TableNotFoundError:  # no panes yet
            return {}
        if dt.version() > self.version:
            reader = dt.load_cdf(starting_version=self.version + 1, ending_version=dt.version())
            for r in pa.RecordBatchReader.from_stream(reader).read_all().to_pylist():
                if r["_change_type"] not in ("insert", "delete"):
                    continue
                sign = 1 if r["_change_type"] == "insert" else -1
                window = (r["key"], r["window_start"], r["window_end"])
                if self.mode == "accumulating_and_retracting":
                    self.sums[window] += sign * (r["value"] if r["kind"] == "value" else -r["value"])
                elif r["kind"] == "value":
                    pane = (r["batch"], r["seq"], r["pane_index"], r["processing_time"])
                    if sign > 0:
                        self.panes[window][pane] = r["value"]
                    else:
                        self.panes[window].pop(pane, None)
            self.version = dt.version()
        if self.mode == "accumulating_and_retracting":
            return {w: v for w, v in self.sums.items() if v}
        return {w: p[max(p)] for w, p in self.panes.items() if p}


# -- the world ------------------------------------------------------------------------------------------------
class World:
    def __init__(self, settings, tables, name: str, seed: int, spark=None, up_settings=None) -> None:
        self.settings, self.tables, self.rng = settings, tables, random.Random(seed)
        #: the upstream's batches on the Spark engine (stages run on the local engine: issue 36)
        self.spark, self.up_settings = spark, up_settings or settings
        self.up = pipeline_from_dict(upstream_doc(f"{name}_up"))
        self.s1 = pipeline_from_dict(stage_doc(f"{name}_s1", self.up.name, "10m"))
        self.s2 = pipeline_from_dict(stage_doc(f"{name}_s2", self.s1.name, "1h"))
        self.files: list[tuple[int, str, bytes]] = []  # (arrival, tag, body): landed again for the fresh run
        self.minute = 0  # the upstream's last scheduled batch
        self.stage_minute = {self.s1.name: 0, self.s2.name: 0}
        self.pending: int | None = None  # the upstream batch a failure interrupted (its minute)
        self.ids: list[tuple[str, int]] = []  # (id, event time) landed so far
        self.n = 0
        self.readers: dict[str, ChangeFeedReader] = {}
        self.log: list[str] = []
        self.reprocessed: tuple[str, int] | None = None  # the last reprocess's name and first redone minute

    # operations
    def land(self, arrival: int, late_into_past: bool = False) -> None:
        rnd, rows = self.rng, []
        for _ in range(rnd.randint(1, 6)):
            kind = rnd.random()
            if kind < 0.12 and self.ids:  # a re-delivery
                rid, et = rnd.choice(self.ids)
                rows.append({"id": rid, "key": f"u{rnd.randrange(3)}", "value": rnd.randint(1, 9),
                             "event_time": to_datetime(et).isoformat()})
                continue
            self.n += 1
            rid = f"e{self.n}"
            delay = rnd.choice([rnd.randrange(0, 90), rnd.randrange(0, 90), rnd.randrange(700, 1500)])
            et = arrival - delay * US
            self.ids.append((rid, et))
            rows.append({"id": rid, "key": f"u{rnd.randrange(3)}", "value": rnd.randint(1, 9),
                         "event_time": to_datetime(et).isoformat()})
        lines = [json.dumps(r) for r in rows]
        if rnd.random() < 0.1:
            lines.insert(rnd.randrange(len(lines) + 1), '{"id": "poison", "value": ')
        tag = f"f{len(self.files)}"
        body = ("\n".join(lines) + "\n").encode()
        self.files.append((arrival, tag, body))
        ObjectStore(self.settings).put_bytes(self.settings.bucket_landing,
                                             f"{self.up.source_prefix}{arrival_tag(arrival)}-{tag}.jsonl", body)
        self.log.append(f"land {tag} at minute {(arrival - T0) / MINUTE:.2f}" + (" (into the past)" if late_into_past
                                                                               else ""))

    def run(self, spec, at: int, crash_after: str | None = None):
        on_spark = spec is self.up and self.spark is not None
        settings, spark = (self.up_settings, self.spark) if on_spark else (self.settings, None)
        if crash_after is None:
            return run_batch(settings, spec, to_datetime(at), spark=spark)

        def crash(step: str, batch: int) -> None:
            if step == crash_after:
                raise Injected(f"injected failure after {step}")

        real = commits.crash_point
        commits.crash_point = crash
        try:
            run_batch(settings, spec, to_datetime(at), spark=spark)
        except Injected:
            return None
        finally:
            commits.crash_point = real
        return "no failure"  # the batch made no such commit (nothing to write there)

    def step(self) -> None:
        rnd = self.rng
        choice = rnd.random()
        if self.pending is not None and choice < 0.5:  # the retry: same time, a bit later, or the next run
            how = rnd.choice(["same", "later", "next"])
            at = T0 + self.pending * MINUTE + {"same": 0, "later": rnd.randrange(1, 50) * US, "next": MINUTE}[how]
            self.log.append(f"retry minute {self.pending} ({how})")
            result = self.run(self.up, at)
            assert result.batch and not result.skipped, result.summary()
            assert to_us(result.processing_time) == T0 + self.pending * MINUTE  # the planned clock
            self.pending = None
        elif choice < 0.35:
            self.land(T0 + self.minute * MINUTE + rnd.randrange(1, 59) * US)
        elif choice < 0.6 and self.pending is None:
            self.minute += 1
            crash_after = rnd.choice(COMMIT_STEPS) if rnd.random() < 0.2 else None
            self.log.append(f"up minute {self.minute}" + (f", fails after {crash_after}" if crash_after else ""))
            if self.run(self.up, T0 + self.minute * MINUTE, crash_after) is None:
                self.pending = self.minute
        elif choice < 0.8:
            stage = rnd.choice([self.s1, self.s2])
            upstream_minute = self.minute if stage is self.s1 else self.stage_minute[self.s1.name]
            lo = self.stage_minute[stage.name]
            if upstream_minute > lo:
                at = rnd.randint(lo + 1, upstream_minute)
                crash_after = rnd.choice(COMMIT_STEPS) if rnd.random() < 0.15 else None
                self.log.append(f"{stage.name[-2:]} minute {at}" + (f", fails after {crash_after}" if crash_after
                                                                      else ""))
                if self.run(stage, T0 + at * MINUTE, crash_after) is None:
                    self.log.append(f"{stage.name[-2:]} retry minute {at}")
                    self.run(stage, T0 + at * MINUTE)
                self.stage_minute[stage.name] = at
        elif choice < 0.93 and self.minute >= 3 and self.pending is None:
            start = rnd.randint(0, self.minute - 1)
            self.land(T0 + start * MINUTE + rnd.randrange(1, 59) * US, late_into_past=True)
            self.reprocess(start)
        elif choice < 0.97 and self.reprocessed and self.pending is None:
            self.again()
        elif choice >= 0.97:
            self.log.append("reset both stages")
            for stage in (self.s2, self.s1):
                drop_pipeline(self.settings, stage.name)
                self.stage_minute[stage.name] = 0
                self.readers.pop(stage.name, None)

    def reprocess(self, start: int) -> None:
        """``millpond backfill --reprocess`` from ``start``: the rewind, then the batches to where it was."""
        self.log.append(f"reprocess up from minute {start}")
        name = f"reprocess {len(self.log)}"
        rewind.run(self.settings, self.tables, self.up, T0 + start * MINUTE, by="test", reprocess=name)
        for m in range(max(start, 0) + 1, self.minute + 1):
            # each run as the DAG task does it: the reprocess's rewind (done once: nothing here), then its batch
            rewind.run(self.settings, self.tables, self.up, T0 + (m - 1) * MINUTE, by="test", reprocess=name)
            self.run(self.up, T0 + m * MINUTE)
        if start < self.minute:
            self.reprocessed = (name, start + 1)
            if self.rng.random() < 0.5:
                self.again()

    def again(self) -> None:
        """A run of the last reprocess done again (an Airflow retry, a cleared run) after later runs committed:
        the reprocess's rewind is recorded, so it rewinds nothing and skips."""
        name, first = self.reprocessed
        m = self.rng.randint(first, self.minute)
        self.log.append(f"reprocess run of minute {m} again")
        rewind.run(self.settings, self.tables, self.up, T0 + (m - 1) * MINUTE, by="test", reprocess=name)
        result = self.run(self.up, T0 + m * MINUTE)
        assert result.skipped, result.summary()  # its batch, or a later one, is committed: nothing rewound

    # invariants
    def check(self) -> None:
        up = self.up.name
        if self.pending is None:
            marker = self._marker(up)
            if marker:
                versions = json.loads(marker["versions"])
                panes = self.tables.read_arrow(up, "panes", version=versions["panes"]) if versions.get("panes") \
                    is not None else None
                if panes is not None:  # whole batches: each batch's panes as its marker counts them
                    counted = defaultdict(int)
                    for b in panes.column("batch").to_pylist():
                        counted[b] += 1
                    for m in self.tables.read_arrow(up, "batches").to_pylist():
                        assert counted.get(m["batch"], 0) == m["panes"] + m["retractions"], (m["batch"], counted)
                if versions.get("seen_ids") is not None:
                    ids = self.tables.read_arrow(up, "seen_ids", version=versions["seen_ids"]).column("id")
                    assert len(ids) == len(set(ids.to_pylist())), "an id accepted twice"
            assert self._reader(up, self.up.accumulation).follow() == self._current(up)
        for stage in (self.s1, self.s2):
            if self._marker(stage.name) is None:
                continue
            upstream = stage.upstream.pipelines[0]
            plan = self._last_plan(stage.name)
            consumed = plan.get(f"upstream:{upstream}")
            mode = "accumulating_and_retracting" if upstream == up else "accumulating"
            expected = regroup(self._panes_view(upstream, consumed, mode), stage)
            assert self._current(stage.name, totals=True) == expected, stage.name
            assert self._reader(stage.name, "accumulating").follow() == self._current(stage.name)

    def _marker(self, name: str) -> dict | None:
        if not self.tables.exists(name, "batches"):
            return None
        rows = self.tables.read_arrow(name, "batches").to_pylist()
        return max(rows, key=lambda r: r["batch"]) if rows else None

    def _last_plan(self, name: str) -> dict:
        marker = self._marker(name)
        log = self.tables.read_arrow(name, "ingest_log").to_pylist()
        return json.loads(next(r["versions"] for r in log if r["batch"] == marker["batch"] and r["versions"]))

    def _current(self, name: str, totals: bool = False) -> dict:
        if not self.tables.exists(name, "current"):
            return {}
        rows = self.tables.read_arrow(name, "current").to_pylist()
        if totals:
            return {r["window_start"]: r["value"] for r in rows if r["value"]}
        return {(r["key"], r["window_start"], r["window_end"]): r["value"] for r in rows}

    def _panes_view(self, name: str, version: int | None, mode: str) -> dict[tuple, int]:
        """The upstream's windows as its panes at ``version`` say (as the change-feed reader reduces them)."""
        if version is None:
            return {}
        view: dict = defaultdict(int) if mode == "accumulating_and_retracting" else defaultdict(dict)
        for r in self.tables.read_arrow(name, "panes", version=version).to_pylist():
            window = (r["key"], r["window_start"], r["window_end"])
            if mode == "accumulating_and_retracting":
                view[window] += r["value"] if r["kind"] == "value" else -r["value"]
            elif r["kind"] == "value":
                view[window][(r["batch"], r["seq"])] = r["value"]
        if mode == "accumulating_and_retracting":
            return {w: v for w, v in view.items() if v}
        return {w: p[max(p)] for w, p in view.items() if p}

    def _reader(self, name: str, mode: str) -> ChangeFeedReader:
        if name not in self.readers:
            self.readers[name] = ChangeFeedReader(self.tables.uri(name, "panes"), storage_options(self.settings), mode)
        return self.readers[name]


def regroup(view: dict[tuple, int], stage) -> dict:
    """A stage's totals from scratch: each upstream window's value at its window start's stage window."""
    size = parse_duration(stage.window["size"])
    totals: dict = defaultdict(int)
    for (_key, start, _end), value in view.items():
        at = to_us(start)
        totals[to_datetime(at - at % size)] += value
    return {k: v for k, v in totals.items() if v}


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_keep_every_invariant(settings, tables, pipeline_name, seed) -> None:
    run_world(settings, tables, pipeline_name, seed, STEPS)


def run_world(settings, tables, name: str, seed: int, steps: int, spark=None, up_settings=None) -> None:
    """``steps`` random operations, the invariants after each, then the end's reprocess and fresh run."""
    world = World(settings, tables, name, seed, spark, up_settings)
    step = 0
    try:
        while step < steps:
            world.step()
            world.check()
            step += 1
        # the end: a reprocess from the start takes every file landed into the past as a fresh run does
        while world.pending is not None:
            world.step()
        world.minute = max(world.minute, 2)  # a short run may have landed files only
        world.reprocess(-1)
        for stage in (world.s1, world.s2):
            world.run(stage, T0 + world.minute * MINUTE + 30 * US)
        world.check()
        fresh = World(settings, tables, f"{name}_fresh", seed, spark, up_settings)
        for arrival, tag, body in world.files:
            ObjectStore(settings).put_bytes(settings.bucket_landing,
                                            f"{fresh.up.source_prefix}{arrival_tag(arrival)}-{tag}.jsonl", body)
        for m in range(1, world.minute + 1):
            fresh.run(fresh.up, T0 + m * MINUTE)
        for stage in (fresh.s1, fresh.s2):
            fresh.run(stage, T0 + world.minute * MINUTE + 30 * US)
        assert content(tables, world.up.name) == content(tables, fresh.up.name)
        for a, b in ((world.s1, fresh.s1), (world.s2, fresh.s2)):
            assert world._current(a.name, totals=True) == fresh._current(b.name, totals=True)
    except BaseException as exc:
        trail = "\n".join(world.log[-25:])
        raise AssertionError(f"seed {seed}, step {step} (MILLPOND_OPS_SEEDS={seed} MILLPOND_OPS_STEPS={step + 1} "
                             f"reproduces it): {exc!r}\nlast operations:\n{trail}") from exc


def content(tables, name: str) -> dict[str, list]:
    out = {}
    for t in ("panes", "current", "windows", "late", "quarantine", "seen_ids"):
        rows = tables.read_arrow(name, t).to_pylist() if tables.exists(name, t) else []
        for r in rows:
            if "source_file" in r:
                r["source_file"] = r["source_file"].split("/", 1)[1]
        out[t] = sorted(json.dumps(r, sort_keys=True, default=str) for r in rows)
    out["batches"] = tables.read_arrow(name, "batches").sort_by("batch").select(
        ["batch", "processing_time", "watermark", "input", "accepted", "duplicates", "late", "quarantined", "panes",
         "retractions"]).to_pylist()
    return out


def test_current_keeps_a_merged_session_until_its_retraction_is_emitted(settings, tables, pipeline_name) -> None:
    """Found by the randomised test (seed 1): a session extended by an element that does not fire its trigger
    (AtCount(2) early) owes the retraction of its emitted value until the merged session fires. ``current``
    deleted the old session at once, so it disagreed with the panes (and every change-feed reader) until then.
    Now it keeps the old session's value until the retraction is emitted."""
    doc = upstream_doc(pipeline_name)
    spec = pipeline_from_dict(doc)
    t0 = T0 + 10 * MINUTE
    reader = ChangeFeedReader(tables.uri(pipeline_name, "panes"), storage_options(settings), spec.accumulation)
    store = ObjectStore(settings)

    def batch(n: int, offsets: list[int]) -> dict:
        body = "".join(json.dumps({"id": f"b{n}-{i}", "key": "k", "value": 1 + i,
                                   "event_time": to_datetime(t0 + s * US).isoformat()}) + "\n"
                       for i, s in enumerate(offsets))
        store.put_bytes(settings.bucket_landing, f"{pipeline_name}/{arrival_tag(t0 + n * MINUTE - 5 * US)}-b.jsonl",
                        body.encode())
        run_batch(settings, spec, to_datetime(t0 + n * MINUTE))
        view = {(w[1], w[2]): v for w, v in reader.follow().items()}
        rows = {(r["window_start"], r["window_end"]): r["value"]
                for r in tables.read_arrow(pipeline_name, "current").to_pylist()}
        assert rows == view, n
        return rows

    first = batch(1, [10, 20])  # two elements: the early AtCount(2) fires
    assert list(first.values()) == [3]
    assert batch(2, [100]) == first  # the session grows, nothing fires: its emitted value stands
    last = batch(3, [170])  # fires: the old session's retraction, the merged session's value
    assert list(last.values()) == [3 + 1 + 1] and set(last) != set(first)
