"""Weights: what the checkpoint learned, read from its small tensors without loading the model
(analysis.weights). Works for every run, and is the one page for a checkpoint too large to load."""

from __future__ import annotations

import json

import streamlit as st

from analysis import weights as wt
from analysis.output.format import format_bytes
from analysis.views.catalogue import section_views
from app.library import run_messages
from app.library.run_folders import human_count
from app.render import caching, cards, page_scaffold
from k3core.loading.names import PARAMETER_RULE
from k3core.loading.tensor_info import CheckpointError


def weights_or_stop(ref, experts: bool = False, progress=None) -> caching.Loaded:
    try:
        return caching.load_weights(ref, experts, progress)
    except (CheckpointError, OSError, ValueError) as exc:
        st.error(f"**{ref.label}**: {run_messages.message(exc, ref)}")
        st.stop()


inputs = page_scaffold.inputs_or_stop()
ref = inputs.run
page_scaffold.page_header(
    "weights",
    "What the checkpoint learned, read straight from its small tensors without building the model: KDA resting "
    "decay (half-life per layer and head), AttnRes pseudo-query norms, residual scale/bias, router selection "
    "biases and norms, norm weights, and parameters by depth from the headers. Any size: a 5 TB checkpoint "
    "answers in seconds.",
)
experts = bool(st.session_state.get(f"k3lab_weights_experts_{ref.label}"))
bar = st.progress(0.0, text="Reading expert matrices...") if experts else None
a = weights_or_stop(ref, experts, (lambda done, total: bar.progress(done / max(total, 1))) if bar else None)
if bar is not None:
    bar.empty()
summary = a.ctx.weights

structure = summary.structure
c = st.columns(5)
c[0].metric("Parameters", human_count(summary.total_params), help=PARAMETER_RULE)
c[1].metric("Declared size", format_bytes(summary.bytes_total))
c[2].metric(
    "Read",
    format_bytes(summary.bytes_read),
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
    json.dumps(wt.weights_json(summary), indent=1),
    file_name=f"{cards.slug(ref.label)}_weights.json",
    mime="application/json",
    key="k3lab_weights_json",
)


def expert_norms_button(where) -> None:
    """The button that reads the expert matrices (what ``k3lab weights PATH --experts`` does) and draws the
    per-expert norms: shown where that view would be."""
    label = f"Read the expert matrices for per-expert norms ({format_bytes(summary.expert_bytes)})"
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
views = section_views("weights")


def draw(view) -> bool:
    if view.key == "weights_expert_norms" and needs_experts:  # the page's own button, not a command line
        st.markdown(f"**{view.title}**: the expert matrices are not read yet.")
        expert_norms_button(st)
        return False
    return cards.render_view(view, a)


if other == "(none)":
    page_scaffold.draw_lazily("weights", views, draw)
else:
    b = weights_or_stop(next(r for r in others if r.label == other))
    # each comparison is a side-by-side chart (its A - B chart drawn when its expander is opened)
    page_scaffold.draw_lazily("weights_cmp", views, lambda view: cards.render_comparison(view, a, b))
