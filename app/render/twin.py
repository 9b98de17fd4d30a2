"""The untrained twin in the app: a toggle that draws a page's views beside the same views on randomly initialised
weights of the run's config (``analysis.runs.twin``), traced on the same tokens; a note where the run is too large
to build one, or has no model (a trace folder)."""

from __future__ import annotations

import streamlit as st

from analysis.runs.loading import Run
from analysis.runs.twin import TWIN_SUFFIX, config_digest, run_seed, twin_too_large, untrained_twin
from app.render import caching
from app.render.caching import Loaded
from app.render.errors import USER_ERRORS, describe


@st.cache_resource(show_spinner="Building the untrained twin (same config, random weights)...", max_entries=4)
def _twin_run(digest: str, seed: int, _run: Run) -> Run:
    return untrained_twin(_run, seed)


def twin_loaded(inputs, loaded: Loaded) -> Loaded | str:
    """The run's untrained twin traced on the same tokens and options (cached), or why there is none."""
    run = loaded.run
    if run is None or run.model is None:
        return "No untrained twin: this run has no model here (a trace folder, or the training history)."
    why = twin_too_large(run.config)
    if why:
        return why
    try:
        twin = _twin_run(config_digest(run.config), run_seed(run), run)
        label = f"{loaded.ctx.label}{TWIN_SUFFIX}"
        return caching.trace(loaded.ref, twin, loaded.tokens, inputs.record_attn, inputs.options(), label)
    except USER_ERRORS as exc:
        return f"No untrained twin: {describe(exc)}"


def twin_toggle(inputs, loaded: Loaded, page: str) -> Loaded | None:
    """A toggle "Beside its untrained twin" (kept per session); on: the twin's Loaded, else None (a note says why
    when there is no twin)."""
    keep, widget = "k3lab_twin", f"k3lab_twin_{page}"
    if widget not in st.session_state:
        st.session_state[widget] = bool(st.session_state.get(keep, False))
    on = st.toggle(
        "Beside its untrained twin",
        key=widget,
        help="Each view also drawn for the same config with random weights (the initialisation a `k3lab train` run of "
        "this config and seed starts from), traced on the same tokens: what the view shows before any training. "
        "Structure that the twin shows too comes from the architecture and initialisation, not from learning.",
    )
    st.session_state[keep] = on
    if not on:
        return None
    found = twin_loaded(inputs, loaded)
    if isinstance(found, str):
        st.info(found)
        return None
    return found
