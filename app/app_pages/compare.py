"""Compare: two runs on the same text, or one run on two texts (analysis.compare)."""

from __future__ import annotations

import streamlit as st

from app import state, widgets

SECTIONS = {"density": "KDA & density", "attnres": "AttnRes", "moe": "LatentMoE", "degradation": "Degradation"}
TWO_RUNS, TWO_TEXTS = "Two runs, same text", "One run, two texts"

inputs = widgets.inputs_or_stop()
widgets.page_header(
    "Compare",
    "Any view for two runs side by side on shared axes and colour ranges, the difference A - B where "
    "the two tables align, and the headline numbers with their delta. Run A and text A are the sidebar's.",
)

mode = st.radio("Compare", (TWO_RUNS, TWO_TEXTS), horizontal=True, key="k3lab_cmp_mode", label_visibility="collapsed")
run_a = inputs.run
if mode == TWO_RUNS:
    others = [r for r in inputs.runs if r.label != run_a.label]
    if not others:
        st.info("Only one run is available: upload another on the **Upload** page, or compare one run on two texts.")
        st.stop()
    c1, c2 = st.columns(2)
    c1.text_input("Run A (sidebar)", value=run_a.label, disabled=True, key="k3lab_cmp_a")
    label_b = c2.selectbox("Run B", [r.label for r in others], key="k3lab_cmp_run_b")
    run_b = next(r for r in others if r.label == label_b)
    a = widgets.load_or_stop(inputs, label=run_a.label)
    b = widgets.load_or_stop(inputs, run=run_b, label=run_b.label)
else:
    c1, c2 = st.columns(2)
    c1.text_input("Text A (sidebar)", value=inputs.text.source, disabled=True, key="k3lab_cmp_text_a")
    with c2:
        default_b = state.TEXT_MQAR if inputs.text.source != state.TEXT_MQAR else state.TEXT_SHAKESPEARE
        choice_b, error_b = widgets.text_choice(
            "k3lab_cmp", max_tokens=inputs.text.max_tokens, default=default_b, label="Text B"
        )
    a = widgets.load_or_stop(inputs, label=f"A: {widgets.short_source(inputs.text)}")
    b = widgets.load_or_stop(inputs, choice=choice_b, text_error=error_b, label=f"B: {widgets.short_source(choice_b)}")

st.caption(
    f"**A** = {a.ctx.label}: {a.tokens.n:,} tokens of {a.tokens.source} · "
    f"**B** = {b.ctx.label}: {b.tokens.n:,} tokens of {b.tokens.source}"
)

st.markdown("#### Headline numbers")
widgets.headline_delta(a, b)

section = st.radio("Views", list(SECTIONS), format_func=SECTIONS.get, horizontal=True, key="k3lab_cmp_section")
views = widgets.section_views(section)
if not views:
    st.info(f"No figures are registered for the '{section}' section.")
for view in views:
    widgets.render_comparison(view, a, b)
