"""The Spark engine's per-key step: elements and state rows hashed by key into partitions over a Spark
session (a Connect client or a local session), each partition laid out and run as the local engine does."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from millpond.lake.schemas import value_arrow_type
from millpond.model.clock import BatchClock
from millpond.runtime.assembly import Assembly, process_group, strategy_of
from millpond.runtime.layout import CHUNK_ELEMENTS, EVENT_COLUMNS, KeyLayout, chunks_of


def run_on_spark(spark, spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, value_type: str,
                 sink: Assembly, columnar: bool = True) -> None:
    """The per-key step on Spark: elements and state rows hashed by key into partitions, each partition
    processed by one Python call (``mapInArrow``) that lays it out as the driver path does (``KeyLayout``)
    and runs ``process_group`` key by key."""
    vtype = value_arrow_type(value_type)
    n_ev, n_st = events.num_rows, state.num_rows
    schema = pa.schema([("key", pa.string()), ("id", pa.string()), ("value", vtype), ("event_time", pa.int64()),
                        ("arrival_time", pa.int64()), ("window_start", pa.int64()), ("window_end", pa.int64()),
                        ("state", pa.string())])
    combined = pa.concat_tables([
        pa.table([events.column(c) for c in ("key", "id", "value", "event_time", "arrival_time")]
                 + [pa.nulls(n_ev, f.type) for f in schema][5:], schema=schema),
        pa.table([state.column("key").cast(pa.string())] + [pa.nulls(n_st, f.type) for f in schema][1:5]
                 + [state.column("window_start").cast(pa.int64()), state.column("window_end").cast(pa.int64()),
                    state.column("state").cast(pa.string())], schema=schema),
    ])
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))

    def run(batches):
        batches = list(batches)
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        is_state = table.column("state").is_valid()
        layout = KeyLayout.of(table.filter(pc.invert(is_state)).select(list(EVENT_COLUMNS)), table.filter(is_state))
        strategy = strategy_of(spec_json)
        out: list[tuple] = []
        for lo, hi in layout.chunks():  # the driver path's layout: windows formed on columns where it can
            for key, els, groups, sts in layout.rows(lo, hi, strategy, clock, columnar):
                out += process_group(spec_json, clock, key, els, sts, groups)
        yield pa.RecordBatch.from_arrays(
            [pa.array([r[0] for r in out], pa.string()), pa.array([r[1] for r in out], pa.string()),
             pa.array([r[2] for r in out], pa.string())], names=["rtype", "key", "payload"])

    result = (spark.createDataFrame(combined).repartition(partitions, "key")
              .mapInArrow(run, "rtype string, key string, payload string").toArrow())
    del combined
    n = result.num_rows
    if not n:
        return
    # Stable: a key's rows keep the order it emitted them in.
    result = result.take(pc.sort_indices(result.column("key")))
    keys = result.column("key")
    change = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(change) + 1, [n]]).astype(np.int64)
    for lo, hi in chunks_of(starts, CHUNK_ELEMENTS):
        part = result.slice(starts[lo], starts[hi] - starts[lo])
        sink.add([(r, k, json.loads(p)) for r, k, p in zip(part.column("rtype").to_pylist(),
                                                           part.column("key").to_pylist(),
                                                           part.column("payload").to_pylist(), strict=True)])



class SparkEngine:
    """The per-key step on Spark (``mapInArrow`` by key)."""

    name = "spark"

    def __init__(self, spark, value_type: str, columnar: bool = True) -> None:
        self.spark, self.value_type, self.columnar = spark, value_type, columnar

    def run(self, spec_json: str, clock: BatchClock, events: pa.Table, state: pa.Table, sink: Assembly) -> None:
        run_on_spark(self.spark, spec_json, clock, events, state, self.value_type, sink, self.columnar)
