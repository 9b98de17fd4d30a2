"""Compare: two runs on the same text, one run on two texts, or one run as it is and with the Experiment
page's edits (analysis.compare.two_runs)."""

from __future__ import annotations

import json

import streamlit as st

from analysis.compare.two_runs import distinct_labels, quantised_copy
from analysis.views.catalogue import section_views
from app import page_registry
from app.library import run_list
from app.render import cards, compare_experiment, page_scaffold
from app.render.errors import md_escape
from app.render.twin import twin_loaded
from app.state import links
from app.state.inputs import TEXT_MQAR, TEXT_SHAKESPEARE
from app.state.links import EDITED, EDITS, TWO_RUNS, TWO_TEXTS
from app.state.sidebar import text_choice

inputs = page_scaffold.inputs_or_stop()
page_scaffold.page_header(
    "compare",
    "Any view for two runs side by side on shared axes and colour ranges, the difference A - B where "
    "the two tables align, and the headline numbers with their delta. Run A and text A are the sidebar's.",
)

mode = st.radio(
    "Comparing", (TWO_RUNS, TWO_TEXTS, EDITED), horizontal=True, key="k3lab_cmp_mode", label_visibility="collapsed"
)
run_a = inputs.run
label_b = source_b = None
if mode == TWO_RUNS:
    others = [r for r in inputs.runs if r.label != run_a.label]
    if not others:
        st.info(
            f"Only one run is available: add another on the {page_registry.page('runs_library').mention}, "
            "or compare one run on two texts."
        )
        st.stop()
    c1, c2 = st.columns(2)
    c1.text_input("Run A (sidebar)", value=run_a.label, disabled=True, key="k3lab_cmp_a")
    if st.session_state.get("k3lab_cmp_run_b") not in [r.label for r in others]:
        # a first B that compares something: not A's own quantised copy (its deltas are ~1e-5 of rounding)
        st.session_state["k3lab_cmp_run_b"] = run_list.default_run_b(run_a, others).label
    label_b = c2.selectbox("Run B", [r.label for r in others], key="k3lab_cmp_run_b")
    run_b = next(r for r in others if r.label == label_b)
elif mode == EDITED:
    edits = st.session_state.get(EDITS) or []
    if not edits:
        st.info(f"No edits yet: build them on the {page_registry.page('experiment').mention}, then come back.")
        st.stop()
    st.caption("B = the sidebar's run and text with these edits: " + "; ".join(json.dumps(e) for e in edits))
    links.write_edits(edits)
else:
    c1, c2 = st.columns(2)
    recorded_a = inputs.text.recorded  # a trace folder: A and B are two of its recorded texts
    shown_a = inputs.text.source if recorded_a is None else inputs.text.short
    c1.text_input("Text A (sidebar)", value=shown_a, disabled=True, key="k3lab_cmp_text_a")
    with c2:
        default_b = TEXT_MQAR if inputs.text.source != TEXT_MQAR else TEXT_SHAKESPEARE
        choice_b, error_b = text_choice(
            "k3lab_cmp",
            max_tokens=inputs.text.max_tokens,
            default=default_b,
            label="Text B",
            ref=run_a,
            default_index=1 if recorded_a == 0 else 0,
        )
    source_b = choice_b.source

sections = page_registry.compare_sections()
section = st.radio("Views", list(sections), format_func=sections.get, horizontal=True, key="k3lab_cmp_section")
links.write_compare(mode, label_b, source_b, section, choice_b.recorded if mode == TWO_TEXTS else None)

if mode == TWO_RUNS:
    a = page_scaffold.load_or_stop(inputs, label=run_a.label)
    b = page_scaffold.load_or_stop(inputs, ref=run_b, label=run_b.label)
elif mode == EDITED:
    a = page_scaffold.load_or_stop(inputs, label="baseline")
    b = page_scaffold.load_or_stop(inputs, label="edited", edits=json.dumps(edits), run=a.run)
else:
    label_a, label_b = distinct_labels(inputs.text.short, choice_b.short)  # "A: "/"B: " come from the tables
    a = page_scaffold.load_or_stop(inputs, label=label_a)
    b = page_scaffold.load_or_stop(inputs, choice=choice_b, text_error=error_b, label=label_b, run=a.run)

if st.toggle(
    "B = A's untrained twin",
    key="k3lab_cmp_twin",
    help="Compare run A with the same config on random weights (seeded), traced on A's text: what every view shows "
    "before any training.",
):
    twin = twin_loaded(inputs, a)
    if isinstance(twin, str):
        st.info(twin)
    else:
        b = twin

st.caption(  # labels and sources name files and texts: shown as text, never as Markdown
    f"**A** = {md_escape(a.ctx.label)}: {a.tokens.n:,} tokens of {md_escape(a.tokens.source)} · "
    f"**B** = {md_escape(b.ctx.label)}: {b.tokens.n:,} tokens of {md_escape(b.tokens.source)}"
)

st.markdown("#### Headline numbers")
cards.headline_delta(a, b, separate_training=mode == TWO_RUNS and not quantised_copy(run_a.path, run_b.path))

if section == "experiment":  # the same experiment on A and B, estimated, run on request
    compare_experiment.section(a, b, st.session_state.get(EDITS) or [], mode == EDITED)
    st.stop()
views = section_views(section)
if not views:
    st.info(f"No figures are registered for the '{section}' section.")


def draw(view) -> None:
    if view.needs_model and view.section == "long_context":  # reruns the model at other lengths: not a trace view
        st.caption(
            f"**{view.title}**: measured per run on the {page_registry.page('long_context').mention} "
            "(it runs the model again)."
        )
        return
    if view.needs_model and not (page_scaffold.run_or_button(view, a) and page_scaffold.run_or_button(view, b)):
        return
    cards.render_comparison(view, a, b)


page_scaffold.draw_lazily(f"cmp_{section}", views, draw)
