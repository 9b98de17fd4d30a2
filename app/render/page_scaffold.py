"""What every page does first: get the sidebar's inputs, load the run (or stop with a clear message), title.

``load_or_stop`` is the pages' one way to a traced run (``app.render.caching.load``); a bad checkpoint, text or
device becomes an ``st.error`` and stops the page, never an exception. Long inputs, the importance
ablations and each view that runs the model (``analysis.figures.papers.MODEL_RUNS``) are run only when the user
asks, on their own button with their cost stated first and progress that says what is running; Streamlit's Stop
(or any new input) cancels them between forward passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import streamlit as st

from analysis.figures.papers import MODEL_RUNS, ModelRun
from analysis.metrics.importance import sublayer_importance
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import Run
from analysis.runs.texts import Input
from analysis.views.catalogue import all_views, section_views
from analysis.views.view import NotApplicable, View
from app import page_registry
from app.library import memory_fit, run_messages
from app.library.run_list import RunRef
from app.render import caching, cards
from app.render.caching import Loaded
from app.render.errors import USER_ERRORS, describe, md_escape, plain
from app.render.model_use import model_use
from app.render.prefetch import prefetch
from app.render.twin import twin_toggle
from app.server import job_budget
from app.state.inputs import (
    LONG_INPUT_TOKENS,
    MAX_TOKENS_CAP,
    TEXT_PASTE,
    TEXT_UPLOAD,
    Inputs,
    TextChoice,
    current_inputs,
    options_key,
)
from k3core.interp.trace import Trace
from k3core.loading.pretrained import load_config
from k3core.loading.tensor_info import CheckpointError

log = logging.getLogger("k3lab.app")

# A list of more than LAZY_SECTION views draws its first EAGER_VIEWS at once, the rest on request (draw_lazily): a
# toggle never hides a single figure. Comparisons (two runs side by side) use the same numbers.
LAZY_SECTION = 4
EAGER_VIEWS = 3
IMPORTANCE = "sublayer_importance"  # the AnalysisContext.once key of analysis.figures.density's importance


def page_header(name: str, intro: str) -> None:
    """The page's heading (its registered title, ``app.page_registry``) and its introduction."""
    st.title(page_registry.page(name).title)
    st.caption(intro)


def inputs_or_stop() -> Inputs:
    """The sidebar inputs; stops the page with a message when there is no run to show."""
    inputs = current_inputs()
    if inputs is None or inputs.run is None:
        st.info(f"No run selected. Add a checkpoint on the {page_registry.page('runs_library').mention}.")
        st.stop()
    return inputs


def run_error(ref: RunRef, exc: BaseException) -> str:
    """'**run**: message' for a user error of a run, Markdown-escaped; the message's own lead naming the run is dropped
    (a trace folder's errors name it first: 'tr: trace-1.npz: ...' is shown once, as '**tr**: trace-1.npz: ...')."""
    text = run_messages.message(exc, ref)
    text = text.removeprefix(f"{ref.label}: ").removeprefix(f"{ref.label}/")
    return f"**{md_escape(ref.label)}**: {plain(text)}"


def run_or_stop(inputs: Inputs, ref: RunRef | None = None, needs_weights: bool = False) -> Run:
    """The loaded run (cached); on a bad checkpoint, device or failure shows st.error and stops the page. A page
    loads it once and hands it on (``load_or_stop(run=...)``). A trace folder's run has no
    model (``Run.model`` None; ``caching.shape_model`` gives its shapes); with ``needs_weights`` the page says it
    needs the checkpoint and stops."""
    ref = ref or inputs.run
    _stop_if_too_big(inputs, ref)
    try:
        run = caching.load_run(ref, inputs.device, inputs.dtype)
    except USER_ERRORS as exc:
        error = run_error(ref, exc)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: say so, keep the app running
        log.exception("loading %s failed", ref.path)
        error = f"**{md_escape(ref.label)}** could not be loaded on {inputs.device}/{inputs.dtype}: {describe(exc)}"
    else:
        if run.model is None and needs_weights:
            st.info(
                f"**{md_escape(ref.label)}** is a trace folder without its weights: this page needs the checkpoint."
            )
            st.stop()
        return run
    st.error(error)
    st.stop()


def _stop_if_too_big(inputs: Inputs, ref: RunRef) -> None:
    """A run whose weights cannot fit in the device's free memory gets a message, never an out-of-memory crash.
    With a memory budget the run streams from its files instead: its plan first, then it runs when asked."""
    if inputs.max_memory:
        _confirm_streamed(inputs, ref)
        return
    problem = memory_fit.fit_problem(ref, inputs.device, inputs.dtype)
    if problem:
        st.error(problem)
        st.stop()


def _confirm_streamed(inputs: Inputs, ref: RunRef) -> None:
    """Show the streaming plan (what stays, what streams, bytes and expected time) and run only when asked;
    a Stop button while it runs. Drawn once per script run (a page may ask for the model, then the trace)."""
    try:
        plan = memory_fit.stream_plan(ref.path, inputs.device, inputs.dtype, inputs.max_memory)
    except (CheckpointError, ValueError) as exc:
        st.error(run_error(ref, exc))
        st.stop()
    tokens = inputs.text.max_tokens
    key = (ref.path, inputs.device, inputs.dtype, inputs.max_memory, inputs.text.key())
    confirmed = st.session_state.setdefault("k3lab_stream_confirmed", set())
    if st.session_state.get("k3lab_stream_drawn"):
        if key not in confirmed:
            st.stop()
        return
    st.session_state["k3lab_stream_drawn"] = True
    st.info(
        f"**{md_escape(ref.label)}** runs from its files within {inputs.max_memory}:\n```\n{plan.describe(tokens)}\n```"
    )
    if key not in confirmed:
        gb, seconds = plan.prompt_bytes(tokens) / 1e9, plan.expected_seconds(tokens)
        label = f"Run streamed (reads up to {gb:,.1f} GB, about {seconds:,.0f} s)"
        if not st.button(label, key="k3lab_stream_run", type="primary"):
            st.stop()
        confirmed.add(key)
    if st.button("Stop", key="k3lab_stream_stop"):
        confirmed.discard(key)
        st.warning("Stopped. The plan above still holds; run it again when you like.")
        st.stop()


def _streaming_progress(run: Run):
    """A progress bar (layer i of N, bytes read, expert cache hits) on a streamed run's forward; its remover."""
    loading = getattr(run.model, "loading", None)  # run.model is None for a trace folder
    session = loading.streaming if loading is not None else None
    if session is None:
        return lambda: None
    bar = st.empty()

    def progress(info: dict) -> None:
        bar.progress(
            (info["layer"] + 1) / info["layers"],
            text=f"layer {info['layer'] + 1} of {info['layers']}: {info['bytes_read'] / 1e9:,.2f} GB read, expert "
            f"cache {info['expert_hits']:,} hits / {info['expert_misses']:,} misses",
        )

    session.progress = progress

    def remove() -> None:
        session.progress = None
        bar.empty()

    return remove


def _confirm_long_input(inputs: Inputs, ref: RunRef, run: Run, tokens: Input, choice: TextChoice) -> None:
    """Above LONG_INPUT_TOKENS, say what a forward will cost and run it only when the user says so."""
    if tokens.n <= LONG_INPUT_TOKENS:
        return
    key = (run.fingerprint, inputs.device, inputs.dtype, tokens.digest, caching.trace_items(inputs.record_attn))
    confirmed = st.session_state.setdefault("k3lab_confirmed", set())
    if key in confirmed or caching.is_traced(key):
        return
    measured = caching.forward_speed(run.fingerprint, inputs.device, inputs.dtype)
    if measured:
        low, high = caching.forward_seconds_range(measured, tokens.n)
        span = f"{low:,.0f} s" if high < 1.5 * low else f"{low:,.0f}-{high:,.0f} s"
        estimate = f"about {span} on an idle server, measured on {measured[1]:,} tokens"
    else:
        estimate = "not measured yet for this run"
    running = len(job_budget.budget().running)
    if running:
        estimate += f"; {running} other job(s) running now make it longer"
    if tokens.n > choice.max_tokens:  # a recorded text of a trace folder: max tokens does not shorten it
        reads = f"{tokens.n:,} recorded tokens (a trace folder's text; *Max tokens* does not shorten it)"
        advice = "Pick another recorded text, or run it."
    else:
        reads = f"{tokens.n:,} tokens (max tokens is {choice.max_tokens:,}; at most {MAX_TOKENS_CAP:,})"
        advice = "Lower *Max tokens* in the sidebar, or run it."
    banner = st.empty()  # the question and its button, gone once answered (not left above the charts)
    with banner.container():
        st.warning(
            f"**{ref.label}** will read {reads}. One forward pass with recording: {estimate}. The importance "
            f"ablations take {2 * run.config.num_hidden_layers + 2} more. {advice}"
        )
        go = st.button(f"Run on {tokens.n:,} tokens", key=f"k3lab_confirm_{hash(key)}", type="primary")
    if not go:
        st.stop()
    banner.empty()
    confirmed.add(key)


def load_or_stop(
    inputs: Inputs,
    ref: RunRef | None = None,
    choice: TextChoice | None = None,
    label: str | None = None,
    text_error: str | None = None,
    edits: str = "",
    run: Run | None = None,
) -> Loaded:
    """Run + trace + context for a run, each loaded once (``app.render.caching``: the run, its tokens, the trace;
    ``run`` when the page has loaded it already); a long input waits for the user's go; on a bad checkpoint or text
    shows st.error and stops the page. ``edits`` (JSON of ``k3core.interp.interventions`` edits): the edited forward's
    trace."""
    ref = ref or inputs.run
    if choice is None:
        choice, text_error = inputs.text, inputs.text_error
    if text_error:
        st.error(md_escape(text_error))
        st.stop()
    if run is None:
        _stop_if_too_big(inputs, ref)
    done = lambda: None  # noqa: E731 - replaced by the streamed run's progress remover
    try:
        run = run or caching.load_run(ref, inputs.device, inputs.dtype)
        tokens = caching.make_tokens(choice, run)
        _confirm_long_input(inputs, ref, run, tokens, choice)
        done = _streaming_progress(run)
        loaded = caching.trace(ref, run, tokens, inputs.record_attn, inputs.options(), label, edits)
    except USER_ERRORS as exc:
        error = run_error(ref, exc)
    except Exception as exc:  # noqa: BLE001 - a failed forward must not take the app down
        log.exception("loading %s failed", ref.path)
        error = f"**{md_escape(ref.label)}** could not be run on {inputs.device}/{inputs.dtype}: {describe(exc)}"
    else:
        for note in loaded.notes:
            st.warning(note)
        return loaded
    finally:
        done()
    st.error(error)
    st.stop()


def show_input_notes(loaded: Loaded) -> None:
    """A notice when the text was cut to max tokens (a warning for the user's own text)."""
    tok = loaded.tokens
    if tok.truncated:
        about = "" if tok.total_exact else "about "
        msg = (
            f"Reading the first {tok.n:,} of {about}{tok.total:,} tokens of the text (max tokens in the sidebar, at "
            f"most {MAX_TOKENS_CAP:,})."
        )
        if tok.source.startswith((TEXT_PASTE, TEXT_UPLOAD)):  # the user's own text
            st.warning(msg)
        else:
            st.caption(msg)


def run_line(loaded: Loaded) -> None:
    """One caption naming what is shown: run, tokens, text source, loss, device and dtype."""
    loss = loaded.ctx.loss
    loss_txt = f" · loss {loss:.3f} nats/token" if loss is not None else ""
    made = loaded.run.card.get("trace_folder") if loaded.run.recorded is not None else None
    where = ""
    if made:  # a trace folder: where and how it was recorded (its run card)
        procs = int(made.get("world_size") or 1)
        where = f" · recorded {md_escape(str(made.get('time', '?')))} on {md_escape(str(made.get('host', '?')))}" + (
            f" by {procs} pipeline ranks" if procs > 1 else ""
        )
    st.caption(
        f"**{loaded.ctx.label}** · {loaded.tokens.n:,} tokens of {md_escape(loaded.tokens.source)}"
        f"{loss_txt} · {loaded.run.device}/{loaded.run.dtype}{where}"
    )


def importance_or_button(view: View, loaded: Loaded) -> bool:
    """True when the importance ablations are measured for this run and text; else a button to run them.

    They run once per (run, text), shared by every session and every sidebar option, with a progress bar."""
    ctx = loaded.ctx
    if IMPORTANCE in ctx.shared:
        return True
    n_layers = loaded.run.config.num_hidden_layers
    caption = (
        f"{view.description} Needs {2 * n_layers + 1} forward passes (one per zeroed sub-layer) and one "
        f"forward + backward on the {loaded.tokens.n:,} tokens; run once per run and text."
    )

    def measure(bar: Any) -> None:
        def progress(done: int, total: int, what: str) -> None:
            bar.progress(min(done / max(total, 1), 1.0), text=f"{what} ({done}/{total})")

        ctx.once(IMPORTANCE, lambda: sublayer_importance(ctx.model, ctx.input_ids, progress=progress))

    return _measure_card(
        view, caption, "Measure layer importance", f"k3lab_importance_{view.key}", "Layer importance", measure, loaded
    )


def model_run_or_button(view: View, run: ModelRun, loaded: Loaded) -> bool:
    """True when the model run of ``view`` is measured for this run and text (or does not apply: its card says why);
    else a card with the run's cost and its own button, which runs it with a progress bar."""
    ctx = loaded.ctx
    if run.measured(ctx):
        return True
    try:
        cost = run.cost(ctx)
    except NotApplicable:
        return True

    def measure(bar: Any) -> None:
        def progress(done: int, total: int) -> None:  # each update is where Streamlit's Stop ends the run
            bar.progress(min(done / max(total, 1), 1.0), text=f"forward pass {done} of {total}")

        run.table(ctx, progress)

    return _measure_card(
        view, f"{view.description} {cost}", run.button, f"k3lab_run_{view.key}", view.title, measure, loaded
    )


def _measure_card(
    view: View, caption: str, label: str, key: str, done: str, measure: Callable[[Any], None], loaded: Loaded
) -> bool:
    """A card with the view's title, what measuring it costs and its button; False until the button is pressed.
    Once pressed, the card goes (the figure drawn below takes its place; a card left above the finished figure
    asked again for what was done) and ``measure(bar)`` runs under a status line with a progress bar."""
    slot = st.empty()
    with slot.container(border=True):
        st.markdown(f"**{view.title}**")
        st.caption(caption)
        pressed = st.button(label, key=key, type="primary")
    if not pressed:
        return False
    slot.empty()
    with st.status(f"{label}...", expanded=True) as status:
        bar = st.progress(0.0)
        start = time.perf_counter()
        with model_use(loaded.model, exclusive=True):
            measure(bar)
        status.update(label=f"{done} measured in {time.perf_counter() - start:.1f} s", state="complete")
    return True


def run_or_button(view: View, loaded: Loaded) -> bool:
    """For a view that runs the model: True when its numbers are there, else its button (its own run, or the
    importance ablations)."""
    if view.key in MODEL_RUNS:
        return model_run_or_button(view, MODEL_RUNS[view.key], loaded)
    return importance_or_button(view, loaded)


def _render_view(view: View, loaded: Loaded) -> int:
    if view.needs_model and loaded.model is not None:
        on_request_card(view, loaded)
        return 0
    return cards.render_view(view, loaded)


def _show_the_rest(key: str, rest: list[View]) -> bool:
    """A toggle that draws a list's other figures; the choice is kept for the session (Streamlit forgets a
    widget's value when its page is left, so it is copied to a key of its own)."""
    keep, widget = f"k3lab_show_all_{key}", f"k3lab_show_all_{key}_toggle"
    if widget not in st.session_state:
        st.session_state[widget] = bool(st.session_state.get(keep, False))
    titles = "; ".join(v.title for v in rest)
    on = st.toggle(
        f"Show the other {len(rest)} figures",
        key=widget,
        help=f"{titles}. Drawn on request: the page opens faster with its first figures only.",
    )
    st.session_state[keep] = on
    if not on:
        st.caption(f"Also on this page: {titles}.")
    return on


def draw_lazily(key: str, views: list[View], draw: Callable[[View], int | bool | None]) -> int:
    """Draw a page's views: a list of more than LAZY_SECTION draws its first EAGER_VIEWS at once and the others when
    the user turns them on (a toggle naming them, kept per session under ``key``). Returns what ``draw`` counted.

    Why: a page switch with nothing changed is the browser redrawing its plotly charts (the script itself reruns in
    0.1-0.2 s on the samples); each chart costs it tens of milliseconds on the 2-core machine, so a page of 8-12
    charts misses issue 27's 0.5 s second visit (``benchmarks/bench_pages.py``)."""
    first, rest = (views[:EAGER_VIEWS], views[EAGER_VIEWS:]) if len(views) > LAZY_SECTION else (views, [])
    drawn = sum(int(draw(v) or 0) for v in first)
    if rest and _show_the_rest(key, rest):
        drawn += sum(int(draw(v) or 0) for v in rest)
    return drawn


def measured_first(views: list[View]) -> tuple[list[View], list[View]]:
    """(views measured on the text, views drawn from the config or the weights alone), each in catalogue order."""
    derived = [v for v in views if v.from_config or v.from_weights]
    return [v for v in views if v not in derived], derived


def render_section(section: str, loaded: Loaded, twin: Loaded | None = None) -> int:
    """Every View of a section (importance on request): the views measured on the text at once, those drawn from the
    config or the weights alone on request (a toggle naming them, kept per session). With ``twin`` (the run's
    untrained twin, ``app.render.twin``), each view beside the twin's. Returns how many were drawn."""
    views = section_views(section)
    if not views:
        st.info(f"No figures are registered for the '{section}' section (analysis/figures/{section}.py).")
        return 0
    if twin is not None:

        def draw(view: View) -> int:
            if view.needs_model and not (run_or_button(view, loaded) and run_or_button(view, twin)):
                return 0
            cards.render_comparison(view, loaded, twin)
            return 1
    else:
        draw = lambda view: _render_view(view, loaded)  # noqa: E731
    measured, derived = measured_first(views)
    drawn = sum(int(draw(v) or 0) for v in measured)
    if derived and _show_the_rest(section, derived):
        drawn += sum(int(draw(v) or 0) for v in derived)
    return drawn


@st.fragment
def on_request_card(view: View, loaded: Loaded) -> None:
    """A view that runs the model, measured on request; its button reruns only this card (st.fragment)."""
    if run_or_button(view, loaded):
        cards.render_view(view, loaded)


def prefetch_sections(loaded: Loaded) -> None:
    """Build the other mechanism pages' figures for this run and text in the background (app.render.prefetch)."""
    prefetch([v for v in all_views() if v.section in page_registry.COMPARE_SECTIONS], loaded)


def render_section_page(name: str, intro: str) -> None:
    """A mechanism page: every View of its registered section (``app.page_registry``) for the sidebar's run and text."""
    inputs = inputs_or_stop()
    page_header(name, intro)
    loaded = load_or_stop(inputs)
    show_input_notes(loaded)
    run_line(loaded)
    twin = twin_toggle(inputs, loaded, name)
    render_section(page_registry.page(name).section, loaded, twin)
    prefetch_sections(loaded)


def config_context(inputs: Inputs, ref: RunRef | None = None) -> Loaded | None:
    """A context for views drawn from the config alone (the layer map), read from the run's config.json: no weights,
    tokens or forward pass, so a page can draw them before the model loads: at once while a big checkpoint loads
    for minutes, and for one too big to load here at all. None when the config cannot be read: the page's
    ``run_or_stop`` says why."""
    ref = ref or inputs.run
    try:
        config = load_config(ref.path)
        fingerprint = caching.run_fingerprint(ref.path)
    except USER_ERRORS:
        return None
    options = inputs.options()
    ctx = AnalysisContext(
        trace=Trace(), config=config, metrics=caching.run_metrics(ref), label=ref.label, options=options
    )
    key = ("config", fingerprint, inputs.device, inputs.dtype, ref.label, options_key(options))
    return Loaded(ref=ref, run=None, ctx=ctx, key=key, tokens=None)


def history_context(ref: RunRef, overlays: list[RunRef]) -> Loaded | None:
    """A context for the history views: the run's metrics.json plus overlays; no model or forward needed."""
    try:
        config = load_config(ref.path)
    except CheckpointError as exc:
        st.error(run_error(ref, exc))
        return None
    metrics = caching.run_metrics(ref)
    overlay = {r.label: caching.run_metrics(r) for r in overlays}
    ctx = AnalysisContext(
        trace=Trace(), config=config, metrics=metrics, label=ref.label, options={"overlay_metrics": overlay}
    )
    key = (
        "history",
        ref.label,
        caching.metrics_digest(metrics),
        tuple((label, caching.metrics_digest(m)) for label, m in overlay.items()),
    )
    return Loaded(ref=ref, run=None, ctx=ctx, key=key, tokens=None)
