"""Exporting figures and their data: PNG and SVG (kaleido + the system Chromium), offline HTML, CSV, JSON.

    results = export_figure(fig, df, "out/", "moe_load")      # {"png": Path, ..., "svg": "message"}
    export_many([(fig, df, "a"), (fig2, df2, "b")], "out/")   # static images in one browser session

Static images need a Chromium/Chrome binary (kaleido >= 1 drives a headless browser). When none is
found, PNG/SVG entries hold a message saying so (``ExportUnavailable`` explains why) and the HTML, CSV
and JSON files are still written. HTML files embed plotly.js inline, so they open offline.

Starting the browser costs seconds, so ``export_many`` renders every static image of a batch in one
kaleido session instead of one session per image.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

FORMATS = ("png", "svg", "html", "csv", "json")
STATIC_FORMATS = ("png", "svg")
CHROMIUM_CANDIDATES = (
    "/usr/bin/chromium",
    "/usr/bin/chromium-browser",
    "/usr/bin/google-chrome",
    "/usr/bin/google-chrome-stable",
)
DEFAULT_SCALE = 2  # PNG pixel density (2 = sharp in print and on high-DPI screens)


class ExportUnavailable(RuntimeError):
    """A requested export format cannot be produced here (the message says why and what to install)."""


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary for kaleido: $BROWSER_PATH, the usual system paths, then $PATH."""
    env = os.environ.get("BROWSER_PATH")
    if env and Path(env).is_file():
        return env
    for path in CHROMIUM_CANDIDATES:
        if Path(path).is_file() and os.access(path, os.X_OK):
            return path
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def require_static_export() -> str:
    """The browser path for static export, or raise ExportUnavailable with what to do."""
    try:
        import kaleido  # noqa: F401
    except ImportError as exc:
        raise ExportUnavailable("PNG/SVG export needs the 'kaleido' package (pip install kaleido>=1)") from exc
    path = find_chromium()
    if path is None:
        raise ExportUnavailable(
            "PNG/SVG export needs Chromium, which kaleido drives headless: none found at "
            f"{', '.join(CHROMIUM_CANDIDATES[:2])} or on PATH (install it, e.g. "
            "`apt-get install chromium`, or set BROWSER_PATH); HTML, CSV and JSON exports "
            "still work"
        )
    return path


def static_export_available() -> tuple[bool, str]:
    """(True, browser path) or (False, the reason)."""
    try:
        return True, require_static_export()
    except ExportUnavailable as exc:
        return False, str(exc)


# ----------------------------------------------------------------------------- data and HTML
def _json_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if hasattr(v, "item"):
        return _json_value(v.item())
    return v


def data_records(df: pd.DataFrame) -> list[dict]:
    """Rows of a table as JSON-able dicts (NaN -> null, inf -> "inf")."""
    return [{str(k): _json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


PROVENANCE_COLUMN_CHARS = 200  # a text in a provenance column: its first characters (the JSON has it whole)
META_PREFIX = "meta_"  # provenance columns: "meta_run", "meta_text", "meta_tokens", "meta_run_A"


def with_provenance_columns(df: pd.DataFrame, meta: dict) -> pd.DataFrame:
    """The table with ``meta`` (e.g. the run, the text and its token count) as leading columns ``meta_<key>``, one
    value repeated on every row, so a single downloaded CSV says what it was computed on and a plain
    ``pandas.read_csv`` reads it. Texts longer than PROVENANCE_COLUMN_CHARS are cut (and say so)."""
    columns = {}
    for key, value in meta.items():
        if isinstance(value, str) and len(value) > PROVENANCE_COLUMN_CHARS:
            value = f"{value[:PROVENANCE_COLUMN_CHARS]} [... cut: the JSON export has all of it]"
        columns[META_PREFIX + "_".join(str(key).split())] = value
    out = df.copy()
    for i, (name, value) in enumerate(columns.items()):
        if name not in out.columns:
            out.insert(i, name, [value] * len(out))
    return out


def read_csv_with_provenance(path: str | Path) -> tuple[pd.DataFrame, dict]:
    """(table, meta) of an exported CSV: a plain ``pandas.read_csv`` of it, the meta from the JSON written beside it
    (``<stem>.json``: its keys other than columns/keys/rows), else from its ``meta_`` columns (which are dropped)."""
    path = Path(path)
    table = pd.read_csv(path)
    sidecar = path.with_suffix(".json")
    if sidecar.exists():
        doc = json.loads(sidecar.read_text(encoding="utf-8"))
        return table, {k: v for k, v in doc.items() if k not in ("columns", "keys", "rows")}
    meta_cols = [c for c in table.columns if str(c).startswith(META_PREFIX)]
    meta = {c[len(META_PREFIX) :]: table[c].iloc[0] for c in meta_cols if len(table)}
    return table.drop(columns=meta_cols), meta


PROVENANCE_TEXT_CHARS = 4000  # an exported file carries the text up to this many characters (and says when cut)


def provenance(*contexts: Any) -> dict:
    """What an exported table was computed on, for its CSV header / JSON meta: each context's (an
    ``AnalysisContext``) run label, text (first row, decoded; cut at PROVENANCE_TEXT_CHARS characters with a note)
    and token count. One context: keys "run", "text", "tokens"; two (a comparison): the same with " A" / " B"."""
    from analysis.runs.texts import text_tokenizer

    out: dict = {}
    for side, ctx in zip(("A", "B"), contexts):
        suffix = f" {side}" if len(contexts) > 1 else ""
        out[f"run{suffix}"] = ctx.label
        ids = ctx.input_ids
        if ids is None:
            continue
        row = [int(i) for i in (ids[0] if getattr(ids, "ndim", 1) > 1 else ids).tolist()]
        try:
            text = text_tokenizer(ctx.config, ctx.tokenizer).decode(row)
        except ValueError:  # no tokenizer for this vocabulary: the ids themselves
            text = " ".join(map(str, row))
        if len(text) > PROVENANCE_TEXT_CHARS:
            text = (
                f"{text[:PROVENANCE_TEXT_CHARS]} [... the first {PROVENANCE_TEXT_CHARS:,} of {len(text):,} characters]"
            )
        out[f"text{suffix}"] = text
        out[f"tokens{suffix}"] = len(row)
    return out


def write_csv(df: pd.DataFrame, path: str | Path, meta: dict | None = None) -> Path:
    """The table as a plain CSV (``pandas.read_csv`` reads it as it is); ``meta`` given, as leading columns
    (``with_provenance_columns``). Where a JSON of the table is written beside it, the meta goes there instead."""
    path = Path(path)
    (with_provenance_columns(df, meta) if meta else df).to_csv(path, index=False)
    return path


def write_json(df: pd.DataFrame, path: str | Path, meta: dict | None = None) -> Path:
    """``{"columns": [...], "keys": [...], "rows": [{...}, ...], **meta}`` (keys from df.attrs when set)."""
    path = Path(path)
    payload = {
        **(meta or {}),
        "columns": [str(c) for c in df.columns],
        "keys": list(df.attrs.get("keys", [])),
        "rows": data_records(df),
    }
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def write_html(fig: go.Figure, path: str | Path) -> Path:
    """A standalone HTML page with plotly.js inline (no CDN: it opens offline)."""
    path = Path(path)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True, config={"displaylogo": False})
    return path


# ----------------------------------------------------------------------------- static images
def _size(fig: go.Figure) -> tuple[int, int]:
    """Image size: the layout's width/height, else ``layout.meta["export_width"]`` (wide side-by-side figures),
    else 1000 x 450 px."""
    meta = fig.layout.meta if isinstance(fig.layout.meta, dict) else {}
    width = fig.layout.width or meta.get("export_width") or 1000
    height = fig.layout.height or 450
    return int(width), int(height)


def write_static_batch(
    jobs: Sequence[tuple[go.Figure, Path]], scale: float = DEFAULT_SCALE, browser_path: str | None = None
) -> dict[Path, Path | str]:
    """Render every (figure, path) in one kaleido browser session; the format comes from the suffix. Images
    that failed get one more session of their own: a browser that starts slowly on a loaded machine can run
    kaleido's script before it loaded ("ReferenceError: kaleido_scopes is not defined", seen in CI).

    Returns {path: path} for written files and {path: error message} for failures. Raises
    ExportUnavailable when no browser or kaleido is available."""
    if not jobs:
        return {}
    browser_path = browser_path or require_static_export()
    out = _kaleido_session(jobs, scale, browser_path)
    failed = [(fig, path) for fig, path in jobs if not isinstance(out[Path(path)], Path)]
    if failed:
        out.update(_kaleido_session(failed, scale, browser_path))
    return out


def _kaleido_session(jobs: Sequence[tuple[go.Figure, Path]], scale: float, browser_path: str) -> dict[Path, Path | str]:
    """One kaleido browser session over ``jobs``: {path: path} written, {path: error message} not."""
    import kaleido

    items = []
    for fig, path in jobs:
        path = Path(path)
        path.unlink(missing_ok=True)
        width, height = _size(fig)
        fmt = path.suffix.lstrip(".")
        opts = {"format": fmt, "width": width, "height": height, "scale": scale if fmt == "png" else 1}
        items.append({"fig": fig, "path": path, "opts": opts})
    try:
        errors = kaleido.write_fig_from_object_sync(items, kopts={"mathjax": False, "path": browser_path})
    except Exception as exc:  # noqa: BLE001 - any browser failure becomes a message, never a crash
        return {Path(p): f"static export failed: {type(exc).__name__}: {exc}" for _, p in jobs}
    detail = "; ".join(f"{type(e).__name__}: {e}" for e in (errors or ()))[:300]
    out: dict[Path, Path | str] = {}
    for _, path in jobs:
        path = Path(path)
        ok = path.is_file() and path.stat().st_size > 0
        out[path] = path if ok else f"static export failed for {path.name}" + (f" ({detail})" if detail else "")
    return out


# ----------------------------------------------------------------------------- one or many figures
def _check_formats(formats: Iterable[str]) -> tuple[str, ...]:
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export format(s) {unknown}; choose from {FORMATS}")
    return formats


def _safe_stem(stem: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(stem)).strip("._")
    if not cleaned:
        raise ValueError(f"invalid file stem {stem!r}")
    return cleaned


def export_many(
    items: Sequence[tuple[go.Figure, pd.DataFrame | None, str]],
    out_dir: str | Path,
    formats: Iterable[str] = FORMATS,
    scale: float = DEFAULT_SCALE,
    meta: dict[str, dict] | None = None,
) -> dict[str, dict[str, Path | str]]:
    """Export several (figure, table, stem) at once: {stem: {format: Path or message}}.

    HTML/CSV/JSON are written per item; PNG/SVG for all items in one kaleido session. A table of None
    skips CSV/JSON for that item (with a message). ``meta[stem]`` (e.g. ``provenance``) goes into the item's JSON
    (top-level keys), the sidecar of its plain CSV; without a JSON, into the CSV's leading ``meta_`` columns."""
    formats = _check_formats(formats)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Path | str]] = {}
    jobs: list[tuple[go.Figure, Path]] = []
    owners: dict[Path, tuple[str, str]] = {}
    for fig, df, stem in items:
        stem = _safe_stem(stem)
        res = results.setdefault(stem, {})
        for fmt in formats:
            path = out_dir / f"{stem}.{fmt}"
            try:
                if fmt == "html":
                    res[fmt] = write_html(fig, path)
                elif fmt in ("csv", "json"):
                    if df is None:
                        res[fmt] = "no data table for this figure"
                    elif fmt == "csv":  # the meta in the JSON beside it when there is one, else in columns
                        res[fmt] = write_csv(df, path, None if "json" in formats else (meta or {}).get(stem))
                    else:
                        res[fmt] = write_json(df, path, (meta or {}).get(stem))
                else:
                    jobs.append((fig, path))
                    owners[path] = (stem, fmt)
            except OSError as exc:
                res[fmt] = f"could not write {path}: {exc}"
    if jobs:
        try:
            written = write_static_batch(jobs, scale=scale)
        except ExportUnavailable as exc:
            written = {path: str(exc) for _, path in jobs}
        for path, value in written.items():
            stem, fmt = owners[path]
            results[stem][fmt] = value
    return results


def export_figure(
    fig: go.Figure,
    df: pd.DataFrame | None,
    out_dir: str | Path,
    stem: str,
    formats: Iterable[str] = FORMATS,
    scale: float = DEFAULT_SCALE,
    meta: dict | None = None,
) -> dict[str, Path | str]:
    """Export one figure and its table: {format: written Path, or a message saying why not}; ``meta`` (e.g.
    ``provenance``) goes into the JSON, and into the CSV's leading columns when the JSON is not written.

    PNG/SVG need Chromium (see ``static_export_available``); without it their entries are the
    ExportUnavailable message and the other formats are still written."""
    meta_of = {_safe_stem(stem): meta} if meta else None
    return export_many([(fig, df, stem)], out_dir, formats, scale=scale, meta=meta_of)[_safe_stem(stem)]


def failures(results: dict) -> dict[str, str]:
    """The messages of an export_figure / export_many result ({'stem.fmt' or 'fmt': message})."""
    out = {}
    for key, value in results.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in failures(value).items()})
        elif isinstance(value, str):
            out[key] = value
    return out
