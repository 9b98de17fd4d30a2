"""Figures for long context (analysis.metrics.long_context from a trace, analysis.experiments.long_runs running the
model): loss by position against the run's short-context loss, KDA state norm and rank over position, the decay horizon
used, MLA entropy and sink mass over position, KDA's implicit-attention distance profile, recall by distance, and
seconds and memory per token against T. Every position axis is logarithmic (position bins double in width)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis.experiments import long_runs as lr
from analysis.figures.papers import MQAR_VIEW
from analysis.figures.style import RUN_COLORS, SEQUENTIAL, accuracy_with_interval, apply_style
from analysis.metrics import kda_attention as ka
from analysis.metrics import long_context as lc
from analysis.metrics import null_reference as nr
from analysis.runs.context import AnalysisContext
from analysis.runs.missing_data import MissingTraceData
from analysis.views import picks as pk
from analysis.views import view
from analysis.views.view import Comparison, NotApplicable, View

SECTION = "long_context"


def _guard(fn, ctx: AnalysisContext) -> pd.DataFrame:
    try:
        return fn(ctx.trace)
    except MissingTraceData as exc:
        raise NotApplicable(str(exc)) from exc


def _short_context(ctx: AnalysisContext) -> int:
    """The run's training length (metrics.json's train_config.seq_len), else the sample default."""
    train = ((ctx.metrics or {}).get("train_config") or {}) if isinstance(ctx.metrics, dict) else {}
    return int(ctx.options.get("short_context") or train.get("seq_len") or lc.DEFAULT_SHORT_CONTEXT)


def build_loss_by_position(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    short = _short_context(ctx)
    df = _guard(lambda trace: lc.loss_by_position_table(trace, short), ctx)
    fig = go.Figure(
        go.Scatter(
            x=df["position"],
            y=df["loss"],
            mode="lines+markers",
            name="mean loss in the bin",
            error_y={"type": "data", "array": df["sem"].fillna(0), "visible": True},
            customdata=np.stack([df["start"], df["stop"] - 1, df["tokens"]], axis=-1),
            hovertemplate="positions %{customdata[0]}–%{customdata[1]} (%{customdata[2]} tokens)<br>"
            "loss %{y:.3f} nats<extra></extra>",
            line={"color": RUN_COLORS[0]},
        )
    )
    base = df.attrs["short_context_loss"]
    if np.isfinite(base) and len(df):  # a legend entry, not a note: a note on the line would sit over the data
        fig.add_trace(
            go.Scatter(
                x=[float(df["position"].min()), float(df["position"].max())],
                y=[base, base],
                mode="lines",
                name=f"short-context loss {base:.3f} (positions < {short})",
                line={"dash": "dash", "color": "#444"},
                hovertemplate=f"mean loss over positions < {short}: %{{y:.3f}}<extra></extra>",
            )
        )
    n = int(df["stop"].max()) if len(df) else 0
    apply_style(
        fig,
        f"Loss by position over {n:,} tokens (error bars: standard error) — {ctx.label}",
        "position (token, log scale)",
        "next-token loss (nats)",
    )
    fig.update_xaxes(type="log")
    return fig, df


LINE_DASHES = ("solid", "dash", "dot", "dashdot")
LINE_MARKERS = ("circle", "square-open", "diamond", "x")


def _lines(
    fig: go.Figure, df: pd.DataFrame, x: str, y: str, focused: bool, row: int | None, show_legend: bool, unit: str
) -> None:
    """One line per layer (mean over heads), or per (layer, head) when a pick focuses the view."""
    if focused:
        lines = df.assign(name=[f"layer {r.layer} head {r.head}" for r in df.itertuples()])
    else:
        lines = df.groupby(["layer", x], as_index=False)[y].mean()
        lines["name"] = [f"layer {v}" for v in lines["layer"]]
    for n, (name, part) in enumerate(lines.groupby("name", sort=False)):
        trace = go.Scatter(
            x=part[x],
            y=part[y],
            mode="lines+markers" if len(part) < 40 else "lines",
            name=name,
            legendgroup=name,
            showlegend=show_legend,
            # a dash and a marker per line: two layers that read the same (near-uniform sinks) stay both visible
            line={"color": RUN_COLORS[n % len(RUN_COLORS)], "dash": LINE_DASHES[n % len(LINE_DASHES)]},
            marker={"symbol": LINE_MARKERS[n % len(LINE_MARKERS)], "size": 7},
            hovertemplate=f"{name}<br>position %{{x:.0f}}<br>{unit} %{{y:.3f}}<extra></extra>",
        )
        fig.add_trace(trace, row=row, col=1) if row is not None else fig.add_trace(trace)


def _two_panels_over_position(
    ctx: AnalysisContext,
    df: pd.DataFrame,
    choices: Any,
    x: str,
    panels: tuple[tuple[str, str, str], tuple[str, str, str]],
    title: str,
    x_title: str,
) -> tuple[go.Figure, pd.DataFrame]:
    """Two stacked panels over position on a log x axis, one line per layer (or per picked layer/head); ``panels``:
    (column, subplot title, hover unit) for the top and the bottom one; ``title`` takes ``{what}``."""
    layer, head = pk.picked(ctx, choices)
    df = pk.filter_picked(df, layer, head)
    focused = layer is not None or head is not None
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=tuple(p[1] for p in panels)
    )
    for row, (column, _, unit) in enumerate(panels, start=1):
        _lines(fig, df, x, column, focused, row, row == 1, unit)
    what = pk.pick_title(choices, layer, head).lstrip(", ") if focused else "mean over heads"
    apply_style(fig, title.format(what=what) + f" — {ctx.label}", None, None, height=560)
    fig.update_xaxes(type="log")
    fig.update_xaxes(title_text=x_title, row=2, col=1)
    return fig, df


def build_kda_state_over_position(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    return _two_panels_over_position(
        ctx,
        _guard(lc.kda_state_by_position_table, ctx),
        pk.kda_state_choices(ctx),
        "token",
        (("state_norm", "state norm ||S||_F", "||S||_F"), ("state_rank", "effective rank of S", "effective rank")),
        "KDA state over position, at each chunk end ({what})",
        "tokens read (log scale)",
    )


def build_decay_horizon(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(lc.decay_horizon_table, ctx)
    choices = pk.kda_choices(ctx)
    layer, head = pk.picked(ctx, choices)
    df = pk.filter_picked(df, layer, head)
    focused = layer is not None or head is not None
    shown = df.assign(horizon=df["horizon"].replace(np.inf, np.nan))
    fig = go.Figure()
    if focused:
        _lines(fig, shown, "position", "horizon", True, None, True, "half-life (tokens)")
    else:  # the median over heads (a mean of half-lives is ruled by the longest one)
        med = shown.groupby(["layer", "position"], as_index=False)["horizon"].median()
        med["head"] = 0
        _lines(fig, med, "position", "horizon", False, None, True, "half-life (tokens)")
    T = int(df["stop"].max())
    fig.add_trace(
        go.Scatter(
            x=[1, T],
            y=[1, T],
            mode="lines",
            name="y = position (reaches the start)",
            line={"dash": "dot", "color": "#888"},
            hoverinfo="skip",
        )
    )
    what = pk.pick_title(choices, layer, head).lstrip(", ") if focused else "median over heads"
    apply_style(
        fig,
        f"KDA decay horizon used: median channel half-life ln 2 / (-mean g) per position bin ({what}) — {ctx.label}",
        "position (token, log scale)",
        "half-life (tokens, log scale)",
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return fig, df


def build_mla_over_position(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """Entropy and sink mass over position bins, with uniform causal attention drawn beside them (entropy 1; sink
    mass 1/(i+1) at query i, its bin mean (H_stop - H_start) / (stop - start)): a sink mass falling as 1/(i+1) is
    what uniform attention does anyway."""
    df = _guard(lc.mla_by_position_table, ctx)
    start, stop = df["start"].to_numpy(), df["stop"].to_numpy()
    df = df.assign(
        uniform_entropy_norm=1.0, uniform_sink_mass=(nr.harmonic(stop) - nr.harmonic(start)) / (stop - start)
    )
    fig, df = _two_panels_over_position(
        ctx,
        df,
        pk.mla_choices(ctx),
        "position",
        (
            ("entropy_norm", "normalised entropy H / log(i+1)", "H / log(i+1)"),
            ("sink_mass", "sink mass (attention on token 0)", "sink mass"),
        ),
        "MLA attention over position ({what})",
        "query position (token, log scale)",
    )
    bins = df.drop_duplicates("bin").sort_values("position")
    for row, column in ((1, "uniform_entropy_norm"), (2, "uniform_sink_mass")):
        fig.add_trace(
            go.Scatter(
                x=bins["position"],
                y=bins[column],
                mode="lines",
                name="uniform causal attention (null reference)",
                legendgroup="uniform",
                showlegend=row == 1,
                line={"color": "#888", "dash": "dash", "width": 2},
                hovertemplate="uniform attention: %{y:.4g}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    return fig, df


def _model(ctx: AnalysisContext):
    if ctx.model is None:
        raise NotApplicable("this view runs the model: load the checkpoint (a trace folder has no weights)")
    return ctx.model


def recall_table(ctx: AnalysisContext, progress: lr.Progress = None) -> pd.DataFrame:
    """The recall-by-distance table of this context's model, computed once (options: recall_distances,
    recall_examples); ``progress(done, total)`` while it runs."""
    model = _model(ctx)
    distances = tuple(ctx.options.get("recall_distances") or lr.DEFAULT_DISTANCES)
    examples = int(ctx.options.get("recall_examples") or 16)
    return ctx.once(
        ("recall", distances, examples), lambda: lr.recall_by_distance(model, distances, examples, progress=progress)
    )


def build_recall_by_distance(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = recall_table(ctx)
    if df.empty:
        raise NotApplicable("the recall run was stopped before its first distance")
    df = nr.with_chance_band(df, "examples")
    fig = accuracy_with_interval(df["distance"].to_numpy(), df, "recall accuracy", "distance", "examples")
    n = int(df["examples"].iloc[0])
    at_chance = int(df["at_chance"].sum())
    apply_style(
        fig,
        f"Recall by distance: key-value pair d tokens before its query, {n} examples each ({at_chance} of "
        f"{len(df)} distances within chance) — {ctx.label}",
        "distance from the value to the query (tokens, log scale)",
        "share recalled (argmax = value)",
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(range=[0, 1.02])
    return fig, df


def cost_table(ctx: AnalysisContext, progress: lr.Progress = None) -> pd.DataFrame:
    """Seconds and peak memory per token against T for this context's model, computed once (option
    cost_lengths); ``progress(done, total)`` while it runs."""
    model = _model(ctx)
    lengths = tuple(ctx.options.get("cost_lengths") or lr.DEFAULT_LENGTHS)
    return ctx.once(("cost", lengths), lambda: lr.cost_by_length(model, lengths, progress=progress))


def build_cost_by_length(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = cost_table(ctx)
    if df.empty:
        raise NotApplicable("the cost run was stopped before its first length")
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.14,
        subplot_titles=("milliseconds per token (measured, from 0)", "bytes per token (log scale)"),
    )
    fig.add_trace(
        go.Scatter(
            x=df["seq_len"],
            y=df["seconds_per_token"] * 1e3,
            mode="lines+markers",
            name="forward, ms per token",
            line={"color": RUN_COLORS[0]},
            hovertemplate="T = %{x}<br>%{y:.3f} ms per token<extra></extra>",
        ),
        row=1,
        col=1,
    )
    series = (
        ("bytes_per_token", "peak memory growth (measured)", RUN_COLORS[1], "solid"),
        ("cache_per_token", "decode cache, model: total", RUN_COLORS[2], "dash"),
        ("cache_kda_per_token", "decode cache, model: KDA (flat state)", RUN_COLORS[3], "dot"),
        ("cache_mla_per_token", "decode cache, model: MLA (latent per token)", RUN_COLORS[4], "dot"),
    )
    shown = df.assign(
        cache_per_token=df["cache_bytes"] / df["seq_len"],
        cache_kda_per_token=df["cache_bytes_kda"] / df["seq_len"],
        cache_mla_per_token=df["cache_bytes_mla"] / df["seq_len"],
    )
    for column, name, color, dash in series:
        fig.add_trace(
            go.Scatter(
                x=shown["seq_len"],
                y=shown[column],
                mode="lines+markers",
                name=name,
                line={"color": color, "dash": dash},
                hovertemplate=f"T = %{{x}}<br>{name}: %{{y:,.1f}} B per token<extra></extra>",
            ),
            row=1,
            col=2,
        )
    apply_style(
        fig,
        f"Cost against length: one forward per T (peak RSS growth of the whole process) beside the decode-cache "
        f"model (fp32) — {ctx.label}",
        None,
        None,
        height=460,
    )
    lengths = sorted(int(v) for v in df["seq_len"].unique())
    # a tenth of a decade either side: the first length's tick clear of the time axis' 0 in the corner
    span = [np.log10(lengths[0]) - 0.1, np.log10(lengths[-1]) + 0.1]
    fig.update_xaxes(type="log", title_text="T (tokens, log scale)", range=span, **length_ticks(lengths))
    # time from zero on a linear axis: a few timings under load that differ by 10-20% are not drawn as a trend
    fig.update_yaxes(type="linear", rangemode="tozero", title_text="ms per token", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=2)  # its unit is the panel's title (an axis title sat on the left panel)
    return fig, df


def compact_count(n: int) -> str:
    """A token count as a short tick label (K = 1000, M = 10^6, three significant digits): 512, 3K, 4.1K, 1.05M."""
    if n >= 1_000_000:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e3:.3g}K" if n >= 1000 else str(n)


def length_ticks(lengths: list[int], min_ratio: float = 1.6) -> dict:
    """Tick values and labels for a log axis of lengths: each measured length, skipping one closer than
    ``min_ratio`` to the last labelled (3000, 4000, 5000 drew "30004000 5000" with plotly's own ticks)."""
    kept: list[int] = []
    for n in lengths:
        if not kept or n >= min_ratio * kept[-1]:
            kept.append(n)
    return {"tickmode": "array", "tickvals": kept, "ticktext": [compact_count(n) for n in kept]}


def build_kda_distance(ctx: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    df = _guard(ka.distance_profile_table, ctx)
    mean = df.groupby(["position", "distance"], as_index=False)["share"].mean()
    table = mean.pivot(index="distance", columns="position", values="share").sort_index()
    fig = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=[f"{p}+" for p in table.columns],
            y=[f"{int(d)}+" for d in table.index],
            colorscale=SEQUENTIAL,
            zmin=0.0,
            colorbar={"title": {"text": "share of |A|"}},
            hovertemplate="queries from position %{x}<br>distance %{y}<br>share %{z:.3f}<extra></extra>",
        )
    )
    apply_style(
        fig,
        f"KDA distance profile over position: share of |A| by distance bin (mean over KDA layers and heads) — "
        f"{ctx.label}",
        "query position bin (tokens, from)",
        "distance t - s (bin, from)",
    )
    return fig, df


VIEWS: list[View] = [
    View(
        "long_loss_by_position",
        "Loss by position",
        SECTION,
        build_loss_by_position,
        description="Mean next-token loss per position bin (log x) against the run's short-context loss.",
        compare=Comparison(difference=("loss",), keys=("start",), x="start"),
    ),
    View(
        "long_kda_state",
        "KDA state over position",
        SECTION,
        build_kda_state_over_position,
        description="State norm and effective rank of each KDA head at every chunk end.",
        compare=Comparison(
            difference=("state_norm", "state_rank"), keys=("layer", "head", "token"), reduce=("head",), x="token"
        ),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_state_choices),
    ),
    View(
        "long_decay_horizon",
        "KDA decay horizon used",
        SECTION,
        build_decay_horizon,
        description="Median channel half-life of the decays actually applied, per position bin.",
        compare=Comparison(difference=("horizon",), keys=("layer", "head", "start"), reduce=("head",), x="start"),
        picks=view.Picks((view.LAYER, view.HEAD), pk.kda_choices),
    ),
    View(
        "long_mla_position",
        "MLA entropy and sink over position",
        SECTION,
        build_mla_over_position,
        description="Causal-normalised entropy and first-token mass of each MLA head per position bin.",
        compare=Comparison(
            difference=("entropy_norm", "sink_mass"), keys=("layer", "head", "start"), reduce=("head",), x="start"
        ),
        picks=view.Picks((view.LAYER, view.HEAD), pk.mla_choices),
    ),
    View(
        "long_kda_distance",
        "KDA distance profile over position",
        SECTION,
        build_kda_distance,
        description="Share of KDA's implicit attention |A| by distance, for each query position bin.",
        compare=Comparison(
            difference=("share",), keys=("layer", "position", "distance"), reduce=("layer",), x="distance"
        ),
    ),
    View(
        "long_recall_distance",
        "Recall by distance",
        SECTION,
        build_recall_by_distance,
        needs_model=True,
        description="MQAR-style recall of a key-value pair placed d tokens before its query.",
        compare=Comparison(difference=("accuracy",), keys=("distance",)),
    ),
    MQAR_VIEW,
    View(
        "long_cost_length",
        "Seconds and memory per token",
        SECTION,
        build_cost_by_length,
        needs_model=True,
        description="Measured seconds and peak memory per token against T, beside the decode-cache model.",
        compare=Comparison(difference=("seconds_per_token", "bytes_per_token"), keys=("seq_len",)),
    ),
]
