"""The papers' figures on the user's own model, each with its reference in the caption (docs/DIAGNOSTICS.md, "The
papers' figures"): MQAR accuracy against sequence length (Kimi Linear report, Figure 4; a Long context view) and, per
AttnRes site, each depth source's routing weight beside its causal effect (Block AttnRes read causally; an AttnRes
view). The sink rate per layer and kind (Gu et al. 2024) is ``analysis.figures.attention_kinds``'
``degradation_sink_rate``. Both views here run the model (``needs_model``)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.experiments import paper_runs as pr
from analysis.figures.style import RUN_COLORS, accuracy_with_interval, apply_style
from analysis.metrics import null_reference as nr
from analysis.runs.context import AnalysisContext
from analysis.views.view import Comparison, NotApplicable, View


def _model(ctx: AnalysisContext):
    if ctx.model is None:
        raise NotApplicable("needs the model (a checkpoint, not a trace folder)")
    return ctx.model


def mqar_table(ctx: AnalysisContext) -> pd.DataFrame:
    """MQAR accuracy by length for this context's model, computed once (options: mqar_lengths, mqar_examples)."""
    model = _model(ctx)
    lengths = tuple(ctx.options.get("mqar_lengths") or pr.MQAR_LENGTHS)
    examples = int(ctx.options.get("mqar_examples") or 8)
    return ctx.once(("mqar_length", lengths, examples), lambda: pr.mqar_by_length(model, lengths, examples))


def build_mqar_by_length(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = nr.with_chance_band(mqar_table(ctx), "queries")
    fig = accuracy_with_interval(df["length"].to_numpy(), df, "MQAR accuracy", "length", "queries", digits=3)
    apply_style(
        fig,
        f"MQAR accuracy vs sequence length (Kimi Linear report, arXiv 2510.26692, Fig. 4; {int(df['at_chance'].sum())} "
        f"of {len(df)} lengths within chance) — {ctx.label}",
        "sequence length (tokens, log scale)",
        "share of queries answered (argmax = value)",
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(range=[0, 1.02])
    return fig, df


def build_attnres_causal(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    model = _model(ctx)
    if not model.config.uses_attnres:
        raise NotApplicable(f"no AttnRes sites: the model's residual is {model.config.residual!r}")
    ids = ctx.input_ids
    df = ctx.once(("attnres_causal",), lambda: pr.attnres_source_effects(model, ids))
    sites = list(dict.fromkeys(df["site"]))
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("routing weight (mean over tokens)", "loss change when removed (nats), 95% noise floor"),
        shared_yaxes=True,
    )
    for n, site in enumerate(sites):
        part = df[df["site"] == site]
        y = [f"{site} · {name}" for name in part["name"]]
        color = RUN_COLORS[n % len(RUN_COLORS)]
        fig.add_trace(
            go.Bar(
                x=part["weight"],
                y=y,
                orientation="h",
                marker_color=color,
                name=site,
                legendgroup=site,
                hovertemplate="%{y}<br>weight %{x:.3f}<extra></extra>",
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Bar(
                x=part["effect"],
                y=y,
                orientation="h",
                marker_color=color,
                name=site,
                legendgroup=site,
                showlegend=False,
                error_x={"type": "data", "array": part["noise"]},
                hovertemplate="%{y}<br>loss change %{x:.4f}<extra></extra>",
            ),
            1,
            2,
        )
    fig.update_yaxes(autorange="reversed")
    apply_style(
        fig,
        f"AttnRes: routing weight vs causal effect of each depth source (Block AttnRes read causally, "
        f"arXiv 2606.13168) — {ctx.label}",
        None,
        None,
        height=max(360, 60 + 18 * len(df)),
    )
    return fig, df


MQAR_VIEW = View(
    "long_mqar_length",
    "MQAR accuracy vs length",
    "long_context",
    build_mqar_by_length,
    needs_model=True,
    description="Multi-query associative recall at 256 to 2,048 tokens with Wilson intervals and chance (Kimi "
    "Linear report, Fig. 4).",
    compare=Comparison(difference=("accuracy",), keys=("length",)),
)

VIEWS: list[View] = [
    View(
        "attnres_causal_sources",
        "AttnRes routing weight vs causal effect",
        "attnres",
        build_attnres_causal,
        needs_model=True,
        description="Per site and depth source: mean routing weight, and the loss change when the source is removed "
        "from the mix with its 95% noise floor (arXiv 2606.13168).",
        compare=Comparison(difference=("weight", "effect"), keys=("site", "source"), x="source"),
    ),
]
