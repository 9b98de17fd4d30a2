"""The papers' figures on the user's own model, each with its reference in the caption (docs/DIAGNOSTICS.md, "The
papers' figures"): MQAR accuracy against sequence length (Kimi Linear report, Figure 4; a Long context view) and, per
AttnRes site, each depth source's routing weight beside its causal effect (Block AttnRes read causally; an AttnRes
view). The sink rate per layer and kind (Gu et al. 2024) is ``analysis.figures.attention_kinds``'
``degradation_sink_rate``. Both views here run the model (``needs_model``): ``MODEL_RUNS`` says, per view, what a
run costs and computes its table once per context with progress, so the app measures each on its own button."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.experiments import paper_runs as pr
from analysis.figures.style import RUN_COLORS, accuracy_with_interval, apply_style
from analysis.metrics import null_reference as nr
from analysis.runs.context import AnalysisContext
from analysis.views.view import Comparison, NotApplicable, View
from k3core.interp.trace_size import attnres_sources

Progress = Callable[[int, int], None]


def _model(ctx: AnalysisContext):
    if ctx.model is None:
        raise NotApplicable("needs the model (a checkpoint, not a trace folder)")
    return ctx.model


def _ids(ctx: AnalysisContext):
    """The tokens a causal run measures on; NotApplicable without them (a context built from a trace alone)."""
    if ctx.input_ids is None:
        raise NotApplicable("needs the tokens to rerun the model on (ctx.input_ids), and this context has none")
    return ctx.input_ids


def _mqar_setup(ctx: AnalysisContext) -> tuple[tuple[int, ...], int]:
    """(lengths, examples per length) of the MQAR run (options: mqar_lengths, mqar_examples)."""
    return tuple(ctx.options.get("mqar_lengths") or pr.MQAR_LENGTHS), int(ctx.options.get("mqar_examples") or 8)


def _mqar_key(ctx: AnalysisContext) -> tuple:
    return ("mqar_length", *_mqar_setup(ctx))


def mqar_table(ctx: AnalysisContext, progress: Progress | None = None) -> pd.DataFrame:
    """MQAR accuracy by length for this context's model, computed once (options: mqar_lengths, mqar_examples)."""
    model = _model(ctx)
    lengths, examples = _mqar_setup(ctx)
    return ctx.once(_mqar_key(ctx), lambda: pr.mqar_by_length(model, lengths, examples, progress=progress))


def mqar_cost(ctx: AnalysisContext) -> str:
    """What the MQAR run costs, in words, before it runs."""
    lengths, examples = _mqar_setup(ctx)
    return (
        f"Runs the model on {examples} new MQAR sequences at each of {len(lengths)} lengths "
        f"({', '.join(f'{n:,}' for n in sorted(lengths))} tokens): {len(lengths)} forward passes over "
        f"{examples * sum(lengths):,} tokens in all; run once per run."
    )


def attnres_table(ctx: AnalysisContext, progress: Progress | None = None) -> pd.DataFrame:
    """Routing weight and causal effect of every AttnRes site's sources on this context's tokens, computed once."""
    model = _model(ctx)
    if not model.config.uses_attnres:
        raise NotApplicable(f"no AttnRes sites: the model's residual is {model.config.residual!r}")
    ids = _ids(ctx)
    return ctx.once(("attnres_causal",), lambda: pr.attnres_source_effects(model, ids, progress=progress))


def attnres_cost(ctx: AnalysisContext) -> str:
    """What the AttnRes causal run costs, in words, before it runs (sites: 2 per layer and the final norm's)."""
    config = _model(ctx).config
    if not config.uses_attnres:
        raise NotApplicable(f"no AttnRes sites: the model's residual is {config.residual!r}")
    forwards = 1 + (2 * config.num_hidden_layers + 1) * attnres_sources(config)
    return (
        f"One recorded forward, then one forward with each depth source removed in turn: at most {forwards:,} "
        f"forward passes on the {int(_ids(ctx).numel()):,} tokens; run once per run and text."
    )


@dataclass(frozen=True)
class ModelRun:
    """A view that runs the model, measured when the user asks: its button's label, its cost in words (before it
    runs), its table (computed once per context, ``progress(done, total)`` as it goes) and whether that is done."""

    button: str
    cost: Callable[[AnalysisContext], str]
    table: Callable[[AnalysisContext, Progress | None], pd.DataFrame]
    key: Callable[[AnalysisContext], tuple]

    def measured(self, ctx: AnalysisContext) -> bool:
        return self.key(ctx) in ctx.shared


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
    df = attnres_table(ctx)
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

#: the views above that run the model, by view key, each measured on its own button in the app
MODEL_RUNS: dict[str, ModelRun] = {
    MQAR_VIEW.key: ModelRun("Measure MQAR accuracy vs length", mqar_cost, mqar_table, _mqar_key),
    "attnres_causal_sources": ModelRun(
        "Measure AttnRes causal effects", attnres_cost, attnres_table, lambda ctx: ("attnres_causal",)
    ),
}
