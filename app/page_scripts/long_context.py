"""Long context: the sidebar's run far into one long text (the cost estimate first, then progress and Stop).

The length chooser offers powers of two up to the longest length whose estimated memory fits this machine
(``analysis.experiments.long_runs.estimate_cost``: one calibration forward scaled by the FLOP model). The trace covers
every position (bulky arrays windowed at WINDOW tokens, ``k3core.interp.recorder``); the views are
``analysis.figures.long_context``. Recall by distance, cost by length and MQAR accuracy by length run the model again,
each on its own button with progress and Stop.
"""

from __future__ import annotations

import time

import streamlit as st

from analysis.experiments import long_runs as lr
from analysis.figures import long_context as fl
from analysis.figures.papers import MODEL_RUNS, MQAR_VIEW
from analysis.output.format import format_bytes
from analysis.runs import texts
from analysis.runs.loading import trace_run
from app.render import caching, cards, page_scaffold
from app.render.caching import Loaded
from app.render.model_use import model_use
from app.state.inputs import SAMPLE_OF_SOURCE, TEXT_SHAKESPEARE
from k3core.modeling.hooks import HookNames, hooks

WINDOW = 1024  # bulky per-token arrays (hidden states, KDA decays) keep this many positions
LENGTHS = tuple(1024 * 2**k for k in range(11))  # 1K .. 1M
MEMORY_SHARE = 0.6  # of the memory available now: the most a long run may plan to use
TRACE_VIEWS = (
    "long_loss_by_position",
    "long_kda_state",
    "long_decay_horizon",
    "long_mla_position",
    "long_kda_distance",
)


def _available_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else the physical memory."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return lr.machine_memory_bytes()


@st.cache_resource(show_spinner=False, max_entries=8)
def _estimate(fingerprint: str, _model) -> object:
    with model_use(_model):
        return lr.estimate_cost(_model, LENGTHS)


def _input(run, choice, n: int):
    """The sidebar's text (a built-in sample, or the user's own) read to n tokens."""
    source = choice.source if choice.source in SAMPLE_OF_SOURCE else None
    if source is None and choice.text:
        return texts.text_input(
            choice.text[: 64 * n], run.config, n, name=choice.name or "text", tokenizer=run.tokenizer
        )
    name = SAMPLE_OF_SOURCE.get(choice.source or TEXT_SHAKESPEARE, "shakespeare")
    return texts.sample_input(name, run.config, n, run.tokenizer)


def _trace_with_progress(run, tokens, bar) -> object:
    """trace_run on the tokens, the bar moving layer by layer (a read hook on each layer's input; the bar's update
    is where a Stop click ends the run)."""
    n_layers = run.config.num_hidden_layers
    start = time.perf_counter()

    def at_layer(i: int):
        def hook(value, name, info):
            bar.progress(i / (n_layers + 1), text=f"layer {i + 1} of {n_layers} ({time.perf_counter() - start:.0f} s)")

        return hook

    table = {HookNames.block(i, "resid_in"): at_layer(i) for i in range(n_layers)}
    with model_use(run.model), hooks(read=table):
        ctx = trace_run(run, tokens, what="all", label=run.label, window=WINDOW)
    bar.progress(1.0, text=f"recorded {tokens.n:,} tokens in {time.perf_counter() - start:.1f} s")
    return ctx


def _measure(title: str, key: str, compute, done_caption: str) -> None:
    """A button that runs ``compute(progress)`` with a progress bar; clicking Stop while it runs ends it."""
    if st.session_state.get(key):
        return
    if st.button(title, key=f"{key}_go", type="primary"):
        stop = st.empty()
        stop.button("Stop", key=f"{key}_stop", help="Ends the measurement at its next step; nothing is kept.")
        bar = st.progress(0.0)
        compute(lambda done, total: bar.progress(done / max(total, 1), text=f"{done} of {total}"))
        st.session_state[key] = True
        bar.empty()
        stop.empty()
        st.caption(done_caption)


inputs = page_scaffold.inputs_or_stop()
page_scaffold.page_header(
    "long_context",
    "How the run behaves far into one long text: loss by position against its short-context loss, KDA state "
    "norm and rank and the decay horizon used, MLA entropy and sink mass over position, recall by distance, and "
    "seconds and memory per token against length. Every diagnostic covers every position.",
)
try:
    run = caching.load_run(inputs.run, inputs.device, inputs.dtype)
except Exception as exc:  # noqa: BLE001 - a bad checkpoint is a message, not a crash
    st.error(f"**{inputs.run.label}** could not be loaded: {exc}")
    st.stop()

if run.model is None:  # a trace folder: its recorded text, as recorded
    loaded = page_scaffold.load_or_stop(inputs, run=run)
    st.caption("A trace folder: its recorded text is shown as recorded (no model to run longer texts).")
    for view in fl.VIEWS:
        cards.render_view(view, loaded)
    st.stop()

estimate = _estimate(run.fingerprint, run.model)
budget = MEMORY_SHARE * _available_bytes()
largest = max(lr.largest_length(estimate, budget), LENGTHS[0])
offered = [n for n in LENGTHS if n <= largest]
by_length = estimate.set_index("seq_len")
cal = estimate.attrs["calibration"]
length = st.select_slider(
    "Length (tokens)",
    options=offered,
    value=offered[0],  # the cheapest; the estimate says what a longer one costs
    format_func=lambda n: f"{n // 1024}K",
    key="k3lab_long_length",
    help=f"Up to the longest length whose estimated memory fits {MEMORY_SHARE:.0%} of the memory available now "
    f"({format_bytes(_available_bytes())}).",
)
row = by_length.loc[length]
st.info(
    f"**Estimate for {length:,} tokens:** about {row['seconds']:,.0f} s and {format_bytes(row['bytes'])} of memory "
    f"(scaled from a {cal['tokens']}-token forward with recording, {cal['seconds']:.2f} s: time by the FLOP count, "
    "memory linearly, as every attention path is O(T) in memory). "
    f"The longest this machine can do: {largest:,} tokens."
)
try:
    tokens = _input(run, inputs.text, length)
except ValueError as exc:
    st.error(str(exc))
    st.stop()
if tokens.n < length:
    st.warning(f"The text has only {tokens.n:,} tokens: all of them are read.")
state_key = ("k3lab_long", run.fingerprint, tokens.digest)
ctx = st.session_state.get("k3lab_long_ctx", {}).get(state_key)
if ctx is None:
    ask = st.empty()  # the Run button, gone once clicked (not left above the charts)
    if not ask.button(f"Run on {tokens.n:,} tokens", key="k3lab_long_run", type="primary"):
        st.stop()
    ask.empty()
    stop = st.empty()
    stop.button("Stop", key="k3lab_long_stop", help="Ends the run at its next layer; nothing is kept.")
    bar = st.progress(0.0, text="starting")
    try:
        ctx = _trace_with_progress(run, tokens, bar)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: a message, the app keeps running
        st.error(f"The run on {tokens.n:,} tokens failed: {type(exc).__name__}: {exc}")
        st.stop()
    stop.empty()
    st.session_state["k3lab_long_ctx"] = {state_key: ctx}  # one long trace per session (the newest)

loaded = Loaded(ref=inputs.run, run=run, ctx=ctx, key=state_key, tokens=tokens)
loss = ctx.loss
st.caption(
    f"**{ctx.label}** · {tokens.n:,} tokens of {tokens.source or tokens.description or tokens.name}"
    + (f" · loss {loss:.3f} nats/token" if loss is not None else "")
    + f" · bulky arrays kept for the first {WINDOW:,} positions, every diagnostic over all {tokens.n:,}"
)
views = {v.key: v for v in fl.VIEWS}
for key in TRACE_VIEWS:
    cards.render_view(views[key], loaded)

st.subheader("Recall by distance")
distances = st.multiselect(
    "Distances (tokens from the value to its query)",
    [16, 64, 256, 1024, 4096, 16384],
    default=[16, 64, 256, 1024],
    key="k3lab_long_distances",
)
recall_ctx = ctx.with_options(recall_distances=tuple(sorted(distances)), recall_examples=32)
recall_key = f"k3lab_long_recall_{hash((state_key, tuple(sorted(distances))))}"
if distances:
    _measure(
        f"Measure recall at {len(distances)} distances (32 examples each)",
        recall_key,
        lambda progress: fl.recall_table(recall_ctx, progress=progress),
        "Recall measured.",
    )
    if st.session_state.get(recall_key):
        cards.render_view(
            views["long_recall_distance"], Loaded(inputs.run, run, recall_ctx, (*state_key, recall_key), tokens)
        )

st.subheader("Seconds and memory per token")
lengths = st.multiselect(
    "Lengths T", [n for n in (256, 1024, 4096, 16384, 65536) if n <= largest], default=[256, 1024, 4096],
    key="k3lab_long_cost_lengths",
)  # fmt: skip
cost_ctx = ctx.with_options(cost_lengths=tuple(sorted(lengths)))
cost_key = f"k3lab_long_cost_{hash((state_key, tuple(sorted(lengths))))}"
if lengths:
    _measure(
        f"Measure one forward at {len(lengths)} lengths",
        cost_key,
        lambda progress: fl.cost_table(cost_ctx, progress=progress),
        "Cost measured.",
    )
    if st.session_state.get(cost_key):
        cards.render_view(views["long_cost_length"], Loaded(inputs.run, run, cost_ctx, (*state_key, cost_key), tokens))

st.subheader(MQAR_VIEW.title)
if page_scaffold.model_run_or_button(MQAR_VIEW, MODEL_RUNS[MQAR_VIEW.key], loaded):
    cards.render_view(MQAR_VIEW, loaded)
