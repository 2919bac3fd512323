"""The report's pictures: the Dataflow paper's pane diagram for one key, watermark lag, counts and phase times.

Rendered headless with matplotlib's Agg backend, chosen when the first plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from millpond.errors import MillpondError
from millpond.model.timeutil import MAX_TS, MIN_TS, to_datetime

TIMINGS = ("EARLY", "ON_TIME", "LATE")
_TIMING_COLORS = {"EARLY": "#7fb3e0", "ON_TIME": "#5cb85c", "LATE": "#f0a030"}
_FAR_PAST, _FAR_FUTURE = MIN_TS + 86400 * 10**6, MAX_TS - 86400 * 10**6


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


#: the colour of a declared freshness threshold and of the batches beyond it
THRESHOLD_COLOR = "#d62728"


def plot_lag(path: Path, pipeline: str, batches: pd.DataFrame, threshold_s: float | None = None) -> Path:
    """Watermark lag (processing time - watermark) over processing time; with ``threshold_s`` (the pipeline's
    ``freshness.watermark_lag``) the threshold as a dashed line, and the batches beyond it marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=110)
    rows = batches.dropna(subset=["lag_s"])
    ax.plot([_num(p) for p in rows["processing_time_us"]], rows["lag_s"] / 60, marker="o", markersize=3,
            color="#1f4e9c", label="watermark lag")
    ax.set_xlabel("processing time (UTC)")
    ax.set_ylabel("watermark lag (min)")
    if threshold_s is not None:
        ax.axhline(threshold_s / 60, color=THRESHOLD_COLOR, linestyle="--", linewidth=1.6,
                   label=f"freshness.watermark_lag ({threshold_s / 60:g} min)")
        over = rows[rows["lag_s"] > threshold_s]
        if len(over):
            ax.scatter([_num(p) for p in over["processing_time_us"]], over["lag_s"] / 60, s=30,
                       color=THRESHOLD_COLOR, zorder=5, label="beyond the threshold")
        ax.legend(fontsize=8, loc="upper left")
    if len(rows) and rows["lag_s"].min() >= 0:
        top = max(rows["lag_s"].max(), threshold_s or 0) / 60
        ax.set_ylim(bottom=0, top=max(top * 1.15, 1e-3))
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
