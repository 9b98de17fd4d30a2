"""Weights: what the checkpoint learned, read from its small tensors without loading the model
(analysis.weights). Works for every run, and is the one page for a checkpoint too large to load."""

from __future__ import annotations

import json

import streamlit as st

from analysis import weights as wt
from analysis.compare import difference_view, side_by_side
from analysis.views import AnalysisContext, NotApplicable
from app import caching, cards, page
from app.run_folders import human_count
from k3core.checkpoint_files import PARAMETER_RULE, CheckpointError


@st.cache_resource(show_spinner="Reading the checkpoint's small tensors...", max_entries=8)
def _summary(fingerprint: str, path: str, experts: bool, _progress=None) -> wt.WeightSummary:
    return wt.read_weight_summary(path, experts=experts, progress=_progress)


def summary_or_stop(ref, experts: bool = False, progress=None) -> wt.WeightSummary:
    try:
        return _summary(caching.run_fingerprint(ref.path), str(ref.path), experts, progress)
    except (CheckpointError, OSError, ValueError) as exc:
        st.error(f"**{ref.label}**: {exc}")
        st.stop()


def context(summary: wt.WeightSummary, label: str) -> AnalysisContext:
    return AnalysisContext(trace=None, config=summary.config, label=label, weights=summary)


inputs = page.inputs_or_stop()
ref = inputs.run
page.page_header(
    "Weights",
    "What the checkpoint learned, read straight from its small tensors without building the model: KDA resting "
    "decay (half-life per layer and head), AttnRes pseudo-query norms, residual scale/bias, router selection "
    "biases and norms, norm weights, and parameters by depth from the headers. Any size: a 5 TB checkpoint "
    "answers in seconds.",
)
summary = summary_or_stop(ref)
if st.session_state.get(f"k3lab_weights_experts_{ref.label}"):
    bar = st.progress(0.0, text="Reading expert matrices...")
    summary = summary_or_stop(ref, True, lambda done, total: bar.progress(done / max(total, 1)))
    bar.empty()

structure = summary.structure
c = st.columns(5)
c[0].metric("Parameters", human_count(summary.total_params), help=PARAMETER_RULE)
c[1].metric("Declared size", wt.human_bytes(summary.bytes_total))
c[2].metric(
    "Read",
    wt.human_bytes(summary.bytes_read),
    f"{100 * summary.bytes_read / max(summary.bytes_total, 1):.3g}% of it",
    delta_color="off",
    **cards.NO_ARROW,
)
c[3].metric(
    "Layers",
    f"{len(structure)}",
    f"{(structure['mixer'] == 'kda').sum()} KDA · {(structure['mixer'] == 'mla').sum()} MLA",
    delta_color="off",
    **cards.NO_ARROW,
)
c[4].metric("Seconds", f"{summary.seconds:.2f}")
for note in summary.notes:
    st.caption(note)
if summary.skipped:
    with st.expander(f"{len(summary.skipped)} tensors skipped (not part of the text model)"):
        st.code("\n".join(summary.skipped[:200]) + ("\n..." if len(summary.skipped) > 200 else ""))
left = st.columns([1, 3])[0]
left.download_button(
    "weights.json",
    json.dumps(summary.to_json(), indent=1),
    file_name=f"{cards.slug(ref.label)}_weights.json",
    mime="application/json",
    key="k3lab_weights_json",
)


def expert_norms_button(where) -> None:
    """The button that reads the expert matrices (what ``k3lab weights PATH --experts`` does) and draws the
    per-expert norms: shown where that view would be."""
    label = f"Read the expert matrices for per-expert norms ({wt.human_bytes(summary.expert_bytes)})"
    if where.button(label, key="k3lab_weights_exp"):
        st.session_state[f"k3lab_weights_experts_{ref.label}"] = True
        st.rerun()


needs_experts = summary.expert_norms is None and (structure["ffn"] == "moe").any()

others = [r for r in inputs.runs if r.label != ref.label]
other = st.selectbox(
    "Compare with",
    ["(none)"] + [r.label for r in others],
    key="k3lab_weights_cmp",
    help="Another run's weights side by side on shared axes, and A - B where layers align.",
)
views = cards.section_views("weights")
a = context(summary, ref.label)
if other == "(none)":
    for view in views:
        try:
            fig, df = view.build(a)
        except NotApplicable as exc:
            if view.key == "weights_expert_norms" and needs_experts:
                st.markdown(f"**{view.title}**: the expert matrices are not read yet.")
                expert_norms_button(st)
            else:
                st.info(f"**{view.title}**: {exc}")
            continue
        cards.figure_card(
            fig, df, key=f"w-{view.key}", stem=f"{cards.slug(ref.label)}_{view.key}", description=view.description
        )
else:
    ref_b = next(r for r in others if r.label == other)
    b = context(summary_or_stop(ref_b), ref_b.label)
    for view in views:
        try:
            fig, df = side_by_side(view, a, b)
        except NotApplicable as exc:
            st.info(f"**{view.title}**: {exc}")
            continue
        stem = f"{cards.slug(a.label)}_vs_{cards.slug(b.label)}_{view.key}"
        cards.figure_card(fig, df, key=f"wc-{view.key}", stem=stem, description=view.description)
        try:
            dfig, ddf = difference_view(view, a, b)
        except NotApplicable:
            continue
        with st.expander(f"Difference A - B: {view.title}"):
            cards.figure_card(dfig, ddf, key=f"wd-{view.key}", stem=f"{stem}_diff")
