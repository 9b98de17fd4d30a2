"""Training-history figures from metrics.json (analysis.metrics.history), several runs overlaid.

A view draws ``ctx.metrics`` (labelled ``ctx.label``) plus any runs in
``ctx.options["overlay_metrics"]`` ({label: metrics dict}), each in its own colour.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.figures.style import LEGEND_RIGHT, RUN_COLORS, apply_style, subplot_spacing
from analysis.metrics import history as hist
from analysis.metrics import null_reference as nr
from analysis.runs.context import AnalysisContext
from analysis.views.view import Comparison, NotApplicable, View
from k3core.data.mqar import mqar_chance


def mqar_queries(metrics: dict) -> int | None:
    """How many MQAR queries each validation scored: eval.mqar's examples x key-value pairs (None when not recorded)."""
    evaluation = metrics.get("eval")
    mqar = evaluation.get("mqar") if isinstance(evaluation, dict) else None
    if not isinstance(mqar, dict):  # older or hand-made metrics files keep other things under "eval"
        return None
    examples, pairs = mqar.get("examples"), mqar.get("num_kv_pairs")
    if isinstance(examples, int) and isinstance(pairs, int) and examples > 0 and pairs > 0:
        return examples * pairs
    return None


def runs_metrics(ctx: AnalysisContext) -> dict[str, dict]:
    """{label: metrics} for this context's run and its overlays (runs without metrics are left out)."""
    runs = {}
    if ctx.metrics:
        runs[ctx.label] = ctx.metrics
    for label, metrics in (ctx.options.get("overlay_metrics") or {}).items():
        if metrics and label not in runs:
            runs[label] = metrics
    if not runs:
        raise NotApplicable("no training history: the run has no metrics.json")
    return runs


def _x_axis(df: pd.DataFrame) -> tuple[str, str]:
    if "tokens" in df and len(df) and df["tokens"].notna().all():
        return "tokens", "tokens seen"
    return "step", "training step"


def run_colours(runs: dict[str, dict]) -> dict[str, str]:
    """One colour per run, by its place among the runs: the same run keeps its colour in every chart, even
    in a chart where an earlier run has no data."""
    return {label: RUN_COLORS[n % len(RUN_COLORS)] for n, label in enumerate(runs)}


# y-axis label per panel of the curves figure, and readable names of logged AttnRes / scale-bias fields
PANEL_Y = {
    "train loss": "nats/token",
    "bits per byte": "bits/byte",
    "val loss": "nats/token",
    "MQAR accuracy": "accuracy (0..1)",
}
FIELD_NAMES = {
    "embedding_weight": ("embedding weight (depth sink)", "mean depth weight"),
    "max_weight": ("largest depth weight", "mean depth weight"),
    "mix_entropy": ("depth-mix entropy (normalised)", "entropy / log n"),
    "query_norm": ("pseudo-query norm ‖w‖", "‖w‖"),
    "attn_scale_mean": ("attention residual scale (mean)", "scale"),
    "mlp_scale_mean": ("FFN residual scale (mean)", "scale"),
    "attn_bias_mean": ("attention residual bias (mean)", "bias"),
    "mlp_bias_mean": ("FFN residual bias (mean)", "bias"),
}


def field_title(name: str) -> tuple[str, str]:
    """(panel title, y-axis label) of a logged field: known fields by name, others made readable
    ("attnres.foo_bar" -> "foo bar")."""
    if name in FIELD_NAMES:
        return FIELD_NAMES[name]
    readable = name.split(".")[-1].replace("_", " ")
    return readable, readable


def _legend_right(fig: go.Figure) -> None:
    """The legend in a column right of the plots, where it covers neither subplot titles nor data."""
    fig.update_layout(legend=dict(LEGEND_RIGHT))


def history_curves_figure(runs: dict[str, dict]) -> tuple[go.Figure, pd.DataFrame]:
    """Train loss, bits/byte (val solid, train dotted), validation loss and MQAR accuracy over training,
    one colour per run."""
    df = pd.concat([hist.curves_table(m, label) for label, m in runs.items()], ignore_index=True)
    if df.empty:
        raise NotApplicable("metrics.json has no loss, validation or MQAR curves")
    panels = [p for p in dict.fromkeys(panel for _, _, panel in hist.CURVES) if p in set(df["panel"])]
    if "bits per byte" in panels and "val loss" in panels:
        panels.remove("val loss")  # the same numbers in another unit
    x, x_title = _x_axis(df)
    colours = run_colours(runs)
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=panels, **subplot_spacing(1, len(panels), 380))
    in_legend: set[str] = set()
    for label, part in df.groupby("run", sort=False):
        for col, panel in enumerate(panels, start=1):
            for curve, c in part[part["panel"] == panel].groupby("curve", sort=False):
                dotted = curve.startswith("train") and panel == "bits per byte"
                # one legend entry per run (its colour); the title says what a dotted line is, so the legend of
                # seven runs fits its column without scrolling
                fig.add_trace(
                    go.Scatter(
                        x=c[x],
                        y=c["value"],
                        mode="lines+markers" if len(c) < 30 else "lines",
                        name=label if not dotted else f"{label} (train)",
                        legendgroup=label,
                        showlegend=not dotted and label not in in_legend,
                        line={"color": colours[label], "dash": "dot" if dotted else None},
                    ),
                    row=1,
                    col=col,
                )
                if not dotted:
                    in_legend.add(label)
    title = "Training curves"
    if (df["panel"] == "bits per byte").any() and df["curve"].str.startswith("train").any():
        title += " (bits/byte: validation solid, training dotted)"
    apply_style(fig, title, height=380)
    for col, panel in enumerate(panels, start=1):
        fig.update_yaxes(title_text=PANEL_Y.get(panel, panel), row=1, col=col)
        if panel == "MQAR accuracy":
            # accuracy against its chance line, on an axis from 0 (a bare 0.004-0.032 span made noise look like
            # a trend); the training data's MQAR rows draw values from 64 byte tokens (k3core.data.mqar)
            chance = mqar_chance()
            top = max(float(df[df["panel"] == panel]["value"].max()), 2 * chance)
            queries = min((mqar_queries(m) or 0 for m in runs.values()), default=0)
            note = f"chance 1/{round(1 / chance)}"  # a legend entry: its range goes on a second line
            hover = note
            if queries:  # the band a guesser reaches with the eval's own number of scored queries
                low, high = nr.chance_interval(round(1 / chance), queries)
                fig.add_hrect(y0=low, y1=high, fillcolor="#888", opacity=0.15, line_width=0, row=1, col=col)
                note += f"<br>(95%: {low:.3f}-{high:.3f})"
                hover = f"a guesser's 95% range over {queries} queries: {low:.3f}-{high:.3f}"
                top = max(top, 1.2 * high)
            # the line carries its own legend entry: a note on it sat over the curve while a run was still at chance
            # (every run's first 1,000 steps), which the figure check reports
            xs = df[df["panel"] == panel][x]
            fig.add_trace(
                go.Scatter(
                    x=[float(xs.min()), float(xs.max())],
                    y=[chance, chance],
                    mode="lines",
                    name=note,
                    line={"color": "#888", "dash": "dash", "width": 1},
                    hovertemplate=f"{hover}<extra></extra>",
                ),
                row=1,
                col=col,
            )
            fig.update_yaxes(range=[0, 1.1 * top], row=1, col=col)
    fig.update_xaxes(title_text=x_title)
    _legend_right(fig)
    return fig, df


def history_moe_figure(runs: dict[str, dict]) -> tuple[go.Figure, pd.DataFrame]:
    """MoE MaxVio and CV over training: mean over MoE layers (solid) and worst layer (dotted) per run."""
    df = pd.concat([hist.moe_balance_table(m, label) for label, m in runs.items()], ignore_index=True)
    if df.empty:
        raise NotApplicable("metrics.json has no MoE load statistics (MaxVio / CV)")
    stats = [s for s in ("MaxVio", "CV") if s in set(df["stat"])]
    colours = run_colours(runs)
    titles = {"MaxVio": "MaxVio = max c / mean c - 1", "CV": "CV = std c / mean c"}
    fig = make_subplots(
        rows=1,
        cols=len(stats),
        subplot_titles=[f"{titles[s]} (mean and max over layers)" for s in stats],
        **subplot_spacing(1, len(stats), 380),
    )
    in_legend: set[str] = set()
    for label, part in df.groupby("run", sort=False):
        for col, stat in enumerate(stats, start=1):
            agg = part[part["stat"] == stat].groupby("step")["value"].agg(["mean", "max"]).reset_index()
            for kind, dash in (("mean", None), ("max", "dot")):
                fig.add_trace(
                    go.Scatter(
                        x=agg["step"],
                        y=agg[kind],
                        mode="lines",
                        name=f"{label} {kind}",
                        legendgroup=label,
                        showlegend=kind == "mean" and label not in in_legend,  # one entry per run, as above
                        line={"color": colours[label], "dash": dash},
                    ),
                    row=1,
                    col=col,
                )
            in_legend.add(label)
    apply_style(fig, "MoE load balance over training (mean over layers solid, worst layer dotted)", height=380)
    for col, stat in enumerate(stats, start=1):
        fig.update_yaxes(title_text=stat, rangemode="tozero", row=1, col=col)
    fig.update_xaxes(title_text="training step")
    _legend_right(fig)
    return fig, df


def history_attnres_figure(runs: dict[str, dict]) -> tuple[go.Figure, pd.DataFrame]:
    """AttnRes summaries over training (embedding weight, max weight, mix entropy, pseudo-query norm, or the
    scale/bias means), mean over sites, one panel per metric."""
    df = pd.concat([hist.attnres_history_table(m, label) for label, m in runs.items()], ignore_index=True)
    if df.empty:
        raise NotApplicable("metrics.json has no AttnRes summaries (history.attnres)")
    metrics = list(dict.fromkeys(df["metric"]))[:6]
    colours = run_colours(runs)
    cols = min(len(metrics), 3)  # at most three panels a row: six in one row ran their titles together
    rows = -(-len(metrics) // cols)
    height = 80 + 300 * rows
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=[field_title(m)[0] for m in metrics],
        **subplot_spacing(rows, cols, height, title_lines=2),
    )
    in_legend: set[str] = set()
    for label, part in df.groupby("run", sort=False):
        for n, metric in enumerate(metrics):
            agg = part[part["metric"] == metric].groupby("step", as_index=False)["value"].mean()
            if agg.empty:
                continue
            fig.add_trace(
                go.Scatter(
                    x=agg["step"],
                    y=agg["value"],
                    mode="lines+markers" if len(agg) < 30 else "lines",
                    name=label,
                    legendgroup=label,
                    showlegend=label not in in_legend,  # the run's first panel, whichever that is
                    line={"color": colours[label]},
                ),
                row=n // cols + 1,
                col=n % cols + 1,
            )
            in_legend.add(label)
    apply_style(fig, "AttnRes over training (mean over sites)", height=height)
    for n, metric in enumerate(metrics):
        fig.update_yaxes(title_text=field_title(metric)[1], row=n // cols + 1, col=n % cols + 1)
    for n in range(len(metrics)):  # the x title under the bottom panel of each column only
        if n + cols >= len(metrics):
            fig.update_xaxes(title_text="training step", row=n // cols + 1, col=n % cols + 1)
    _legend_right(fig)
    return fig, df


def build_curves(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    return history_curves_figure(runs_metrics(ctx))


def build_moe(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    return history_moe_figure(runs_metrics(ctx))


def build_attnres(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    return history_attnres_figure(runs_metrics(ctx))


VIEWS: list[View] = [
    View(
        "history_curves",
        "Training curves",
        "history",
        build_curves,
        description="Train loss, validation bits/byte and MQAR accuracy over training (metrics.json).",
        compare=Comparison(overlay=True, no_difference="training curves of both runs are overlaid in one figure"),
    ),
    View(
        "history_moe",
        "MoE balance over training",
        "history",
        build_moe,
        description="MaxVio and CV of the expert load over training steps.",
        compare=Comparison(overlay=True, no_difference="training curves of both runs are overlaid in one figure"),
    ),
    View(
        "history_attnres",
        "AttnRes over training",
        "history",
        build_attnres,
        description="AttnRes summaries (embedding weight, entropy, ...) logged during training.",
        compare=Comparison(overlay=True, no_difference="training curves of both runs are overlaid in one figure"),
    ),
]
