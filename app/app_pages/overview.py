"""Overview: the chosen run's configuration, parameter counts, layer map, model card and headline numbers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis.inspect import config_summary, layer_map, parameter_breakdown
from app import state, widgets
from app.state import InputError
from k3core.checkpoint import CheckpointError

inputs = widgets.inputs_or_stop()
run = inputs.run
widgets.page_header(
    "k3lab",
    "See inside a Kimi K3-style model: KDA linear attention and layer density, AttnRes depth mixing, "
    "LatentMoE routing and attention degradation. Pick a run and a text in the sidebar; every page follows them.",
)

try:
    model = state.load_model(run, inputs.device, inputs.dtype)
except (CheckpointError, InputError) as exc:
    st.error(f"**{run.label}**: {exc}")
    st.stop()
cfg = model.config

st.subheader(f"{run.label}")
st.caption(f"{run.path} · preset name `{cfg.name}` · {run.origin}")

# ------------------------------------------------------------------- parameter counts
total = model.num_parameters()
active = model.num_parameters(active=True)
types = cfg.layer_types()
c = st.columns(5)
c[0].metric("Parameters", widgets.human_count(total))
c[1].metric("Active per token", widgets.human_count(active))
c[2].metric(
    "Layers", f"{cfg.num_hidden_layers}", f"{types.count('KDA')} KDA · {types.count('MLA')} MLA", delta_color="off"
)
c[3].metric("Residual", cfg.residual.replace("_", " "))
c[4].metric("Experts", f"{cfg.num_experts_per_token} of {cfg.num_experts}" if cfg.num_experts else "dense")

# ------------------------------------------------------------------- headline numbers
st.markdown("#### Headline numbers")
if inputs.text_error:
    st.error(inputs.text_error)
else:
    loaded = widgets.load_or_stop(inputs)
    widgets.show_input_notes(loaded)
    widgets.run_line(loaded)
    widgets.headline_metrics(loaded)

# ------------------------------------------------------------------- layer map, parameters, config
st.markdown("#### Layer map")
st.markdown(widgets.layer_badges(cfg))
left, right = st.columns([3, 2])
with left:
    st.dataframe(pd.DataFrame(layer_map(cfg)), hide_index=True, **widgets.DATAFRAME_KW)
    st.markdown("#### Parameters by component")
    breakdown = parameter_breakdown(model)
    st.dataframe(
        pd.DataFrame(
            [{"component": k, "total": v["total"], "active per token": v["active"]} for k, v in breakdown.items()]
        ),
        hide_index=True,
        **widgets.DATAFRAME_KW,
    )
with right:
    st.markdown("#### Configuration")
    summary = config_summary(cfg)
    st.dataframe(
        pd.DataFrame({"setting": list(summary), "value": [str(v) for v in summary.values()]}),
        hide_index=True,
        **widgets.DATAFRAME_KW,
    )
    with st.expander("Every config field"):
        st.json(cfg.to_dict(), expanded=True)

# ------------------------------------------------------------------- model card
card = state.run_card(run)
st.markdown("#### Model card")
if card:
    with st.container(border=True):
        st.markdown(card)
else:
    st.caption("This run has no README.md.")
