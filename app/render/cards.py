"""Figure cards: a view's chart with its caption and export buttons, headline numbers, comparisons.

Nothing here computes a metric: figures come from ``analysis`` views (through ``app.render.caching``), export
bytes from ``analysis.output.export``; this module only lays them out.
"""

from __future__ import annotations

import functools
import inspect
import logging
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from analysis.figures.style import screen_figure
from analysis.metrics.headline import HEADLINE_LABELS, compare_headlines, headline_help
from analysis.output.export import export_figure, provenance, static_export_available
from analysis.output.format import format_number
from analysis.views.picks import pick_text
from analysis.views.view import NotApplicable, View
from app.render import view_cache
from app.render.caching import Loaded
from app.render.errors import md_escape
from app.state import pickers
from app.state.inputs import InputError
from k3core.loading.tensor_info import CheckpointError

log = logging.getLogger("k3lab.app")

EXPORT_FORMATS = ("png", "svg", "html", "csv", "json")
STATIC_FORMATS = ("png", "svg")
MIME = {"png": "image/png", "svg": "image/svg+xml", "html": "text/html", "csv": "text/csv", "json": "application/json"}
PLOTLY_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}
KEY_HEADLINES = (
    "loss",
    "bits_per_byte",
    "mla_entropy_norm_mean",
    "sink_rate",
    "block_influence_mean",
    "moe_maxvio_max",
    "attnres_embedding_weight_mean",
    "kda_half_life_median",
)


SHORT_LABELS = {
    "mla_entropy_norm_mean": "MLA entropy (norm.)",
    "block_influence_mean": "Block Influence",
    "moe_maxvio_max": "MoE MaxVio (max)",
    "attnres_embedding_weight_mean": "AttnRes emb. weight",
    "kda_half_life_median": "KDA half-life (median)",
}


def headline_reference(key: str, numbers: dict) -> str | None:
    """The null reference shown under a headline metric, in words (analysis.metrics.null_reference), else None."""
    value = numbers.get(key)
    if key == "moe_maxvio_max" and numbers.get("moe_maxvio_floor") == numbers.get("moe_maxvio_floor"):  # not NaN
        floor = float(numbers["moe_maxvio_floor"])
        where = "within" if value is not None and value <= floor else "above"
        return f"{where} the balanced-routing floor {floor:.3g}"
    if key == "mla_entropy_norm_mean" and value == value and value is not None:
        return "uniform attention = 1"
    return None


def _accepts(func, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


# Newer Streamlit builds the file of a download button only when it is clicked (data=callable).
DEFERRED_DOWNLOADS = "callable" in (st.download_button.__doc__ or "")
CHART_KW = {"width": "stretch"} if _accepts(st.plotly_chart, "width") else {"use_container_width": True}
_DOWNLOAD_KW = {"on_click": "ignore"} if DEFERRED_DOWNLOADS else {}
NO_ARROW = {"delta_arrow": "off"} if _accepts(st.metric, "delta_arrow") else {}
_POPOVER_KW = {"width": "stretch"} if _accepts(st.popover, "width") else {}
DATAFRAME_KW = {"width": "stretch"} if _accepts(st.dataframe, "width") else {"use_container_width": True}


def slug(text: str) -> str:
    out = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(text)).strip("-")
    return out or "run"


def table_height(rows: int) -> int:
    """Pixel height that shows every row of an st.dataframe (35 px a row plus the header)."""
    return 35 * (rows + 1) + 3


# ----------------------------------------------------------------------------------------- exports
@functools.lru_cache(maxsize=1)
def static_export_status() -> tuple[bool, str]:
    """(available, reason) for PNG/SVG export, which needs Chromium (analysis.output.export.static_export_available)."""
    ok, message = static_export_available()
    return bool(ok), "" if ok else str(message)


def figure_bytes(fig, df, stem: str, fmt: str, meta: Any = None) -> bytes:
    """One export of a figure (analysis.output.export.export_figure into a temporary folder), as bytes; ``meta``
    (analysis.output.export.provenance: run, text, tokens; or a function making it) goes into its JSON, or its CSV's
    leading ``meta_`` columns."""
    if callable(meta):  # made on click (the text is decoded only for a download)
        meta = meta()
    with tempfile.TemporaryDirectory(prefix="k3lab-export-") as tmp:
        written = export_figure(fig, df, tmp, stem, [fmt], meta=meta)
        result = written.get(fmt)
        if not isinstance(result, Path):
            raise RuntimeError(str(result) if result is not None else f"{fmt} was not written")
        return result.read_bytes()


def _safe_bytes(fig, df, stem: str, fmt: str, meta: Any = None) -> bytes:
    try:
        return figure_bytes(fig, df, stem, fmt, meta)
    except Exception as exc:  # noqa: BLE001 - runs on click, outside the page; the file says what failed
        log.exception("export %s.%s failed", stem, fmt)
        return f"k3lab could not export {stem}.{fmt}: {type(exc).__name__}: {exc}\n".encode()


def export_buttons(fig, df, stem: str, key: str, meta: Any = None) -> None:
    """Download buttons for PNG, SVG, HTML (offline), CSV and JSON. Files are built on click."""
    static_ok, static_msg = static_export_status()
    formats = [f for f in EXPORT_FORMATS if static_ok or f not in STATIC_FORMATS]
    if not DEFERRED_DOWNLOADS and not st.toggle(
        "Prepare downloads", key=f"{key}-prep", help="Builds the files for this figure."
    ):
        return
    cols = st.columns(len(formats))
    for col, fmt in zip(cols, formats):
        data: Any = functools.partial(_safe_bytes, fig, df, stem, fmt, meta)
        if not DEFERRED_DOWNLOADS:
            data = data()
        col.download_button(
            fmt.upper(), data=data, file_name=f"{stem}.{fmt}", mime=MIME[fmt], key=f"{key}-{fmt}", **_DOWNLOAD_KW
        )
    if not static_ok:
        st.caption(static_msg)


def table_downloads(table: pd.DataFrame, stem: str, key: str) -> None:
    """CSV and JSON download buttons for a table."""
    c1, c2, _ = st.columns([1, 1, 6])
    c1.download_button(
        "CSV", data=table.to_csv(index=False), file_name=f"{stem}.csv", mime=MIME["csv"], key=f"{key}_csv"
    )
    c2.download_button(
        "JSON",
        data=table.to_json(orient="records", indent=2),
        file_name=f"{stem}.json",
        mime=MIME["json"],
        key=f"{key}_json",
    )


# ----------------------------------------------------------------------------------------- figures
_SCREEN: dict[int, tuple[weakref.ref, Any]] = {}
_SCREEN_LOCK = threading.Lock()


def screen_copy(fig):
    """analysis.figures.style.screen_figure of a figure, made once per figure object (the figures themselves are held by
    the figure cache, so a rerun or another session finds the copy); exports keep using ``fig``."""
    with _SCREEN_LOCK:
        held = _SCREEN.get(id(fig))
        if held is not None and held[0]() is fig:
            return held[1]
    light = screen_figure(fig)
    key = id(fig)
    with _SCREEN_LOCK:  # the entry goes when the cache lets go of the figure
        _SCREEN[key] = (weakref.ref(fig, lambda _ref, k=key: _SCREEN.pop(k, None)), light)
    return light


def figure_card(fig, df, key: str, stem: str, description: str = "", meta: Any = None) -> None:
    """A figure with its caption and an Export popover. The browser gets the lighter screen copy (float32, rounded
    floats, the template trimmed to what the figure uses); the exports are built from ``fig`` at full precision,
    their CSV / JSON led by ``meta`` (analysis.output.export.provenance)."""
    with st.container(border=True):
        # theme=None: the figure keeps its own look (analysis.figures.style, the same as its exported files), and the
        # browser skips re-theming it (0.1-0.2 s less to draw a page of ten figures, measured in Chromium)
        st.plotly_chart(screen_copy(fig), key=f"fig-{key}", config=PLOTLY_CONFIG, theme=None, **CHART_KW)
        left, right = st.columns([5, 1])
        if description:
            left.caption(description)
        with right.popover("Export", **_POPOVER_KW):
            export_buttons(fig, df, stem, key, meta)


def render_view(view: View, loaded: Loaded, key: str | None = None) -> bool:
    """Draw one View (with its layer/head pickers, ``app.state.pickers``, when it declares them); NotApplicable becomes
    an info line, a failure an error line. True when drawn. ``key``: the card's widget key when a page draws one
    view more than once (default: the view's key)."""
    pick, _ = pickers.view_pick(view, loaded)
    loaded = pickers.focused(loaded, pick)
    try:
        fig, df = view_cache.build_view(view, loaded)
    except NotApplicable as exc:
        st.info(f"**{view.title}**: {exc}")
        return False
    except (InputError, CheckpointError, ValueError, KeyError) as exc:
        st.error(f"**{view.title}**: {exc}")
        return False
    except Exception as exc:  # noqa: BLE001 - one broken figure must not take the page down
        log.exception("view %s failed", view.key)
        st.error(f"**{view.title}** could not be drawn: {type(exc).__name__}: {exc}")
        return False
    stem = f"{slug(loaded.ctx.label)}_{view.key}{_pick_suffix(pick)}"
    figure_card(
        fig,
        df,
        key=key or view.key,
        stem=stem,
        description=view.description,
        meta=functools.partial(provenance, loaded.ctx),
    )
    return True


def _pick_suffix(pick: dict[str, int]) -> str:
    """ "_L3H1" for an export's file name (analysis.views.picks.pick_text), "" without a pick."""
    text = pick_text(pick.get("layer"), pick.get("head"))
    return f"_{text}" if text else ""


# ----------------------------------------------------------------------------------------- headline numbers
def headline_metrics(loaded: Loaded) -> None:
    """analysis.metrics.headline.headline_numbers of the run: the key ones as metrics, all of them in a table."""
    try:
        numbers = view_cache.headline(loaded)
    except Exception as exc:  # noqa: BLE001
        log.exception("headline numbers failed")
        st.error(f"Headline numbers could not be computed: {type(exc).__name__}: {exc}")
        return
    keys = [k for k in KEY_HEADLINES if k in numbers]
    help_text = headline_help()  # one line of definition and unit each, from docs/DIAGNOSTICS.md
    per_row = 4
    for start in range(0, len(keys), per_row):
        cols = st.columns(per_row)
        for col, key in zip(cols, keys[start : start + per_row]):
            # a short label that fits a quarter of the page (the full name is the help's first line)
            full = HEADLINE_LABELS.get(key, key)
            reference = headline_reference(key, numbers)
            col.metric(
                SHORT_LABELS.get(key, full),
                format_number(numbers[key]),
                reference,
                delta_color="off",
                help=f"{full}: {help_text.get(key, '')}",
                **(NO_ARROW if reference else {}),
            )
    rows = [
        {"metric": HEADLINE_LABELS.get(k, k), "definition": help_text.get(k, ""), "value": v, "key": k}
        for k, v in numbers.items()
        if k != "label"
    ]
    table = pd.DataFrame(rows)
    box = lazy_expander("All headline numbers", key="k3lab_headline_table")
    if box is not None:
        with box:
            shown = table.assign(value=[format_number(v) for v in table["value"]])
            st.dataframe(shown, hide_index=True, height=table_height(len(shown)), **DATAFRAME_KW)
            table_downloads(table, f"{slug(loaded.ctx.label)}_headline", "k3lab_head")


def headline_delta(a: Loaded, b: Loaded, separate_training: bool = False) -> None:
    """analysis.metrics.headline.compare_headlines of two runs (A, B, delta = A - B, the loss delta's noise floor
    and its sentence, first) with CSV/JSON export; ``separate_training``: two trained checkpoints, whose seed noise
    the note adds."""
    try:
        both = compare_headlines(a.ctx, b.ctx, view_cache.headline(a), view_cache.headline(b), separate_training)
    except Exception as exc:  # noqa: BLE001
        log.exception("headline table failed")
        st.error(f"Headline numbers could not be compared: {type(exc).__name__}: {exc}")
        return
    table = both.table
    if both.noise is not None:  # first, so that no delta below is read without it
        (st.info if both.noise.within_noise else st.caption)(both.statement)
    # printed as the Overview prints them (missing: "n/a"), the exported table keeps the numbers
    numeric = [c for c in ("a", "b", "delta", "ci95") if c in table]
    shown = table.assign(**{c: [format_number(v) for v in table[c]] for c in numeric})
    if "within_noise" in shown:
        shown["within_noise"] = [{True: "yes", False: "no"}.get(v, "") for v in shown["within_noise"]]
    shown = shown.rename(
        columns={
            "a": f"A: {a.ctx.label}",
            "b": f"B: {b.ctx.label}",
            "delta": "A - B",
            "ci95": "± (95% CI)",
            "within_noise": "within noise",
        }
    )
    st.dataframe(shown.drop(columns=["metric"]), hide_index=True, height=table_height(len(shown)), **DATAFRAME_KW)
    table_downloads(table, f"{slug(a.ctx.label)}_vs_{slug(b.ctx.label)}_headline", "k3lab_cmp_head")


# ----------------------------------------------------------------------------------------- comparison
def render_comparison(view: View, a: Loaded, b: Loaded) -> None:
    """One view for A and B: side by side (shared axes) and, where the tables align, the difference A - B. A view
    with layer/head pickers gets one pick for both runs; a run without the picked layer/head says so in its half."""
    pick, each = pickers.view_pick(view, a, b)
    if pick:
        missing = pickers.only_in(pick, each, [a.ctx.label, b.ctx.label])
        st.caption(
            "One pick for both runs." + (f" {md_escape(missing)}: its half says so." if missing else ""),
        )
        a, b = pickers.focused(a, pick), pickers.focused(b, pick)
    stem = f"{slug(a.ctx.label)}_vs_{slug(b.ctx.label)}_{view.key}{_pick_suffix(pick)}"
    try:
        fig, df = view_cache.compare_view("side", view, a, b)
    except NotApplicable as exc:
        st.info(f"**{view.title}**: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("comparison %s failed", view.key)
        st.error(f"**{view.title}** could not be compared: {type(exc).__name__}: {exc}")
        return
    meta = functools.partial(provenance, a.ctx, b.ctx)
    figure_card(fig, df, key=f"cmp-{view.key}", stem=stem, description=view.description, meta=meta)
    try:
        dfig, ddf = view_cache.compare_view("diff", view, a, b)
    except NotApplicable as exc:
        st.caption(f"No difference view for {view.title}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("difference %s failed", view.key)
        st.caption(f"No difference view for {view.title}: {type(exc).__name__}: {exc}")
        return
    diff = lazy_expander(f"Difference A - B: {view.title}", key=f"k3lab_diff_{view.key}")
    if diff is not None:
        with diff:
            figure_card(dfig, ddf, key=f"diff-{view.key}", stem=f"{stem}_diff", meta=meta)


def lazy_expander(label: str, key: str):
    """An expander whose contents are built only while it is open (opening it reruns the page): the container when
    open, else None. Why: the browser mounts a closed expander's contents too (a chart, a data grid, a JSON tree)
    and that mounting is most of a page switch's time on the 2-core machine (``benchmarks/bench_pages.py``). Its
    open state is ``st.session_state[key]``, closed on each new visit to the page."""
    box = st.expander(label, key=key, on_change="rerun")
    return box if box.open else None


def layer_badges(cfg) -> str:
    """The layer map as a row of coloured badges: KDA blue, MLA red; MoE layers marked with a dot."""
    parts = []
    for i, kind in enumerate(cfg.layer_types()):
        colour = "red" if kind == "MLA" else "blue"
        moe = "·moe" if cfg.is_moe_layer(i) else ""
        parts.append(f":{colour}-background[{i}&nbsp;{kind}{moe}]")
    return " ".join(parts)
