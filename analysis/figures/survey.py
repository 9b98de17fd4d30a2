"""Survey figures: a corpus survey (``analysis.survey.engine``, tables in ``analysis.survey.tables``) drawn as views.

A survey view draws ``ctx.options["survey"]`` (a ``Survey`` read with ``read_survey``; ``survey_context`` makes the
context) and raises NotApplicable without one, so these views live in their own catalogue (``VIEWS`` here, section
"survey"), not among the trace views. The load map is drawn with scatter marks (square markers, one per layer x
expert, ``customdata`` = (layer, expert)) so that a plotly selection picks a cell: ``atlas_card`` draws that expert.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import RUN_COLORS, apply_style
from analysis.runs.context import AnalysisContext
from analysis.survey import tables as st
from analysis.survey.folder import Survey
from analysis.views.view import NotApplicable, View

POLICY_COLORS = {"lru": RUN_COLORS[0], "lfu": RUN_COLORS[1], "belady": RUN_COLORS[2]}


def survey_context(survey: Survey, label: str | None = None, **options: Any) -> AnalysisContext:
    """An AnalysisContext that carries a survey (no trace, no model) for the survey views."""
    return AnalysisContext(trace=None, config=None, label=label or survey.card["run"].get("label", "survey"),
                           options={"survey": survey, **options})  # fmt: skip


def _survey(ctx: AnalysisContext) -> Survey:
    survey = ctx.options.get("survey")
    if survey is None:
        raise NotApplicable("no survey: run `k3lab survey RUN --sample NAME --out DIR` and open DIR")
    if not survey.layout.moe_layers:
        raise NotApplicable("this run has no MoE layers")
    return survey


def _tokens_note(survey: Survey) -> str:
    return f"{int(survey.state.sums['tokens'][0]):,} tokens of {survey.plan.corpus}"


def load_map(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Load share per layer x expert as selectable square marks; hover: tokens, 95% Wilson interval, saliency."""
    survey = _survey(ctx)
    df = st.expert_table(survey)
    chance = survey.layout.top_k / survey.layout.num_experts
    ratio = (df.share / chance).to_numpy()
    # a colour range symmetric about the fair share (1), with five labelled ticks whatever the spread
    low = float(min(np.nanmin(ratio), 2 - np.nanmax(ratio), 0.9)) if len(ratio) else 0.5
    ticks = np.round(np.linspace(low, 2 - low, 7)[1:-1], 2)  # inside the range: end ticks may go undrawn
    fig = go.Figure(
        go.Scatter(
            x=df.expert,
            y=df.layer,
            mode="markers",
            marker=dict(
                symbol="square",
                size=22,
                color=ratio,
                colorscale="RdBu_r",
                cmin=low,
                cmax=2 - low,
                colorbar=dict(title="load / fair", tickvals=ticks.tolist(), ticktext=[f"{t:g}" for t in ticks]),
            ),
            customdata=np.stack([df.layer, df.expert, df.tokens, df.share_low, df.share_high, df.saliency], axis=1),
            hovertemplate="layer %{customdata[0]} expert %{customdata[1]}<br>%{customdata[2]:,} tokens, share "
            "%{customdata[3]:.3f}..%{customdata[4]:.3f} (95%)<br>REAP saliency %{customdata[5]:.3f}<extra></extra>",
            name="expert",
        )
    )
    # a click selects a mark: Streamlit's chart turns clickmode to "event" (clicks select nothing) whenever dragmode is
    # "select" or "lasso", so the drag zooms and the click selects
    fig.update_layout(clickmode="event+select", dragmode="zoom")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(dtick=1, autorange="reversed")
    apply_style(fig, f"Expert load over {_tokens_note(survey)} (fair share k/E = 1)", "expert", "MoE layer")
    df.attrs["keys"] = ["layer", "expert"]
    return fig, df


def cache_curves(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Hit rate against cache size (bytes at the storage format) for LRU, LFU and Belady: the shared model-wide
    cache, and the per-layer caches (mean over layers); ``ctx.options["budget_bytes"]`` is marked when given."""
    survey = _survey(ctx)
    df = st.cache_table(survey)
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("one cache shared by all MoE layers", "a cache per layer (mean)")
    )
    for policy in ("lru", "lfu", "belady"):
        model = df[(df.scope == "model") & (df.policy == policy)]
        fig.add_trace(go.Scatter(x=model.size_bytes / 1e6, y=model.hit_rate, name=policy, legendgroup=policy,
                                 line=dict(color=POLICY_COLORS[policy])), 1, 1)  # fmt: skip
        layers = (
            df[(df.scope != "model") & (df.policy == policy)]
            .groupby("size", as_index=False)
            .agg(size_bytes=("size_bytes", "mean"), hit_rate=("hit_rate", "mean"))
        )
        fig.add_trace(go.Scatter(x=layers.size_bytes / 1e6, y=layers.hit_rate, name=policy, legendgroup=policy,
                                 showlegend=False, line=dict(color=POLICY_COLORS[policy])), 1, 2)  # fmt: skip
    budget = ctx.options.get("budget_bytes")
    if budget:
        fig.add_vline(x=budget / 1e6, line_dash="dot", line_color="grey", row=1, col=1)
    fig.update_yaxes(range=[0, 1])
    apply_style(fig, f"Expert-cache hit rate over {_tokens_note(survey)} (cold cache per sequence)", "cache (MB)",
                "hit rate")  # fmt: skip
    df.attrs["keys"] = ["scope", "policy", "size"]
    return fig, df


def balance(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """MaxVio and CV of the load per MoE layer over the corpus."""
    survey = _survey(ctx)
    df = st.balance_table(survey)
    fig = go.Figure([go.Bar(x=df.layer, y=df.max_vio, name="MaxVio", marker_color=RUN_COLORS[0]),
                     go.Bar(x=df.layer, y=df.cv, name="CV", marker_color=RUN_COLORS[1])])  # fmt: skip
    fig.update_xaxes(dtick=1)
    apply_style(fig, f"Load balance per MoE layer over {_tokens_note(survey)}", "MoE layer", "imbalance")
    df.attrs["keys"] = ["layer"]
    return fig, df


def cutoff_histograms(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Quantile balancing's cut-off gaps (alpha_t - s_te, all experts) and the selection margin, per MoE layer."""
    survey = _survey(ctx)
    gaps, margins = st.histogram_table(survey, "cutoff"), st.histogram_table(survey, "margin")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("cut-off minus score", "last chosen minus first unchosen"))
    for n, layer in enumerate(survey.layout.moe_layers):
        color = RUN_COLORS[n % len(RUN_COLORS)]
        for col, table in ((1, gaps), (2, margins)):
            part = table[table.layer == layer].groupby(["bin_low", "bin_high"], as_index=False)["count"].sum()
            part = part[np.isfinite(part.bin_low) & np.isfinite(part.bin_high)]
            share = part["count"] / max(part["count"].sum(), 1)
            trace = go.Scatter(x=(part.bin_low + part.bin_high) / 2, y=share, name=f"layer {layer}",
                               legendgroup=str(layer), showlegend=col == 1, line=dict(color=color))  # fmt: skip
            fig.add_trace(trace, 1, col)
    apply_style(fig, f"Routing margins over {_tokens_note(survey)}", "selection units", "share of tokens")
    out = pd.concat([gaps.assign(what="cutoff"), margins.assign(what="margin")], ignore_index=True)
    return fig, out


def atlas_card(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """One expert's atlas card (``ctx.options["layer"]``, ``["expert"]``; default the most specialised): its top
    contexts with the token marked, its class lift, and its numbers (load, saliency, specialisation)."""
    survey = _survey(ctx)
    experts = st.expert_table(survey)
    layer, expert = ctx.options.get("layer"), ctx.options.get("expert")
    if layer is None or expert is None:
        row = experts.sort_values("specialisation_bits", ascending=False).iloc[0]
        layer, expert = int(row.layer), int(row.expert)
    row = experts[(experts.layer == layer) & (experts.expert == expert)]
    if row.empty:
        raise NotApplicable(f"no MoE layer {layer} expert {expert} in this survey")
    row = row.iloc[0]
    contexts = st.atlas_table(survey, layer, expert)
    lifts = st.lift_table(survey, layer, expert)
    classes = lifts[lifts.kind == "class"]
    fig = make_subplots(rows=2, cols=1, row_heights=[0.62, 0.38], vertical_spacing=0.12,
                        specs=[[{"type": "table"}], [{"type": "xy"}]])  # fmt: skip
    top = contexts[contexts.kind == "top"]
    marked = [f"{b[-40:]}<b>[{t}]</b>{a[:16]}" for b, t, a in zip(top.before, top.token, top.after)]
    fig.add_trace(go.Table(header=dict(values=["weight", "context (token in [ ])"]),
                           cells=dict(values=[[f"{v:.3f}" for v in top.value], marked], align="left"),
                           columnwidth=[1, 8]), 1, 1)  # fmt: skip
    fig.add_trace(go.Bar(x=classes["item"], y=classes["lift"], name="lift", marker_color=RUN_COLORS[0],
                         text=[f"n={c:,}" for c in classes["count"]], textposition="outside"), 2, 1)  # fmt: skip
    fig.add_trace(go.Scatter(x=classes["item"], y=np.ones(len(classes)), mode="lines", name="as in the corpus",
                             line=dict(color="grey", dash="dot")), 2, 1)  # fmt: skip
    title = (f"Layer {layer} expert {expert}: {int(row.tokens):,} tokens ({row.share_low:.3f}..{row.share_high:.3f}), "
             f"REAP {row.saliency:.3f}, specialisation {row.specialisation_bits:.2f} bits")  # fmt: skip
    # apply_style walks every trace's legend setting, which a Table has not: the card's layout is set here
    fig.update_layout(title=dict(text=title, font=dict(size=14)), height=620, plot_bgcolor="white",
                      margin=dict(l=60, r=20, t=60, b=50), legend=dict(orientation="h", y=-0.12))  # fmt: skip
    fig.update_xaxes(title_text="token class", row=2, col=1)
    fig.update_yaxes(title_text="lift (1 = as in the corpus)", gridcolor="#eee", row=2, col=1)
    return fig, pd.concat([contexts, lifts], ignore_index=True)


def loss_by_position(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Mean loss by position over the sequences, and the MLA sink mass by query position."""
    survey = _survey(ctx)
    df = st.position_table(survey)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss", "MLA first-key mass"))
    fig.add_trace(go.Scatter(x=df.position, y=df.loss, name="loss", line=dict(color=RUN_COLORS[0])), 1, 1)
    for n, col in enumerate(c for c in df.columns if c.startswith("sink_mass_layer_")):
        fig.add_trace(go.Scatter(x=df.position, y=df[col], name=col.replace("sink_mass_", "").replace("_", " "),
                                 line=dict(color=RUN_COLORS[(n + 1) % len(RUN_COLORS)])), 1, 2)  # fmt: skip
    apply_style(fig, f"By position, mean over {int(df.sequences.max()):,} sequences", "position", "nats / mass")
    return fig, df


def compare_surveys(a: Survey, b: Survey, label_a: str = "A", label_b: str = "B") -> tuple[go.Figure, pd.DataFrame]:
    """Two surveys side by side (two runs on one corpus, or one run on two corpora): MaxVio per layer and the
    shared cache's Belady and LRU hit rates by size."""
    rows = []
    fig = make_subplots(rows=1, cols=2, subplot_titles=("MaxVio per MoE layer", "shared-cache hit rate"))
    for n, (label, survey) in enumerate(((label_a, a), (label_b, b))):
        color = RUN_COLORS[n]
        bal = st.balance_table(survey)
        fig.add_trace(go.Bar(x=bal.layer, y=bal.max_vio, name=label, marker_color=color, legendgroup=label), 1, 1)
        cache = st.cache_table(survey)
        for policy, dash in (("belady", "solid"), ("lru", "dot")):
            part = cache[(cache.scope == "model") & (cache.policy == policy)]
            fig.add_trace(go.Scatter(x=part.size_bytes / 1e6, y=part.hit_rate, name=f"{label} {policy}",
                                     line=dict(color=color, dash=dash), legendgroup=label), 1, 2)  # fmt: skip
            rows.append(part.assign(survey=label))
        rows.append(bal.assign(survey=label, scope="balance"))
    apply_style(fig, f"Surveys compared: {label_a} vs {label_b}", "MoE layer | cache (MB)", "MaxVio | hit rate")
    return fig, pd.concat(rows, ignore_index=True)


def maxvio_scopes(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """MaxVio per MoE layer, global / per batch / per sequence (loss-free balancing, arXiv 2408.15664)."""
    survey = _survey(ctx)
    df = st.maxvio_table(survey)
    fig = go.Figure()
    for n, scope in enumerate(("global", "batch", "sequence")):
        part = df[df["scope"] == scope]
        fig.add_trace(
            go.Bar(
                x=part.layer,
                y=part.max_vio,
                name=scope if scope == "global" else f"per {scope} (mean, sd)",
                marker_color=RUN_COLORS[n],
                error_y={"type": "data", "array": part["std"]},
                customdata=part[["p50", "p90", "count"]].to_numpy(),
                hovertemplate=f"layer %{{x}}, {scope}<br>MaxVio %{{y:.3f}}<br>median %{{customdata[0]:.2f}}, "
                "p90 %{customdata[1]:.2f} (bin edges) over %{customdata[2]}<extra></extra>",
            )
        )
    fig.update_xaxes(dtick=1)
    apply_style(
        fig,
        f"MaxVio global / per batch / per sequence over {_tokens_note(survey)} (loss-free balancing, arXiv 2408.15664)",
        "MoE layer",
        "MaxVio = max load / mean load - 1",
    )
    df.attrs["keys"] = ["layer", "scope"]
    return fig, df


VIEWS = [
    View("survey_load_map", "Expert load over a corpus", "survey", load_map,
         description="Load share per layer x expert (select a mark to open its atlas card)"),
    View("survey_balance", "Load balance over a corpus", "survey", balance),
    View("survey_maxvio", "MaxVio global, per batch, per sequence", "survey", maxvio_scopes),
    View("survey_cache", "Expert-cache hit rates", "survey", cache_curves,
         description="LRU, LFU and Belady hit rates by cache size, shared and per layer"),
    View("survey_margins", "Routing margins and cut-off gaps", "survey", cutoff_histograms),
    View("survey_atlas_card", "Expert atlas card", "survey", atlas_card),
    View("survey_positions", "Loss and sink mass by position", "survey", loss_by_position),
]  # fmt: skip
