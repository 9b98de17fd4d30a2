"""Sidebar inputs, figure cards and export buttons shared by every page.

Nothing here computes a metric: figures come from ``analysis`` views, export bytes from
``analysis.export``; this module only lays them out.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import streamlit as st

from app import state
from app.state import InputError, Inputs, Loaded, RunRef, TextChoice
from k3core.checkpoint import CheckpointError

log = logging.getLogger("k3lab.app")

EXPORT_FORMATS = ("png", "svg", "html", "csv", "json")
STATIC_FORMATS = ("png", "svg")
MIME = {"png": "image/png", "svg": "image/svg+xml", "html": "text/html", "csv": "text/csv", "json": "application/json"}
PLOTLY_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}


def _accepts(func, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


# Newer Streamlit builds the file of a download button only when it is clicked (data=callable).
DEFERRED_DOWNLOADS = "callable" in (st.download_button.__doc__ or "")
_CHART_KW = {"width": "stretch"} if _accepts(st.plotly_chart, "width") else {"use_container_width": True}
_DOWNLOAD_KW = {"on_click": "ignore"} if DEFERRED_DOWNLOADS else {}
NO_ARROW = {"delta_arrow": "off"} if _accepts(st.metric, "delta_arrow") else {}
_POPOVER_KW = {"width": "stretch"} if _accepts(st.popover, "width") else {}


# ----------------------------------------------------------------------------------------- sidebar
def _device_choices() -> list[str]:
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _dtype_choices(device: str) -> list[str]:
    return ["float32", "bfloat16", "float16"] if device == "cuda" else ["float32", "bfloat16"]


def _origin_tag(run: RunRef) -> str:
    return {"preloaded": "", "sample": " · sample", "uploaded": " · uploaded"}.get(run.origin, "")


def sidebar() -> Inputs:
    """Draw the sidebar inputs (run, text, max tokens, device, dtype, options) and return them.

    The chosen inputs are also stored in ``st.session_state["k3lab_inputs"]`` for the pages.
    """
    ss = st.session_state
    uploaded = ss.setdefault("k3lab_uploaded", [])
    runs, problems = state.discover_runs(os.environ.get(state.RUNS_ENV), state.SAMPLES_DIR, uploaded)
    labels = [r.label for r in runs]
    by_label = {r.label: r for r in runs}
    pending = ss.pop("k3lab_pending_run", None)  # a folder path: select that run (e.g. after an upload)
    pending_label = next((r.label for r in runs if pending and r.path == str(Path(pending).resolve())), None)
    if pending_label is not None:
        ss["k3lab_run"] = pending_label
    elif ss.get("k3lab_run") not in by_label:
        ss.pop("k3lab_run", None)

    with st.sidebar:
        run = None
        if runs:
            chosen = st.selectbox(
                "Run",
                labels,
                key="k3lab_run",
                format_func=lambda lab: lab + _origin_tag(by_label[lab]),
                help="Checkpoint folders: those given to `k3lab app`, the shipped samples and your uploads.",
            )
            run = by_label.get(chosen)
        else:
            st.warning(
                "No checkpoints found. Upload one on the **Upload** page, or start the app with `k3lab app PATH`."
            )
        for problem in problems:
            st.warning(problem)

        choice, text_error = text_choice("k3lab")
        st.divider()
        c1, c2 = st.columns(2)
        device = c1.selectbox("Device", _device_choices(), key="k3lab_device")
        if ss.get("k3lab_dtype") not in _dtype_choices(device):  # e.g. float16 chosen on cuda, then cpu
            ss.pop("k3lab_dtype", None)
        dtype = c2.selectbox("dtype", _dtype_choices(device), key="k3lab_dtype")
        ss.setdefault("k3lab_seq_len", state.SEQ_LEN_DEFAULT)
        ss.setdefault("k3lab_record_attn", True)
        seq_len = st.select_slider(
            "Sequence length for memory views",
            options=list(state.SEQ_LENS),
            key="k3lab_seq_len",
            format_func=human_tokens,
            help="The length at which cache memory and FLOPs per token are computed (density views).",
        )
        record_attn = st.checkbox(
            "Record MLA attention probabilities",
            key="k3lab_record_attn",
            help=f"Needed for entropy and sink views; quadratic in length, recorded for at "
            f"most {state.MAX_ATTN_LEN} positions.",
        )

    inputs = Inputs(
        runs=tuple(runs),
        run=run,
        text=choice,
        text_error=text_error,
        device=device,
        dtype=dtype,
        seq_len=int(seq_len),
        record_attn=bool(record_attn),
        problems=tuple(problems),
    )
    ss["k3lab_inputs"] = inputs
    return inputs


def text_choice(
    prefix: str, max_tokens: int | None = None, default: str = state.TEXT_SHAKESPEARE, label: str = "Text"
) -> tuple[TextChoice, str | None]:
    """Text source picker (+ text box / file uploader, + max tokens unless given). Returns (choice, error)."""
    st.session_state.setdefault(f"{prefix}_text_source", default)
    source = st.selectbox(
        label,
        state.TEXT_SOURCES,
        key=f"{prefix}_text_source",
        help="What the model reads. The Shakespeare passage is from a play held out of training; "
        "MQAR is a synthetic associative-recall sequence (loss on the answers only).",
    )
    if max_tokens is None:
        st.session_state.setdefault(f"{prefix}_max_tokens", state.MAX_TOKENS_DEFAULT)
        max_tokens = st.number_input(
            "Max tokens",
            min_value=2,
            max_value=state.MAX_TOKENS_CAP,
            step=128,
            key=f"{prefix}_max_tokens",
            help=f"Longer texts are cut to their first N tokens (bytes); at most {state.MAX_TOKENS_CAP:,}.",
        )
    text, name, error = None, "", None
    if source == state.TEXT_PASTE:
        text = st.text_area(
            "Your text", key=f"{prefix}_paste", height=140, placeholder="Paste any text; it is read as UTF-8 bytes."
        )
    elif source == state.TEXT_UPLOAD:
        up = st.file_uploader("Text file", type=["txt"], key=f"{prefix}_text_file")
        if up is not None:
            name = up.name
            try:
                text = state.decode_upload(up.getvalue(), up.name)
            except InputError as exc:
                error = str(exc)
    choice = TextChoice(source=source, max_tokens=int(max_tokens), text=text, name=name)
    if error is None:
        try:
            state.check_text(choice)
        except InputError as exc:
            error = str(exc)
    if error is None and text is not None:
        size = len(text.encode("utf-8", "replace"))
        if size > choice.max_tokens:
            st.caption(f"{size:,} bytes of text: the first {choice.max_tokens:,} are read (max tokens).")
        else:
            st.caption(f"{size:,} bytes of text.")
    return choice, error


def human_tokens(n: int) -> str:
    """1024 -> '1K', 1048576 -> '1M'."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}K"
    return str(n)


def human_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# ----------------------------------------------------------------------------------------- loading
def inputs_or_stop() -> Inputs:
    """The sidebar inputs; stops the page with a message when there is no run to show."""
    inputs = state.current_inputs()
    if inputs is None:
        inputs = sidebar()
    if inputs.run is None:
        st.info("No run selected. Upload a checkpoint on the **Upload** page.")
        st.stop()
    return inputs


def model_or_stop(inputs: Inputs, run: RunRef | None = None):
    """The run's model (cached); on a bad checkpoint, device or failure shows st.error and stops the page."""
    run = run or inputs.run
    error = None
    try:
        return state.load_model(run, inputs.device, inputs.dtype)
    except (CheckpointError, InputError) as exc:
        error = f"**{run.label}**: {exc}"
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: say so, keep the app running
        log.exception("loading %s failed", run.path)
        error = f"**{run.label}** could not be loaded on {inputs.device}/{inputs.dtype}: {type(exc).__name__}: {exc}"
    st.error(error)
    st.stop()


def show_input_notes(loaded: Loaded) -> None:
    """A notice when the text was cut to max tokens (a warning for the user's own text)."""
    tok = loaded.tokens
    if tok.truncated:
        msg = (
            f"Reading the first {tok.n:,} of {tok.total:,} tokens of the text (max tokens in the sidebar, at "
            f"most {state.MAX_TOKENS_CAP:,})."
        )
        if tok.user_text:
            st.warning(msg)
        else:
            st.caption(msg)


def load_or_stop(
    inputs: Inputs,
    run: RunRef | None = None,
    choice: TextChoice | None = None,
    label: str | None = None,
    text_error: str | None = None,
) -> Loaded:
    """Model + trace + context for a run; on a bad checkpoint or text shows st.error and stops the page."""
    run = run or inputs.run
    if choice is None:
        choice, text_error = inputs.text, inputs.text_error
    if text_error:
        st.error(text_error)
        st.stop()
    error = None
    try:
        loaded = state.load(run, choice, inputs.device, inputs.dtype, inputs.record_attn, inputs.options(), label=label)
    except (CheckpointError, InputError) as exc:
        error = f"**{run.label}**: {exc}"
    except Exception as exc:  # noqa: BLE001 - a failed forward must not take the app down
        log.exception("loading %s failed", run.path)
        error = f"**{run.label}** could not be run on {inputs.device}/{inputs.dtype}: {type(exc).__name__}: {exc}"
    if error is not None:
        st.error(error)
        st.stop()
    for note in loaded.notes:
        st.warning(note)
    return loaded


# ----------------------------------------------------------------------------------------- figures
def show_figure(fig, key: str) -> None:
    st.plotly_chart(fig, key=key, config=PLOTLY_CONFIG, **_CHART_KW)


@functools.lru_cache(maxsize=1)
def static_export_status() -> tuple[bool, str]:
    """(available, reason) for PNG/SVG export, which needs Chromium (analysis.export.static_export_available)."""
    from analysis.export import static_export_available

    ok, message = static_export_available()
    return bool(ok), "" if ok else str(message)


def figure_bytes(fig, df, stem: str, fmt: str) -> bytes:
    """One export of a figure (analysis.export.export_figure into a temporary folder), as bytes."""
    from analysis.export import export_figure

    with tempfile.TemporaryDirectory(prefix="k3lab-export-") as tmp:
        written = export_figure(fig, df, tmp, stem, [fmt])
        result = written.get(fmt)
        if not isinstance(result, Path):
            raise RuntimeError(str(result) if result is not None else f"{fmt} was not written")
        return result.read_bytes()


def export_buttons(fig, df, stem: str, key: str) -> None:
    """Download buttons for PNG, SVG, HTML (offline), CSV and JSON. Files are built on click."""
    static_ok, static_msg = static_export_status()
    formats = [f for f in EXPORT_FORMATS if static_ok or f not in STATIC_FORMATS]
    if not DEFERRED_DOWNLOADS and not st.toggle(
        "Prepare downloads", key=f"{key}-prep", help="Builds the files for this figure."
    ):
        return
    cols = st.columns(len(formats))
    for col, fmt in zip(cols, formats):
        data: Any = functools.partial(_safe_bytes, fig, df, stem, fmt)
        if not DEFERRED_DOWNLOADS:
            data = data()
        col.download_button(
            fmt.upper(), data=data, file_name=f"{stem}.{fmt}", mime=MIME[fmt], key=f"{key}-{fmt}", **_DOWNLOAD_KW
        )
    if not static_ok:
        st.caption(static_msg)


def _safe_bytes(fig, df, stem: str, fmt: str) -> bytes:
    try:
        return figure_bytes(fig, df, stem, fmt)
    except Exception as exc:  # noqa: BLE001 - runs on click, outside the page; the file says what failed
        log.exception("export %s.%s failed", stem, fmt)
        return f"k3lab could not export {stem}.{fmt}: {type(exc).__name__}: {exc}\n".encode()


def figure_card(fig, df, key: str, stem: str, description: str = "") -> None:
    """A figure with its caption and an Export popover."""
    with st.container(border=True):
        show_figure(fig, key=f"fig-{key}")
        left, right = st.columns([5, 1])
        if description:
            left.caption(description)
        with right.popover("Export", **_POPOVER_KW):
            export_buttons(fig, df, stem, key)


def render_view(view, loaded: Loaded) -> bool:
    """Draw one View; NotApplicable becomes an info line, a failure an error line. True when drawn."""
    from analysis.views import NotApplicable

    try:
        fig, df = state.build_view(view, loaded)
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
    stem = f"{_slug(loaded.ctx.label)}_{view.key}"
    figure_card(fig, df, key=view.key, stem=stem, description=view.description)
    return True


def section_views(section: str) -> list:
    from analysis.views import all_views

    return [v for v in all_views() if v.section == section]


def render_section(section: str, loaded: Loaded) -> int:
    """Every View of a section, in catalogue order. Returns how many were drawn."""
    views = section_views(section)
    if not views:
        st.info(f"No figures are registered for the '{section}' section (analysis/figures/{section}.py).")
        return 0
    return sum(render_view(view, loaded) for view in views)


def _slug(text: str) -> str:
    out = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(text)).strip("-")
    return out or "run"


def page_header(title: str, intro: str) -> None:
    st.title(title)
    st.caption(intro)


def run_line(loaded: Loaded) -> None:
    """One caption naming what is shown: run, tokens, text source, loss."""
    loss = state.trace_loss(loaded.ctx.trace)
    loss_txt = f" · loss {loss:.3f} nats/token" if loss is not None else ""
    st.caption(
        f"**{loaded.ctx.label}** · {loaded.tokens.n:,} tokens of {loaded.tokens.source}{loss_txt} · "
        f"{loaded.key[1]}/{loaded.key[2]}"
    )


def section_page(section: str, title: str, intro: str) -> None:
    """A mechanism page: every View of one section for the sidebar's run and text."""
    inputs = inputs_or_stop()
    page_header(title, intro)
    loaded = load_or_stop(inputs)
    show_input_notes(loaded)
    run_line(loaded)
    render_section(section, loaded)


# ----------------------------------------------------------------------------------------- overview bits
DATAFRAME_KW = {"width": "stretch"} if _accepts(st.dataframe, "width") else {"use_container_width": True}


def layer_badges(cfg) -> str:
    """The layer map as a row of coloured badges: KDA blue, MLA red; MoE layers marked with a dot."""
    parts = []
    for i, kind in enumerate(cfg.layer_types()):
        colour = "red" if kind == "MLA" else "blue"
        moe = "·moe" if cfg.is_moe_layer(i) else ""
        parts.append(f":{colour}-background[{i}&nbsp;{kind}{moe}]")
    return " ".join(parts)


KEY_HEADLINES = (
    "loss",
    "bits_per_byte",
    "mla_entropy_norm_mean",
    "sink_rate",
    "block_influence_mean",
    "moe_maxvio_max",
    "attnres_embedding_weight_mean",
    "kda_horizon_median",
)


def headline_metrics(loaded: Loaded) -> None:
    """analysis.compare.headline_numbers of the run: the key ones as metrics, all of them in a table."""
    import pandas as pd

    try:
        from analysis.compare import HEADLINE_LABELS

        numbers = state.headline(loaded)
    except Exception as exc:  # noqa: BLE001
        log.exception("headline numbers failed")
        st.error(f"Headline numbers could not be computed: {type(exc).__name__}: {exc}")
        return
    keys = [k for k in KEY_HEADLINES if k in numbers]
    per_row = 4
    for start in range(0, len(keys), per_row):
        cols = st.columns(per_row)
        for col, key in zip(cols, keys[start : start + per_row]):
            label = HEADLINE_LABELS.get(key, key)
            col.metric(label, format_number(numbers[key]), help=f"`{key}`")
    rows = [
        {"metric": k, "description": HEADLINE_LABELS.get(k, k), "value": v} for k, v in numbers.items() if k != "label"
    ]
    table = pd.DataFrame(rows)
    with st.expander("All headline numbers"):
        shown = table.assign(value=[format_number(v) for v in table["value"]])
        st.dataframe(shown, hide_index=True, height=table_height(len(shown)), **DATAFRAME_KW)
        stem = f"{_slug(loaded.ctx.label)}_headline"
        c1, c2, _ = st.columns([1, 1, 6])
        c1.download_button(
            "CSV", data=table.to_csv(index=False), file_name=f"{stem}.csv", mime=MIME["csv"], key="k3lab_head_csv"
        )
        c2.download_button(
            "JSON",
            data=table.to_json(orient="records", indent=2),
            file_name=f"{stem}.json",
            mime=MIME["json"],
            key="k3lab_head_json",
        )


def table_height(rows: int) -> int:
    """Pixel height that shows every row of an st.dataframe (35 px a row plus the header)."""
    return 35 * (rows + 1) + 3


def format_number(value: Any) -> str:
    """Compact display of a headline number."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}"
    return str(value)


# ----------------------------------------------------------------------------------------- comparison
def short_source(choice: TextChoice) -> str:
    """A short name for a text choice: 'Shakespeare', 'MQAR', 'notes.txt', 'pasted text'."""
    if choice.source == state.TEXT_UPLOAD and choice.name:
        return choice.name
    return {
        state.TEXT_SHAKESPEARE: "Shakespeare",
        state.TEXT_MQAR: "MQAR",
        state.TEXT_REPEAT: "repeat",
        state.TEXT_PASTE: "pasted text",
    }.get(choice.source, choice.source)


def headline_delta(a: Loaded, b: Loaded) -> None:
    """analysis.compare.headline_table of two runs (A, B, delta = A - B) with CSV/JSON export."""
    from analysis.compare import headline_table

    try:
        table = headline_table(state.headline(a), state.headline(b))
    except Exception as exc:  # noqa: BLE001
        log.exception("headline table failed")
        st.error(f"Headline numbers could not be compared: {type(exc).__name__}: {exc}")
        return
    shown = table.rename(columns={"a": f"A: {a.ctx.label}", "b": f"B: {b.ctx.label}", "delta": "A - B"})
    st.dataframe(shown.drop(columns=["metric"]), hide_index=True, height=table_height(len(shown)), **DATAFRAME_KW)
    c1, c2, _ = st.columns([1, 1, 6])
    stem = f"{_slug(a.ctx.label)}_vs_{_slug(b.ctx.label)}_headline"
    c1.download_button(
        "CSV", data=table.to_csv(index=False), file_name=f"{stem}.csv", mime=MIME["csv"], key="k3lab_cmp_head_csv"
    )
    c2.download_button(
        "JSON",
        data=table.to_json(orient="records", indent=2),
        file_name=f"{stem}.json",
        mime=MIME["json"],
        key="k3lab_cmp_head_json",
    )


def render_comparison(view, a: Loaded, b: Loaded) -> None:
    """One view for A and B: side by side (shared axes) and, where the tables align, the difference A - B."""
    from analysis.views import NotApplicable

    stem = f"{_slug(a.ctx.label)}_vs_{_slug(b.ctx.label)}_{view.key}"
    try:
        fig, df = state.compare_view("side", view, a, b)
    except NotApplicable as exc:
        st.info(f"**{view.title}**: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("comparison %s failed", view.key)
        st.error(f"**{view.title}** could not be compared: {type(exc).__name__}: {exc}")
        return
    figure_card(fig, df, key=f"cmp-{view.key}", stem=stem, description=view.description)
    try:
        dfig, ddf = state.compare_view("diff", view, a, b)
    except NotApplicable as exc:
        st.caption(f"No difference view for {view.title}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        log.exception("difference %s failed", view.key)
        st.caption(f"No difference view for {view.title}: {type(exc).__name__}: {exc}")
        return
    with st.expander(f"Difference A - B: {view.title}"):
        figure_card(dfig, ddf, key=f"diff-{view.key}", stem=f"{stem}_diff")


# ----------------------------------------------------------------------------------------- history
def history_context(run: RunRef, overlays: list[RunRef]) -> Loaded | None:
    """A context for the history views: the run's metrics.json plus overlays; no model or forward needed."""
    from analysis.views import AnalysisContext
    from k3core.checkpoint import load_config
    from k3core.trace import Trace

    try:
        config = load_config(run.path)
    except CheckpointError as exc:
        st.error(f"**{run.label}**: {exc}")
        return None
    metrics = state.run_metrics(run)
    overlay = {r.label: state.run_metrics(r) for r in overlays}
    ctx = AnalysisContext(
        trace=Trace(), config=config, metrics=metrics, label=run.label, options={"overlay_metrics": overlay}
    )
    key = (
        "history",
        run.label,
        state.metrics_digest(metrics),
        tuple((label, state.metrics_digest(m)) for label, m in overlay.items()),
    )
    return Loaded(run=run, model=None, ctx=ctx, key=key, tokens=None)
