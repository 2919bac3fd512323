"""The three expectation suites, and the checks GX cannot express on its own (pandas; Spark alike).

The committed JSON under ``expectations/`` is what runs and what reviewers read; these definitions
create it when it is missing and a test keeps the two from drifting apart. The same suites run on
pandas frames (local engine) and on Spark DataFrames (Spark engine): where an expectation names
engine types, it lists both engines' names.

Checks that need more than one row at a time (a retraction must match the value emitted before it;
live sessions of a key must not overlap) are computed into ``chk_*`` columns — here with pandas, in
:mod:`millpond.quality.spark_checks` with Spark's functions — then asserted by ordinary GX
expectations: they land in the same validation result, Data Docs page and severity handling as every
other expectation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

CRITICAL = "critical"
WARNING = "warning"

RAW = "millpond_raw_input"
PANES = "millpond_panes"
STATE = "millpond_state"
#: a MillWheel computation's output stream ``S`` is validated by the suite ``millpond_stream_S`` when one exists
STREAM_PREFIX = "millpond_stream_"
ANOMALIES = STREAM_PREFIX + "anomalies"  # Zeitgeist's (millpond.examples.zeitgeist)
#: a batch's freshness against its pipeline's ``freshness:`` thresholds (one row: ``quality.freshness``)
FRESHNESS = "millpond_freshness"
SUITES = (RAW, PANES, STATE, ANOMALIES, FRESHNESS)
FRESHNESS_COLUMNS = ["batch", "processing_time", "watermark", "watermark_lag_s", "since_last_batch_s"]
ANOMALY_COLUMNS = ["key", "second", "kind", "count", "expected", "batch"]

RAW_COLUMNS = ["id", "key", "value", "event_time"]
PANE_COLUMNS = [
    "key", "window_start", "window_end", "value", "pane_index", "timing", "is_last", "kind",
    "batch", "processing_time", "watermark", "seq",
]
STATE_COLUMNS = ["key", "window_start", "window_end", "state", "event_timer", "ptime_timer", "batch"]
PANE_KEY = ["key", "window_start", "window_end", "pane_index", "kind"]

# Numeric type names accepted for an event's value (bool is deliberately absent): Python/numpy/pandas
# names for the pandas engine, pyspark.sql.types names for the Spark engine (GX's Spark check compares
# the column's Spark type; each engine ignores the other's names).
NUMERIC_TYPES = [
    "int", "float", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "Int64", "Float64",
    "ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType", "DecimalType",
]

# Values of the retraction check column.
MATCHED, UNMATCHED, MISMATCH = "matched", "no earlier value", "value differs"


def _e(kind: str, severity: str, why: str, **kwargs: Any) -> dict[str, Any]:
    return {"type": kind, "kwargs": kwargs, "meta": {"severity": severity, "why": why}}


def suite_definitions() -> dict[str, list[dict[str, Any]]]:
    """Expectations per suite: ``{"type", "kwargs", "meta": {"severity", "why"}}``."""
    raw = [
        # One table-level check: GX keeps one expect_column_to_exist per suite (its domain is the table).
        _e("expect_table_columns_to_match_set", CRITICAL, "event contract columns (arrival_time is optional)",
           column_set=RAW_COLUMNS, exact_match=False),
        *[_e("expect_column_values_to_not_be_null", CRITICAL, "needed to deduplicate, group and window", column=c)
          for c in ("id", "key", "event_time")],
        _e("expect_column_values_to_be_in_set", CRITICAL,
           "event_time must be ISO-8601 or epoch seconds (chk_event_time_unparseable is computed by the "
           "frame's engine)",
           column="chk_event_time_unparseable", value_set=[False]),
        _e("expect_column_values_to_be_between", WARNING,
           "plausible event time: not before 1970, at most the tolerance (default 1 day) after the batch's "
           "processing time (event_time_epoch_s is computed by the frame's engine)",
           column="event_time_epoch_s", min_value=0.0, max_value={"$PARAMETER": "max_event_epoch_s"}),
        _e("expect_column_values_to_not_be_null", CRITICAL, "aggregations need a value", column="value"),
        _e("expect_column_values_to_be_in_type_list", CRITICAL, "value must be numeric",
           column="value", type_list=NUMERIC_TYPES),
        _e("expect_column_values_to_be_between", WARNING,
           "an id delivered more than once: the engine keeps its first delivery; many copies point at a retrying "
           "producer (chk_id_copies: how many times the batch's input held the id, plus one where an earlier "
           "batch accepted it; the engine's dedup counts them)",
           column="chk_id_copies", min_value=1.0, max_value=1.0),
    ]
    panes = [
        _e("expect_table_columns_to_match_set", CRITICAL, "panes table contract",
           column_set=PANE_COLUMNS, exact_match=False),
        *[_e("expect_column_values_to_not_be_null", CRITICAL, "every pane names its key and window", column=c)
          for c in ("key", "window_start", "window_end", "kind")],
        _e("expect_compound_columns_to_be_unique", CRITICAL, "a pane is emitted once", column_list=PANE_KEY),
        _e("expect_column_pair_values_a_to_be_greater_than_b", CRITICAL, "windows are non-empty intervals",
           column_A="window_end", column_B="window_start", or_equal=False),
        _e("expect_column_values_to_be_in_set", CRITICAL, "pane timing", column="timing",
           value_set=["EARLY", "ON_TIME", "LATE"]),
        _e("expect_column_values_to_be_in_set", CRITICAL, "pane kind", column="kind",
           value_set=["value", "retraction"]),
        _e("expect_column_values_to_be_between", CRITICAL, "pane indices count from 0",
           column="pane_index", min_value=0.0),
        _e("expect_column_values_to_be_in_set", CRITICAL,
           "a retraction retracts the last value emitted for its window (chk_retraction is computed by the "
           "frame's engine over the pane log)",
           column="chk_retraction", value_set=[MATCHED]),
        _e("expect_column_values_to_not_be_in_set", WARNING,
           "most panes late: the watermark is probably too aggressive", column="timing",
           value_set=["LATE"], mostly=0.5),
    ]
    state = [
        _e("expect_table_columns_to_match_set", CRITICAL, "windows table contract",
           column_set=STATE_COLUMNS, exact_match=False),
        *[_e("expect_column_values_to_not_be_null", CRITICAL, "live windows are keyed", column=c)
          for c in ("key", "window_start", "window_end")],
        _e("expect_compound_columns_to_be_unique", CRITICAL, "one state row per live window",
           column_list=["key", "window_start", "window_end"]),
        _e("expect_column_pair_values_a_to_be_greater_than_b", CRITICAL, "windows are non-empty intervals",
           column_A="window_end", column_B="window_start", or_equal=False),
        _e("expect_column_values_to_be_in_set", CRITICAL,
           "live sessions of one key never overlap: they must have been merged (chk_overlaps_earlier is "
           "computed by the frame's engine)",
           column="chk_overlaps_earlier", value_set=[False]),
        _e("expect_column_values_to_be_json_parseable", CRITICAL, "state is serialized as JSON", column="state"),
        _e("expect_column_values_to_not_be_null", WARNING,
           "a window without an event-time timer is only closed by a processing-time timer", column="event_timer"),
    ]
    anomalies = [
        _e("expect_table_columns_to_match_set", CRITICAL, "anomalies stream contract", column_set=ANOMALY_COLUMNS,
           exact_match=False),
        *[_e("expect_column_values_to_not_be_null", CRITICAL, "every anomaly names its query, second and kind",
             column=c) for c in ("key", "second", "kind")],
        _e("expect_column_values_to_be_in_set", CRITICAL, "anomaly kind", column="kind", value_set=["spike", "dip"]),
        _e("expect_compound_columns_to_be_unique", CRITICAL, "an anomaly of a second is reported once",
           column_list=["key", "second", "kind"]),
        _e("expect_column_values_to_be_between", CRITICAL, "a second's count of searches", column="count",
           min_value=0.0),
        _e("expect_column_values_to_be_between", WARNING, "the model's expected rate", column="expected",
           min_value=0.0),
    ]
    freshness = [
        _e("expect_table_columns_to_match_set", CRITICAL, "freshness row contract", column_set=FRESHNESS_COLUMNS,
           exact_match=False),
        _e("expect_column_values_to_be_between", WARNING,
           "freshness.watermark_lag: the batch's processing time minus its watermark, in seconds (null: not "
           "declared)", column="watermark_lag_s", max_value={"$PARAMETER": "max_watermark_lag_s"}),
        _e("expect_column_values_to_be_between", WARNING,
           "freshness.last_batch: the batch's processing time minus the previous batch's, in seconds (null: not "
           "declared, or the first batch)", column="since_last_batch_s", max_value={"$PARAMETER": "max_last_batch_s"}),
    ]
    return {RAW: raw, PANES: panes, STATE: state, ANOMALIES: anomalies, FRESHNESS: freshness}


# -- pandas checks ---------------------------------------------------------------------------------
def _parse_times(col: pd.Series) -> pd.Series:
    """event_time as UTC timestamps: ISO strings, epoch seconds or datetimes; NaT if unparseable."""
    if pd.api.types.is_datetime64_any_dtype(col):
        return pd.to_datetime(col, utc=True)
    if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
        return pd.to_datetime(col, unit="s", utc=True, errors="coerce")
    out = pd.Series(pd.NaT, index=col.index, dtype="datetime64[ns, UTC]")
    is_num = col.map(lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_)))
    nums = pd.to_numeric(col[is_num], errors="coerce")
    if len(nums):
        out[is_num] = pd.to_datetime(nums, unit="s", utc=True, errors="coerce")
    others = ~is_num & col.notna()
    if others.any():
        text = col[others].map(lambda v: v if isinstance(v, (str, datetime, pd.Timestamp)) else None)
        out[others] = pd.to_datetime(text, utc=True, format="ISO8601", errors="coerce")
    return out


#: the raw frame's count of deliveries per id (one row per id: ``runtime.steps.dedup.Deduped.delivered``)
COPIES = "chk_id_copies"


def prepare_raw(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``chk_event_time_unparseable`` and ``event_time_epoch_s`` (NaN when not parseable), and, for a frame
    that does not bring its ids' deliveries (a batch's does), ``chk_id_copies``: the rows of its own id."""
    out = df.copy()
    if COPIES not in out.columns and "id" in out.columns:
        out[COPIES] = out.groupby("id", dropna=True)["id"].transform("size")
    if "event_time" not in out.columns:
        return out
    parsed = _parse_times(out["event_time"])
    out["chk_event_time_unparseable"] = out["event_time"].notna() & parsed.isna()
    epoch = pd.Timestamp("1970-01-01", tz="UTC")
    out["event_time_epoch_s"] = (parsed - epoch).dt.total_seconds()
    return out


def _emission_order(df: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in ("batch", "seq") if c in df.columns]
    return df.sort_values(cols, kind="stable") if cols else df


def retraction_check(panes: pd.DataFrame, prior: pd.DataFrame | None) -> pd.Series:
    """Per pane: MATCHED/UNMATCHED/MISMATCH for retractions, None for values.

    Replays the pane log in emission order (batch, seq): a retraction must carry the last value
    emitted for its (key, window) that is not yet retracted (either sign is accepted). Without
    ``prior`` panes, retractions of windows first emitted in an earlier batch cannot be judged and
    are left as None (not counted), so the check never guesses.
    """
    result = pd.Series([None] * len(panes), index=panes.index, dtype="object")
    needed = {"key", "window_start", "window_end", "kind", "value"}
    if not needed <= set(panes.columns) or panes.empty:
        return result
    outstanding: dict[tuple, Any] = {}
    if prior is not None and not prior.empty:
        # Only windows this batch retracts matter: keeps the replay small however long the log is.
        wins = ["key", "window_start", "window_end"]
        retracted = panes.loc[panes["kind"] == "retraction", wins].drop_duplicates()
        prior = prior.merge(retracted, on=wins, how="inner") if len(retracted) else prior.iloc[0:0]
        for row in _emission_order(prior).itertuples(index=False):
            w = (row.key, row.window_start, row.window_end)
            if row.kind == "value":
                outstanding[w] = row.value
            elif row.kind == "retraction":
                outstanding.pop(w, None)
    current = _emission_order(panes)
    verifiable = prior is not None
    for idx, row in zip(current.index, current.itertuples(index=False), strict=True):
        w = (row.key, row.window_start, row.window_end)
        if row.kind == "value":
            outstanding[w] = row.value
        elif row.kind == "retraction":
            if w not in outstanding:
                result[idx] = UNMATCHED if verifiable else None
                continue
            last = outstanding.pop(w)
            same = _num_eq(row.value, last) or _num_eq(row.value, -last if last is not None else None)
            result[idx] = MATCHED if same else MISMATCH
    return result


def _num_eq(a: Any, b: Any) -> bool:
    try:
        return a is not None and b is not None and bool(np.isclose(float(a), float(b), rtol=1e-9, atol=1e-12))
    except (TypeError, ValueError):
        return a == b


def prepare_panes(df: pd.DataFrame, prior: pd.DataFrame | None) -> pd.DataFrame:
    out = df.copy()
    out["chk_retraction"] = retraction_check(out, prior)
    return out


def overlaps_earlier(state: pd.DataFrame, window_type: str | None) -> pd.Series:
    """True where a live window starts before an earlier-starting window of the same key ends.

    Sliding (and custom) windows overlap by design: for them the column is all False.
    """
    flags = pd.Series(False, index=state.index)
    if window_type in ("sliding", "custom") or state.empty:
        return flags
    if not {"key", "window_start", "window_end"} <= set(state.columns):
        return flags
    ordered = state.sort_values(["key", "window_start", "window_end"], kind="stable")
    reach = ordered.groupby("key", sort=False)["window_end"].transform(lambda s: s.cummax().shift(1))
    overlap = reach.notna() & (ordered["window_start"] < reach)
    flags.loc[ordered.index] = overlap.to_numpy(dtype=bool)
    return flags


def prepare_state(df: pd.DataFrame, window_type: str | None) -> pd.DataFrame:
    out = df.copy()
    out["chk_overlaps_earlier"] = overlaps_earlier(out, window_type)
    return out


PREPARERS: dict[str, Callable[..., pd.DataFrame]] = {RAW: prepare_raw, PANES: prepare_panes, STATE: prepare_state}


def canonical(expectations: list[dict[str, Any]]) -> str:
    """A stable text form used to compare committed suites with these definitions."""
    return json.dumps(sorted(json.dumps(e, sort_keys=True, default=str) for e in expectations), indent=1)
