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
from millpond.surface.report_plots import pick_key, plot_counts, plot_dataflow, plot_lag, plot_phases

COUNTS = ("input", "accepted", "duplicates", "late", "dropped", "quarantined", "panes")
_COUNT_ALIASES = {"duplicate": "duplicates", "dups": "duplicates", "rejected": "quarantined",
                  "too_late": "late", "inputs": "input", "n_panes": "panes", "records": "input"}
TIMINGS = ("EARLY", "ON_TIME", "LATE")
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
    if t.get("freshness_watermark_lag_s") is not None:
        lag += (f"<tr><th>freshness.watermark_lag (s)</th>{_cell(t['freshness_watermark_lag_s'])}</tr>"
                f"<tr><th>batches beyond it</th>{_cell(t['lag_breaches'])}</tr>")
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
          out_dir: Path | None = None, upload: bool = True, freshness: dict[str, int] | None = None) -> Report:
    """Build the report of one pipeline into ``out_dir`` (default ``var/reports/<pipeline>``) and
    publish it to ``s3://<reports>/reports/<pipeline>/``. ``freshness``: the pipeline's thresholds in
    microseconds (default: its file's in the conf dir); a declared ``watermark_lag`` is drawn on the lag plot."""
    from millpond.quality.freshness import declared

    batches, panes = load(settings, pipeline, start, end)
    if batches.empty:
        raise MillpondError(f"pipeline {pipeline}: no committed batches in the chosen range")
    folder = Path(out_dir or settings.home / "reports" / pipeline)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    by_timing = pane_counts(panes)
    t = totals(batches, panes)
    limit = (declared(settings, pipeline) if freshness is None else freshness).get("watermark_lag")
    threshold_s = None if limit is None else limit / 1e6
    if threshold_s is not None:
        t["freshness_watermark_lag_s"] = threshold_s
        t["lag_breaches"] = int((batches["lag_s"].dropna() > threshold_s).sum())
    report = Report(pipeline, folder, totals=t)
    images: list[tuple[str, str]] = []
    key = key or pick_key(panes)
    if key is not None:
        if key not in set(panes["key"]):
            raise MillpondError(f"pipeline {pipeline}: key {key!r} has no panes in the chosen range")
        report.key = key
        plot_dataflow(folder / "dataflow.png", pipeline, key, batches, panes)
        images.append(("dataflow.png", f"Panes of key {key} in event time vs processing time, with the watermark"))
    plot_lag(folder / "watermark_lag.png", pipeline, batches, threshold_s)
    images.append(("watermark_lag.png", "Watermark lag over processing time"
                   + ("" if threshold_s is None else ", with the pipeline's freshness.watermark_lag")))
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

