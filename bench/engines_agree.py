"""Same tables whatever the engine (issue 36): the Figure 14 scenario and the sessions workload run on the
local engine (in this process) and on the Spark engine (a Connect client of the bench's server, as a DAG task
is), in both of its strategies (the multi-stage plan and one task), and every table is compared row for row:
panes, current, windows, late, seen_ids, quarantine and the markers (apart from timings, the table versions
they name and the engine that ran). The record counts the tables that differ (target 0): a check in the
bench's output, beside the tests' (``tests/test_cores.py``, ``tests/engines.py``)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
from millpond.config.pipelines import load_pipeline
from millpond.lake.tables import Tables
from millpond.model.spec import pipeline_from_dict
from millpond.model.timeutil import MAX_TS, to_datetime
from millpond.runtime.job import run_batch
from millpond.surface.replay import land_events, read_events

#: the tables compared, and the marker columns that may differ (timings, versions, who ran it)
COMPARED = ("panes", "current", "windows", "late", "seen_ids", "quarantine", "batches")
FREE = ("phases", "versions", "engine", "strategy")
SCENARIOS = Path(__file__).resolve().parents[1] / "tests" / "scenarios"
#: the Spark engine's strategies, as ``engine.one_task_below`` forces them
STRATEGIES = {"plan": 0, "one-task": 10**12}


def table_rows(tables: Tables, pipeline: str) -> dict[str, list[str]]:
    """Each compared table's rows, sorted, with the pipeline's name taken out (ids of a stage name it)."""
    out = {}
    for table in COMPARED:
        t = tables.read_arrow(pipeline, table, schema=pa.schema([])) if tables.exists(pipeline, table) else None
        if t is None:
            out[table] = []
            continue
        t = t.drop([c for c in FREE if c in t.column_names])
        out[table] = sorted(repr(sorted(r.items())).replace(pipeline, "P") for r in t.to_pylist())
    return out


class EnginesAgreeMeasures:
    """Measure methods of ``bench.harness.Bench`` (mixed in)."""

    def _differing(self, local: str, others: dict[str, str]) -> dict[str, list[str]]:
        tables = Tables(self.settings)
        base = table_rows(tables, local)
        return {label: [t for t in COMPARED if table_rows(tables, name)[t] != base[t]]
                for label, name in others.items()}

    def _fig14(self) -> tuple[str, dict[str, tuple[dict, list]]]:
        """The Figure 14 scenario, landed once per pipeline; run batch by batch here on the local engine. The
        local pipeline's name, and each Spark strategy's document and steps (run by ``_on_spark``)."""
        spec = load_pipeline(SCENARIOS / "fig14_sessions_retracting.yaml")
        events = read_events(SCENARIOS / "fig14_sessions_retracting.jsonl")
        name, spark = "", {}
        for label in ("local", *STRATEGIES):
            doc = {**spec.raw, "name": f"bench_fig14_{label.replace('-', '_')}_{uuid.uuid4().hex[:6]}"}
            doc["source"] = {"prefix": f"{doc['name']}/"}
            steps = land_events(self.settings, pipeline_from_dict(doc), events)
            if label == "local":
                local = self.settings.with_overrides(engine="local")
                for p, w in steps:
                    run_batch(local, pipeline_from_dict(doc), to_datetime(p),
                              watermark=None if w is None else to_datetime(w))
                name = doc["name"]
            else:
                spark[label] = (doc, [[p, w] for p, w in steps])
        return name, spark

    def _sessions(self, n: int) -> tuple[str, dict[str, tuple[dict, list]]]:
        """The sessions workload in 3 batches and a flush: run here on the local engine; the Spark strategies'
        documents and steps."""
        wl = self.workload(n, self.plan.keys(n), batches=3, seed=31)
        local = self.pipeline("sessions", wl)
        self.run_ours(local, wl, "driver", flush=True)
        spark = {}
        for label in STRATEGIES:
            doc = self._doc("sessions", wl)
            steps = [s[1:] for s in self._steps(wl, list(range(wl.spec.batches)))]
            steps.append([wl.spec.start_us + (wl.spec.batches + 1) * wl.spec.interval_us, MAX_TS])
            spark[label] = (doc, steps)
        return local.name, spark

    def _on_spark(self, scenarios: list[dict[str, tuple[dict, list]]]) -> list[dict[str, str]]:
        """Each Spark strategy runs every scenario's pipeline in one Connect client (as a DAG task runs its
        batches); the pipelines' names by strategy, per scenario."""
        for label, below in STRATEGIES.items():
            docs = [s[label][0] for s in scenarios]
            steps = [[i, *step] for i, s in enumerate(scenarios) for step in s[label][1]]
            self.client({"mode": "batches", "pipelines": docs, "steps": steps,
                         "overrides": {"engine_one_task_below": below}})
        return [{label: s[label][0]["name"] for label in STRATEGIES} for s in scenarios]

    def measure_engines_agree(self) -> None:
        n = self.plan.engines_agree_events
        if not n:
            return
        fig14 = self.plan.engines_agree_fig14
        self.log(f"engines agree: {'Figure 14 and ' if fig14 else ''}{n} sessions events in 3 batches + a flush, "
                 "on the local engine and on both Spark strategies")
        found: dict[str, Any] = {}
        scenarios = ({"fig14": self._fig14()} if fig14 else {}) | {f"sessions_{n}": self._sessions(n)}
        on_spark = self._on_spark([spark for _, spark in scenarios.values()])
        for (scenario, (local, _)), others in zip(scenarios.items(), on_spark, strict=True):
            found[scenario] = {"pipelines": {"local": local, **others}, "differing": self._differing(local, others)}
            self.log(f"  {scenario}: {found[scenario]['differing']}")
        differing = sum(len(t) for s in found.values() for t in s["differing"].values())
        self.record("tables_identical_across_engines", differing, None, None, "tables differing", True,
                    engine="spark (both strategies) vs local", path=["spark", "driver"], compared=list(COMPARED),
                    scenarios=found, events=n,
                    notes="Figure 14 and the sessions workload on the local engine, the Spark engine's multi-stage "
                          "plan and its one-task form; every table compared row for row (markers apart from "
                          "timings, table versions and the engine's name)")
        self.measures["engines_agree"] = found

