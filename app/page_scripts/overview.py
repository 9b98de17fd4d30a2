"""Overview: the chosen run's configuration, parameter counts, layer map, model card and headline numbers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis.output.format import format_count
from analysis.views.catalogue import section_views
from analysis.weights.checkpoint_summary import config_summary, layer_map, parameter_breakdown
from app.render import caching, cards, page_scaffold
from app.render.download_all import download_all
from app.render.errors import markdown_card, md_escape
from k3core.loading.names import PARAMETER_RULE

LAYER_MAP_VIEW = "density_allocation"  # parameters, FLOPs and cache bytes per layer, coloured by layer type

inputs = page_scaffold.inputs_or_stop()
run = inputs.run
page_scaffold.page_header(
    "overview",
    "See inside a Kimi K3-style model: KDA linear attention and layer density, AttnRes depth mixing, "
    "LatentMoE routing and attention degradation. Pick a run and a text in the sidebar; every page follows them.",
)

st.subheader(f"{run.label}")
about = st.empty()  # the config's name, once the run is loaded
counts = st.container()  # parameter counts, once the run is loaded
st.markdown("#### Headline numbers")
headline_box = st.container()  # filled last: the forward pass runs after everything drawn from the config

# ------------------------------------------------------------------- layer map
# Drawn from config.json before the weights load: shown while a big checkpoint loads, and for one too big to load
# (a config that cannot be read: run_or_stop below says why).
from_config = page_scaffold.config_context(inputs)
if from_config is not None:
    st.markdown("#### Layer map")
    st.markdown(cards.layer_badges(from_config.ctx.config))
    allocation = [v for v in section_views("density") if v.key == LAYER_MAP_VIEW]
    if allocation:
        cards.render_view(allocation[0], from_config)
    layer_table = cards.lazy_expander("Layer table", key="k3lab_overview_layer_table")
    if layer_table is not None:
        layer_table.dataframe(pd.DataFrame(layer_map(from_config.ctx.config)), hide_index=True, **cards.DATAFRAME_KW)

loaded_run = page_scaffold.run_or_stop(inputs)  # loaded once: the headline numbers use it too
# a trace folder has no model: its config's shapes give the parameter counts (meta device)
model = loaded_run.model if loaded_run.model is not None else caching.shape_model(loaded_run)
cfg = loaded_run.config
about.caption(f"config name {md_escape(cfg.name)} · {run.origin}")  # names only: no server folders

# ------------------------------------------------------------------- parameter counts
total = model.num_parameters()
active = model.num_parameters(active=True)
types = cfg.layer_types()
RESIDUAL_NAMES = {
    "block_attnres": "Block AttnRes",
    "full_attnres": "Full AttnRes",
    "scale_bias": "scale/bias",
    "plain": "PreNorm",
}
c = counts.columns([1, 1, 0.7, 1.4, 0.8])
c[0].metric("Parameters", format_count(total), help=PARAMETER_RULE)
c[1].metric("Active per token", format_count(active), help="Routed experts counted k of E.")
c[2].metric(
    "Layers",
    f"{cfg.num_hidden_layers}",
    f"{types.count('KDA')} KDA · {types.count('MLA')} MLA",
    delta_color="off",
    **cards.NO_ARROW,
)
c[3].metric("Residual", RESIDUAL_NAMES.get(cfg.residual, cfg.residual), help=f"`residual = {cfg.residual}`")
c[4].metric(
    "Experts",
    f"{cfg.num_experts_per_token} of {cfg.num_experts}" if cfg.num_experts else "dense",
    help="Routed experts chosen per token, of all routed experts"
    + (f" (+{cfg.num_shared_experts} shared)" if cfg.num_experts else ""),
)

# ------------------------------------------------------------------- parameters, config
left, right = st.columns(2)
with left:
    st.markdown("#### Parameters by component")
    breakdown = parameter_breakdown(model)
    rows = [
        {"component": k, "total": f"{v['total']:,}", "active per token": f"{v['active']:,}"}
        for k, v in breakdown.items()
    ]
    st.table(pd.DataFrame(rows).set_index("component"))
with right:
    st.markdown("#### Configuration")
    summary = config_summary(cfg)
    st.table(pd.DataFrame({"setting": list(summary), "value": [str(v) for v in summary.values()]}).set_index("setting"))
    fields = cards.lazy_expander("Every config field", key="k3lab_overview_config_fields")
    if fields is not None:
        fields.json(cfg.to_dict(), expanded=True)

# ------------------------------------------------------------------- model card
card = caching.run_card(run)
st.markdown("#### Model card")
if card:
    with st.container(border=True):
        st.markdown(markdown_card(card))  # no images from elsewhere
else:
    st.caption("This run has no README.md.")

# ------------------------------------------------------------------- download all
st.markdown("#### Download all")
st.caption(
    "Everything `k3lab report` writes for this run and the sidebar's text, as one zip: report.html, "
    "headline.json, and each figure as CSV, JSON, PNG and SVG."
)
if inputs.text_error:
    st.caption(f"Not available: {inputs.text_error}")
else:
    download_all([run], inputs.text)

# ------------------------------------------------------------------- headline numbers (the forward pass)
with headline_box:
    if inputs.text_error:
        st.error(inputs.text_error)
    else:
        loaded = page_scaffold.load_or_stop(inputs, run=loaded_run)
        page_scaffold.show_input_notes(loaded)
        page_scaffold.run_line(loaded)
        cards.headline_metrics(loaded)
        if loaded.ctx.token_strings is not None:  # the tokens the model read, as its own tokenizer splits them
            label = f"Input tokens ({loaded.ctx.tokenizer.name})"
            shown = cards.lazy_expander(label, key="k3lab_overview_input_tokens")
            if shown is not None:
                shown.code(" ".join(loaded.ctx.position_labels(range(len(loaded.ctx.token_strings)))), wrap_lines=True)
        page_scaffold.prefetch_sections(loaded)  # the mechanism pages' figures, built while this page is read
