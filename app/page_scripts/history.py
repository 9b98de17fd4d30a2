"""Training history: metrics.json curves of the chosen run, with other runs overlaid."""

from __future__ import annotations

import streamlit as st

from app.render import caching, page_scaffold

inputs = page_scaffold.inputs_or_stop()
page_scaffold.page_header(
    "history",
    "Loss, validation bits/byte, MQAR accuracy, MoE balance and AttnRes summaries logged "
    "during training (each run's metrics.json). Overlay other runs to compare how they trained.",
)

run = inputs.run
with_metrics = [r for r in inputs.runs if caching.run_metrics(r)]
others = [r.label for r in with_metrics if r.label != run.label]
overlay = (
    st.multiselect(
        "Overlay runs",
        others,
        default=others,
        key="k3lab_hist_overlay",
        help="Runs with a metrics.json, drawn in their own colours.",
    )
    if others
    else []
)
if caching.run_metrics(run) is None:
    st.info(
        f"**{run.label}** has no metrics.json (no training history)"
        + ("; showing the overlaid runs." if overlay else ".")
    )

loaded = page_scaffold.history_context(run, [r for r in with_metrics if r.label in overlay])
if loaded is not None:
    page_scaffold.render_section("history", loaded)
