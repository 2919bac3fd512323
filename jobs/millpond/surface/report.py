"""See the streams: per-batch counts, watermark lag, panes by timing and phase times, as PNG + HTML.

Built only from the ``batches`` and ``panes`` tables (``docs/contracts.md``), so it works for any
pipeline and any engine version that honours the contract. The centre-piece is the Dataflow paper's
diagram for one key: event time across, processing time up, the watermark as a curve, and every pane
as a rectangle over its window that ends at the processing time it was emitted, retractions struck
through in red.
"""

from __future__ import annotations

import argparse
import html
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from millpond.config import Settings, load_settings
from millpond.errors import MillpondError
from millpond.lake.tables import Tables
from millpond.model.timeutil import MAX_TS, MIN_TS, to_datetime, to_us
from millpond.surface.cli import command

COUNTS = ("input", "accepted", "duplicates", "late", "dropped", "quarantined", "panes")
_COUNT_ALIASES = {"duplicate": "duplicates", "dups": "duplicates", "rejected": "quarantined",
                  "too_late": "late", "inputs": "input", "n_panes": "panes", "records": "input"}
TIMINGS = ("EARLY", "ON_TIME", "LATE")
_TIMING_COLORS = {"EARLY": "#7fb3e0", "ON_TIME": "#5cb85c", "LATE": "#f0a030"}
# Finite bounds for drawing: the global window's ends and an infinite watermark are clipped.
_FAR_PAST, _FAR_FUTURE = MIN_TS + 86400 * 10**6, MAX_TS - 86400 * 10**6


@dataclass
class Report:
    """What was built: the local folder, its files and the numbers shown."""

    pipeline: str
    folder: Path
    files: list[Path] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    key: str | None = None
    uploaded: int = 0

    @property
    def index(self) -> Path:
        return self.folder / "index.html"


# -- reading and normalising -----------------------------------------------------------------
def _us(series: pd.Series) -> pd.Series:
    """Timestamps as integer microseconds (NaT -> MIN_TS): exact and tz-safe arithmetic."""
    if pd.api.types.is_integer_dtype(series):
        return series.astype("int64")
    s = pd.to_datetime(series, utc=True)
    return s.map(lambda t: MIN_TS if pd.isna(t) else to_us(t.to_pydatetime())).astype("int64")


def _as_mapping(value: Any) -> dict[str, Any]:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, (list, tuple)):  # arrow map -> list of (key, value)
        return dict(value)
    if isinstance(value, str) and value.strip():
        try:
            doc = json.loads(value)
        except json.JSONDecodeError:
            return {}
        return doc if isinstance(doc, dict) else {}
    return {}


def _count_name(column: str) -> str | None:
    c = column.lower()
    for prefix in ("count_", "counts_", "counts.", "n_", "num_"):
        if c.startswith(prefix):
            c = c[len(prefix):]
    if c.endswith("_count"):
        c = c[: -len("_count")]
    c = _COUNT_ALIASES.get(c, c)
    return c if c in COUNTS else None


def _phase_name(column: str) -> tuple[str, float] | None:
    """``phase_ingest``/``phases.ingest``/``ingest_seconds``/``ingest_ms`` -> (ingest, scale to s)."""
    c = column.lower()
    scale = 1.0
    for suffix, factor in (("_seconds", 1.0), ("_secs", 1.0), ("_sec", 1.0), ("_ms", 0.001), ("_s", 1.0)):
        if c.endswith(suffix):
            c, scale = c[: -len(suffix)], factor
            break
    else:
        if not (c.startswith("phase_") or c.startswith("phases.") or c.startswith("phases_")):
            return None
    for prefix in ("phase_", "phases.", "phases_", "time_", "t_"):
        if c.startswith(prefix):
            c = c[len(prefix):]
    return (c, scale) if c else None


def normalize_batches(table: pa.Table) -> pd.DataFrame:
    """One row per batch with fixed columns ``batch, processing_time_us, watermark_us, lag_s``, every
    count in :data:`COUNTS` and ``phase:<name>`` seconds, whatever layout the engine chose (flat
    columns, or ``counts``/``phases`` as struct, map or JSON)."""
    flat = table.flatten() if any(pa.types.is_struct(f.type) for f in table.schema) else table
    df = flat.to_pandas()
    for needed in ("batch", "processing_time", "watermark"):
        if needed not in df.columns:
            raise MillpondError(f"batches table has no `{needed}` column (see docs/contracts.md)")
    out = pd.DataFrame({
        "batch": df["batch"].astype("int64"),
        "processing_time_us": _us(df["processing_time"]),
        "watermark_us": _us(df["watermark"]),
    })
    counts: dict[str, pd.Series] = {}
    phases: dict[str, pd.Series] = {}
    for col in df.columns:
        if col in ("batch", "processing_time", "watermark", "input_watermark"):
            continue
        if col.lower() in ("counts", "phases"):
            maps = df[col].map(_as_mapping)
            keys = list(dict.fromkeys(k for m in maps for k in m))  # the engine's order (phases run in order)
            for k in keys:
                values = pd.to_numeric(maps.map(lambda m, k=k: m.get(k)), errors="coerce")
                if col.lower() == "counts":
                    name = _count_name(str(k))
                    if name:
                        counts[name] = values
                else:
                    phases[str(k)] = values
            continue
        if not pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col]):
            continue
        name = _count_name(col)
        if name:
            counts[name] = df[col]
            continue
        phase = _phase_name(col)
        if phase:
            phases[phase[0]] = df[col].astype("float64") * phase[1]
    for name in COUNTS:
        if name in counts:
            out[name] = pd.to_numeric(counts[name], errors="coerce").fillna(0).astype("int64")
    if "dropped" not in out.columns:  # events that reached no window: too late or malformed
        out["dropped"] = sum((out[c] for c in ("late", "quarantined") if c in out.columns),
                             pd.Series(0, index=out.index, dtype="int64"))
    for name in COUNTS:
        if name not in out.columns:
            out[name] = 0
    for name, values in phases.items():
        out[f"phase:{name}"] = pd.to_numeric(values, errors="coerce").fillna(0.0).astype("float64")
    finite = (out["watermark_us"] > _FAR_PAST) & (out["watermark_us"] < _FAR_FUTURE)
    out["lag_s"] = ((out["processing_time_us"] - out["watermark_us"]) / 1e6).where(finite)
    return out.sort_values("batch").reset_index(drop=True)


def normalize_panes(table: pa.Table) -> pd.DataFrame:
    df = table.to_pandas()
    for needed in ("key", "window_start", "window_end", "value", "batch", "processing_time"):
        if needed not in df.columns:
            raise MillpondError(f"panes table has no `{needed}` column (see docs/contracts.md)")
    out = pd.DataFrame({
        "key": df["key"].astype(str),
        "window_start_us": _us(df["window_start"]),
        "window_end_us": _us(df["window_end"]),
        "value": df["value"],
        "pane_index": df["pane_index"] if "pane_index" in df else 0,
        "timing": df["timing"].astype(str) if "timing" in df else "ON_TIME",
        "kind": df["kind"].astype(str) if "kind" in df else "value",
        "batch": df["batch"].astype("int64"),
        "processing_time_us": _us(df["processing_time"]),
        "seq": df["seq"] if "seq" in df else range(len(df)),
    })
    return out.sort_values(["batch", "seq", "key"], kind="stable").reset_index(drop=True)


def load(settings: Settings, pipeline: str, start: Any = None, end: Any = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Committed batches (processing time in [start, end)) and their panes."""
    tables = Tables(settings)
    raw = tables.open(pipeline, "batches")
    if raw is None:
        raise MillpondError(f"pipeline {pipeline} has no batches table yet: run a batch first (`make run`)")
    batches = normalize_batches(tables.read_arrow(pipeline, "batches"))
    if start is not None:
        batches = batches[batches["processing_time_us"] >= to_us(start)]
    if end is not None:
        batches = batches[batches["processing_time_us"] < to_us(end)]
    panes_dt = tables.open(pipeline, "panes")
    if panes_dt is None or batches.empty:
        ts = pa.timestamp("us", "UTC")
        panes = normalize_panes(pa.table({c: pa.array([], t) for c, t in (
            ("key", pa.string()), ("window_start", ts), ("window_end", ts), ("value", pa.int64()),
            ("batch", pa.int64()), ("processing_time", ts))}))
    else:
        import pyarrow.compute as pc

        wanted = pa.array(sorted(batches["batch"].tolist()), pa.int64())
        panes = normalize_panes(tables.read_arrow(pipeline, "panes", filters=pc.field("batch").isin(wanted)))
    return batches.reset_index(drop=True), panes  # panes of uncommitted batches are left out


# -- numbers ---------------------------------------------------------------------------------
def pane_counts(panes: pd.DataFrame) -> pd.DataFrame:
    """Per batch: value panes by timing, and retractions."""
    values = panes[panes["kind"] != "retraction"]
    table = pd.crosstab(values["batch"], values["timing"]) if not values.empty else pd.DataFrame()
    out = pd.DataFrame(index=sorted(set(panes["batch"])))
    for t in TIMINGS:
        out[t] = table[t] if t in table else 0
    retractions = panes[panes["kind"] == "retraction"].groupby("batch").size()
    out["retractions"] = retractions
    return out.fillna(0).astype("int64")


def totals(batches: pd.DataFrame, panes: pd.DataFrame) -> dict[str, Any]:
    t: dict[str, Any] = {"batches": int(len(batches))}
    for c in COUNTS:
        t[c] = int(batches[c].sum()) if len(batches) else 0
    by_timing = pane_counts(panes).sum() if len(panes) else pd.Series(dtype="int64")
    for c in (*TIMINGS, "retractions"):
        t[f"panes_{c.lower()}"] = int(by_timing.get(c, 0))
    lag = batches["lag_s"].dropna()
    t["lag_min_s"] = float(lag.min()) if len(lag) else None
    t["lag_mean_s"] = float(lag.mean()) if len(lag) else None
    t["lag_max_s"] = float(lag.max()) if len(lag) else None
    phases = [c for c in batches.columns if c.startswith("phase:")]
    t["phases_s"] = {c.split(":", 1)[1]: float(batches[c].sum()) for c in phases}
    if len(batches):
        t["first"] = to_datetime(int(batches["processing_time_us"].min())).isoformat()
        t["last"] = to_datetime(int(batches["processing_time_us"].max())).isoformat()
    return t


# -- plots -----------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib
    except ImportError as exc:
        raise MillpondError("matplotlib is not installed: run `make venv` (it is in requirements.lock)") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _num(us: int | float) -> float:
    """Microseconds since the epoch -> matplotlib date number (days since the epoch)."""
    return float(us) / 86_400e6


def _date_axis(axis, span_days: float) -> None:
    import matplotlib.dates as mdates

    axis.set_major_locator(mdates.AutoDateLocator(minticks=4, maxticks=10))
    axis.set_major_formatter(mdates.DateFormatter("%H:%M" if span_days < 2 else "%m-%d %H:%M"))


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def pick_key(panes: pd.DataFrame) -> str | None:
    """The key whose story has the most panes (retractions count double: they are the interesting bit)."""
    if panes.empty:
        return None
    weight = panes.assign(w=(panes["kind"] == "retraction").astype(int) + 1).groupby("key")["w"].sum()
    return str(sorted(weight.items(), key=lambda kv: (-kv[1], kv[0]))[0][0])


def plot_dataflow(path: Path, pipeline: str, key: str, batches: pd.DataFrame, panes: pd.DataFrame) -> Path:
    """The paper's diagram: x event time, y processing time, watermark curve, panes as rectangles."""
    plt = _plt()
    from matplotlib.patches import Patch, Rectangle

    mine = panes[panes["key"] == key]
    finite_w = batches[(batches["watermark_us"] > _FAR_PAST) & (batches["watermark_us"] < _FAR_FUTURE)]
    finite_p = mine[(mine["window_start_us"] > _FAR_PAST) & (mine["window_end_us"] < _FAR_FUTURE)]
    xs = list(finite_p["window_start_us"]) + list(finite_p["window_end_us"]) + list(finite_w["watermark_us"])
    ptimes = list(batches["processing_time_us"]) + list(mine["processing_time_us"])
    if not ptimes:
        raise MillpondError(f"nothing to draw for key {key!r}")
    steps = sorted(set(batches["processing_time_us"]))
    interval = min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=60 * 10**6)
    y_floor = min(ptimes) - interval
    y_top = max(ptimes) + interval * 0.5
    if not xs:
        xs = [y_floor, y_top]
    x_lo, x_hi = min(xs), max(xs)
    pad = max((x_hi - x_lo) * 0.04, 10**6)
    x_lo, x_hi = x_lo - pad, x_hi + pad

    fig, ax = plt.subplots(figsize=(11, 7), dpi=110)
    last_rect: dict[tuple[int, int], tuple[float, float, Any]] = {}
    retracted_now: dict[int, list[tuple[int, int]]] = {}  # batch -> windows it retracted

    def floor(win: tuple[int, int], batch: int, ptime: int) -> float:
        """Where a pane's rectangle starts: on top of the previous pane of its window; a merged
        window on top of the windows it replaced; a new window at the start of its batch."""
        if win in last_rect:
            return last_rect[win][1]
        replaced = [last_rect[w][1] for w in retracted_now.get(batch, []) if w in last_rect
                    and w[0] < win[1] and win[0] < w[1]]
        if replaced:
            return max(replaced)
        earlier = [t for t in steps if t < ptime]
        return max(earlier[-1] if earlier else ptime - interval, y_floor)

    for p in mine.itertuples(index=False):
        ws, we = max(p.window_start_us, x_lo), min(p.window_end_us, x_hi)
        win = (p.window_start_us, p.window_end_us)
        y1 = p.processing_time_us
        if p.kind == "retraction":
            prev = last_rect.get(win)
            label = f"−{_fmt_value(p.value)} at {to_datetime(int(y1)):%H:%M}"
            if prev is not None:  # strike the retracted pane's rectangle through, say when it was retracted
                ax.add_patch(Rectangle((_num(ws), _num(prev[0])), _num(we) - _num(ws), _num(prev[1]) - _num(prev[0]),
                                       fill=False, hatch="///", edgecolor="#d62728", linewidth=1.2, zorder=4))
                ax.annotate(label, (_num(ws), _num(prev[0])), xytext=(3, 3), textcoords="offset points",
                            color="#d62728", fontsize=8, fontweight="bold", zorder=6,
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.8})
            else:  # the retracted pane is outside the range shown: mark the retraction itself
                ax.plot([_num(ws), _num(we)], [_num(y1), _num(y1)], color="#d62728", linestyle="--", linewidth=1.4,
                        zorder=5)
                ax.annotate(label, (_num(ws), _num(y1)), xytext=(3, 3), textcoords="offset points",
                            color="#d62728", fontsize=8, fontweight="bold", zorder=6)
            retracted_now.setdefault(int(p.batch), []).append(win)
            continue
        y0 = floor(win, int(p.batch), int(y1))
        color = _TIMING_COLORS.get(p.timing, "#bbbbbb")
        ax.add_patch(Rectangle((_num(ws), _num(y0)), _num(we) - _num(ws), _num(y1) - _num(y0),
                               facecolor=color, alpha=0.45, edgecolor="#333333", linewidth=1.0, zorder=2))
        ax.annotate(_fmt_value(p.value), ((_num(ws) + _num(we)) / 2, _num(y1)), xytext=(0, -11),
                    textcoords="offset points", ha="center", fontsize=9, fontweight="bold", zorder=6)
        last_rect[win] = (y0, y1, p)

    # The watermark: at processing time P_b it stands at W_b until the next batch moves it.
    rows = batches.sort_values("processing_time_us")
    wx: list[float] = []
    wy: list[float] = []
    for i, r in enumerate(rows.itertuples(index=False)):
        w = min(max(r.watermark_us, x_lo), x_hi)
        nxt = rows["processing_time_us"].iloc[i + 1] if i + 1 < len(rows) else y_top
        wx += [_num(w), _num(w)]
        wy += [_num(r.processing_time_us), _num(nxt)]
    ax.plot(wx, wy, color="#1f4e9c", linewidth=2.2, label="watermark", zorder=7)
    ax.scatter([_num(min(max(w, x_lo), x_hi)) for w in rows["watermark_us"]],
               [_num(p) for p in rows["processing_time_us"]], s=12, color="#1f4e9c", zorder=7)
    lo, hi = max(x_lo, y_floor), min(x_hi, y_top)
    if lo < hi:
        ax.plot([_num(lo), _num(hi)], [_num(lo), _num(hi)], color="#999999", linestyle=":", linewidth=1,
                label="ideal (event time = processing time)", zorder=1)
    ax.set_xlim(_num(x_lo), _num(x_hi))
    ax.set_ylim(_num(y_floor), _num(y_top))
    _date_axis(ax.xaxis, _num(x_hi) - _num(x_lo))
    _date_axis(ax.yaxis, _num(y_top) - _num(y_floor))
    ax.set_xlabel("event time (UTC)")
    ax.set_ylabel("processing time (UTC)")
    ax.set_title(f"{pipeline}: panes of key {key!r} (one rectangle per pane, up to when it was emitted)")
    handles = [Patch(facecolor=_TIMING_COLORS[t], alpha=0.45, edgecolor="#333333", label=t) for t in TIMINGS]
    handles.append(Patch(fill=False, hatch="///", edgecolor="#d62728", label="retracted"))
    line_handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + line_handles, loc="upper left", fontsize=8, framealpha=0.9)
    ax.grid(True, alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_lag(path: Path, pipeline: str, batches: pd.DataFrame) -> Path:
    """Watermark lag (processing time - watermark) over processing time."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=110)
    rows = batches.dropna(subset=["lag_s"])
    ax.plot([_num(p) for p in rows["processing_time_us"]], rows["lag_s"] / 60, marker="o", markersize=3,
            color="#1f4e9c")
    ax.set_xlabel("processing time (UTC)")
    ax.set_ylabel("watermark lag (min)")
    if len(rows) and rows["lag_s"].min() >= 0:
        ax.set_ylim(bottom=0, top=max(rows["lag_s"].max() / 60 * 1.15, 1e-3))
    ax.set_title(f"{pipeline}: how far the watermark trails processing time")
    if len(rows):
        span = (rows["processing_time_us"].max() - rows["processing_time_us"].min()) / 86_400e6
        _date_axis(ax.xaxis, span)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_counts(path: Path, pipeline: str, batches: pd.DataFrame, by_timing: pd.DataFrame) -> Path:
    """Per batch: where the input went (stacked), and the panes emitted by timing."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), dpi=110, sharex=True)
    x = batches["batch"].to_numpy()
    bottom = pd.Series(0, index=batches.index, dtype="int64")
    # The engine counts late events among the accepted (input = accepted + duplicates + quarantined):
    # then the bar shows accepted minus late as "in windows", so the stack adds up to the input.
    late_inside = batches["accepted"] + batches["duplicates"] + batches["quarantined"] == batches["input"]
    parts = {"in windows": batches["accepted"] - batches["late"].where(late_inside, 0),
             "late": batches["late"], "duplicates": batches["duplicates"], "quarantined": batches["quarantined"]}
    colors = {"in windows": "#5cb85c", "late": "#f0a030", "duplicates": "#9e9e9e", "quarantined": "#d62728"}
    for name, values in parts.items():
        ax1.bar(x, values, bottom=bottom, color=colors[name], label=name)
        bottom = bottom + values
    ax1.plot(x, batches["input"], color="black", marker=".", linewidth=1, label="input")
    ax1.set_ylabel("events")
    ax1.legend(fontsize=8, ncol=5)
    ax1.set_title(f"{pipeline}: events and panes per batch")
    pane_rows = by_timing.reindex(x, fill_value=0)
    bottom = pd.Series(0, index=pane_rows.index, dtype="int64")
    for name in (*TIMINGS, "retractions"):
        color = _TIMING_COLORS.get(name, "#d62728")
        ax2.bar(x, pane_rows[name], bottom=bottom, color=color, label=name)
        bottom = bottom + pane_rows[name]
    ax2.set_ylabel("panes")
    ax2.set_xlabel("batch")
    ax2.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_phases(path: Path, pipeline: str, batches: pd.DataFrame) -> Path | None:
    phases = [c for c in batches.columns if c.startswith("phase:")]
    if not phases:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=110)
    x = batches["batch"].to_numpy()
    bottom = pd.Series(0.0, index=batches.index)
    cmap = plt.get_cmap("tab10")
    for i, c in enumerate(phases):
        ax.bar(x, batches[c], bottom=bottom, color=cmap(i % 10), label=c.split(":", 1)[1])
        bottom = bottom + batches[c]
    ax.set_xlabel("batch")
    ax.set_ylabel("seconds")
    ax.set_title(f"{pipeline}: batch time by phase")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- HTML ------------------------------------------------------------------------------------
def _ts(us: int) -> str:
    if us <= _FAR_PAST:
        return "-inf"
    if us >= _FAR_FUTURE:
        return "+inf"
    return to_datetime(int(us)).strftime("%Y-%m-%d %H:%M:%S")


def _cell(v: Any, attrs: str = "") -> str:
    if v is None or (isinstance(v, float) and pd.isna(v)):
        text = ""
    elif isinstance(v, float):
        text = f"{v:.3f}"
    else:
        text = str(v)
    return f"<td{attrs}>{html.escape(text)}</td>"


def render_html(pipeline: str, batches: pd.DataFrame, by_timing: pd.DataFrame, t: dict[str, Any],
                images: list[tuple[str, str]], key: str | None, span: str) -> str:
    esc = html.escape
    phases = [c for c in batches.columns if c.startswith("phase:")]
    summary = "".join(
        f'<tr><th>{esc(name)}</th><td id="total-{esc(name)}">{t[name]}</td></tr>'
        for name in ("batches", *COUNTS, "panes_early", "panes_on_time", "panes_late", "panes_retractions"))
    lag = "".join(f"<tr><th>watermark lag {k} (s)</th>{_cell(t[f'lag_{k}_s'])}</tr>" for k in ("min", "mean", "max"))
    phase_rows = "".join(f"<tr><th>phase {esc(k)} (s)</th>{_cell(v)}</tr>" for k, v in t["phases_s"].items())
    head = ["batch", "processing time", "watermark", "lag (s)", *COUNTS, *TIMINGS, "retractions",
            *(c.split(":", 1)[1] + " (s)" for c in phases)]
    rows = []
    pane_rows = by_timing.reindex(batches["batch"].tolist(), fill_value=0)
    for r in batches.itertuples(index=False):
        b = int(r.batch)
        cells = [_cell(b), _cell(_ts(r.processing_time_us)), _cell(_ts(r.watermark_us)), _cell(r.lag_s)]
        cells += [_cell(int(getattr(r, c)), f' data-batch="{b}" data-col="{c}"') for c in COUNTS]
        cells += [_cell(int(pane_rows.loc[b, c]), f' data-batch="{b}" data-col="panes_{c.lower()}"')
                  for c in (*TIMINGS, "retractions")]
        cells += [_cell(float(batches.loc[batches["batch"] == b, c].iloc[0])) for c in phases]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    figures = "".join(f'<figure><img src="{esc(src)}" alt="{esc(alt)}"><figcaption>{esc(alt)}</figcaption></figure>'
                      for src, alt in images)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Millpond report: {esc(pipeline)}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}}
table{{border-collapse:collapse;margin:.5rem 0 1.5rem}}
td,th{{border:1px solid #ccc;padding:.2rem .5rem;text-align:right;font-size:.85rem}} th{{background:#f4f4f4}}
figure{{margin:1rem 0}} img{{max-width:100%;border:1px solid #ddd}} .muted{{color:#777}}
</style></head><body>
<h1>Millpond report: {esc(pipeline)}</h1>
<p class="muted">{esc(span)} &middot; diagram key: {esc(key or "-")} &middot; generated {generated}.
"dropped" = events that reached no window (too late or quarantined) unless the engine counts it itself.</p>
<h2>Totals</h2><table>{summary}{lag}{phase_rows}</table>
{figures}
<h2>Per batch</h2>
<table><thead><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}</tr></thead>
<tbody>{"".join(rows)}</tbody></table>
</body></html>
"""


# -- building --------------------------------------------------------------------------------
def build(settings: Settings, pipeline: str, *, start: Any = None, end: Any = None, key: str | None = None,
          out_dir: Path | None = None, upload: bool = True) -> Report:
    """Build the report of one pipeline into ``out_dir`` (default ``var/reports/<pipeline>``) and
    publish it to ``s3://<reports>/reports/<pipeline>/``."""
    batches, panes = load(settings, pipeline, start, end)
    if batches.empty:
        raise MillpondError(f"pipeline {pipeline}: no committed batches in the chosen range")
    folder = Path(out_dir or settings.home / "reports" / pipeline)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    by_timing = pane_counts(panes)
    t = totals(batches, panes)
    report = Report(pipeline, folder, totals=t)
    images: list[tuple[str, str]] = []
    key = key or pick_key(panes)
    if key is not None:
        if key not in set(panes["key"]):
            raise MillpondError(f"pipeline {pipeline}: key {key!r} has no panes in the chosen range")
        report.key = key
        plot_dataflow(folder / "dataflow.png", pipeline, key, batches, panes)
        images.append(("dataflow.png", f"Panes of key {key} in event time vs processing time, with the watermark"))
    plot_lag(folder / "watermark_lag.png", pipeline, batches)
    images.append(("watermark_lag.png", "Watermark lag over processing time"))
    plot_counts(folder / "counts.png", pipeline, batches, by_timing)
    images.append(("counts.png", "Events and panes per batch"))
    if plot_phases(folder / "phases.png", pipeline, batches) is not None:
        images.append(("phases.png", "Batch time by phase"))
    span = f"batches {int(batches['batch'].min())}–{int(batches['batch'].max())}, {t['first']} to {t['last']}"
    report.index.write_text(render_html(pipeline, batches, by_timing, t, images, key, span))
    (folder / "summary.json").write_text(json.dumps({"pipeline": pipeline, "key": key, **t}, indent=2))
    report.files = sorted(p for p in folder.iterdir() if p.is_file())
    if upload:
        from millpond.lake.objectstore import ObjectStore

        report.uploaded = ObjectStore(settings).upload_dir(settings.bucket_reports, f"reports/{pipeline}", folder)
    return report


def report_pipelines(settings: Settings) -> list[str]:
    """Pipelines that have a batches table in the lake."""
    from millpond.lake.catalog import lake_pipelines, lake_tables

    return [p for p in lake_pipelines(settings) if "batches" in lake_tables(settings, p)]


def latest(settings: Settings) -> Path | None:
    """The most recently built local report page."""
    pages = sorted((settings.home / "reports").glob("*/index.html"), key=lambda p: p.stat().st_mtime)
    return pages[-1] if pages else None


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", default=None, help="default: every pipeline with committed batches")
    p.add_argument("--start", default=None, help="first processing time to include (ISO-8601)")
    p.add_argument("--end", default=None, help="processing time to stop before (ISO-8601)")
    p.add_argument("--key", default=None, help="key for the event-time diagram (default: the busiest)")
    p.add_argument("--no-upload", action="store_true", help="build locally only")
    p.add_argument("--latest", action="store_true", help="only print the latest local report's path")


@command("report", "build per-batch plots and an HTML page (var/reports/<pipeline>), publish to the reports bucket",
         _configure)
def _report(args: argparse.Namespace) -> int:
    settings = load_settings()
    if args.latest:
        page = latest(settings)
        if page is None:
            raise MillpondError("no report built yet: run `millpond report`")
        print(page)
        return 0
    pipelines: Iterable[str] = [args.pipeline] if args.pipeline else report_pipelines(settings)
    built = 0
    for pipeline in pipelines:
        r = build(settings, pipeline, start=args.start, end=args.end, key=args.key, upload=not args.no_upload)
        where = f" (published to s3://{settings.bucket_reports}/reports/{pipeline}/)" if r.uploaded else ""
        print(f"{r.index}{where}")
        built += 1
    if not built:
        raise MillpondError("no pipeline has committed batches yet: run `make run` first")
    return 0


if os.environ.get("MPLBACKEND") is None:  # plots render headless in jobs, DAGs and tests
    os.environ["MPLBACKEND"] = "Agg"
