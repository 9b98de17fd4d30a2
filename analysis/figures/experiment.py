"""Figures for experiments: per-token loss change of an edit, activation-patching heatmaps, token
attribution (output x input), layer attribution by kind, and the AttnRes / logit lens."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.experiments.attribution import TokenAttribution
from analysis.experiments.layer_attribution import LayerAttribution
from analysis.figures.style import DIVERGING, LAYER_TYPE_COLORS, SEQUENTIAL_REVERSED, apply_style, mark_repeat_start
from analysis.runs.context import AnalysisContext
from analysis.views.view import Comparison, NotApplicable, View

KIND_COLORS = {
    "KDA": LAYER_TYPE_COLORS["KDA"],
    "MLA": LAYER_TYPE_COLORS["MLA"],
    "dense": LAYER_TYPE_COLORS["dense FFN"],
    "routed": LAYER_TYPE_COLORS["LatentMoE"],
    "shared": "#9467bd",
}


def _symmetric(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.abs(finite).max()) if finite.size else 1.0


def loss_change_figure(
    effects: pd.DataFrame, title: str = "Per-token loss change of the edit", repeat_start: int | None = None
) -> go.Figure:
    """Bars: edited - baseline next-token loss per position (positive: the edit hurts); a copy task's second half
    marked from ``repeat_start``."""
    labels = [f"{r.position}: {r.token!s}" for r in effects.itertuples()]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=effects.loss_change,
            marker_color=np.where(effects.loss_change > 0, "#d62728", "#1f77b4"),
            customdata=np.stack([effects.base_loss, effects.edited_loss, effects.next_token.astype(str)], -1),
            hovertemplate="%{x} -> %{customdata[2]}<br>baseline %{customdata[0]:.3f} nats<br>"
            "edited %{customdata[1]:.3f} nats<br>change %{y:+.3f}<extra></extra>",
        )
    )
    positions = effects.position.tolist()
    if repeat_start in positions:  # category axis: the bar of position p stands at its index
        mark_repeat_start(fig, positions.index(repeat_start) - 0.5)
    return apply_style(fig, title, "position: token", "loss change (nats, edited - baseline)")


def patching_figure(df: pd.DataFrame) -> go.Figure:
    """Heatmap of the fraction of the metric restored: layer x site, or position x layer for one site
    when the table is per position."""
    per_position = (df.position >= 0).any()
    if per_position:
        table = df.groupby(["layer", "position"]).fraction_restored.mean().unstack("position")
        x_title, y_title = "position patched", "layer"
        site = ", ".join(sorted(df.site.unique()))
        title = f"Activation patching: fraction restored per position ({site})"
    else:
        order = [s for s in ("resid", "mixer_out", "ffn_out", "depth_weights") if s in set(df.site)]
        table = df.groupby(["layer", "site"]).fraction_restored.mean().unstack("site")[order]
        x_title, y_title, title = "site", "layer", "Activation patching: fraction of the metric restored"
    z = table.to_numpy(dtype=float)
    bound = max(1.0, _symmetric(z))
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(c) for c in table.columns],
            y=[f"L{i}" for i in table.index],
            colorscale=DIVERGING,
            zmid=0,
            zmin=-bound,
            zmax=bound,
            texttemplate="%{z:.2f}" if z.size <= 400 else None,
            colorbar={"title": {"text": "restored"}},
            hovertemplate="%{y} %{x}<br>fraction restored %{z:.3f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    clean, corrupt = df.attrs.get("clean_metric"), df.attrs.get("corrupted_metric")
    if clean is not None:
        title += f" (clean {clean:.3f}, corrupted {corrupt:.3f})"
    return apply_style(fig, title, x_title, y_title)


def attribution_figure(result: TokenAttribution) -> go.Figure:
    """Output token x input token heatmap of the attributions (diverging, zero white)."""
    z = result.matrix.numpy()
    bound = _symmetric(z) or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"{i}: {t}" for i, t in enumerate(result.input_labels)],
            y=[f"{j}: {t}" for j, t in enumerate(result.output_labels)],
            colorscale=DIVERGING,
            zmid=0,
            zmin=-bound,
            zmax=bound,
            colorbar={"title": {"text": "attribution"}},
            hovertemplate="output %{y}<br>input %{x}<br>attribution %{z:.4f}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    note = ""
    if result.delta is not None:
        note = f"; IG delta max |{max(abs(d) for d in result.delta):.2g}|"
    return apply_style(
        fig,
        f"Attribution ({result.method}) of log p(output token); baseline: {result.baseline}{note}",
        "input token",
        "output token",
    )


def layer_attribution_figure(result: LayerAttribution) -> go.Figure:
    """Bars per layer and sub-layer output, coloured by kind (KDA, MLA, dense, routed, shared)."""
    fig = go.Figure()
    depth_order = [f"L{r.layer} {r.group}" for r in result.table.sort_values(["layer", "group"]).itertuples()]
    for kind, rows in result.table.groupby("kind", sort=False):
        fig.add_bar(
            x=[f"L{r.layer} {r.group}" for r in rows.itertuples()],
            y=rows.attribution,
            name=f"{kind} ({rows.attribution.sum():+.3f})",
            marker_color=KIND_COLORS.get(kind, "#7f7f7f"),
            hovertemplate="%{x}<br>attribution %{y:.4f}<extra>" + kind + "</extra>",
        )
    # one trace per kind: without a fixed order the categories would follow the traces (every KDA layer first)
    fig.update_xaxes(categoryorder="array", categoryarray=depth_order)
    return apply_style(
        fig,
        f"Layer attribution (integrated gradients; f = {result.f_model:.3f}, "
        f"all sub-layers off = {result.f_baseline:.3f}, delta {result.delta:.2g})",
        "sub-layer output",
        "attribution to sum log p(target)",
    )


def lens_figure(table: pd.DataFrame, value: str = "next_rank") -> go.Figure:
    """Depth x position heatmap of the lens: the next token's rank (log colour) or KL to the final."""
    pivot = table[table.position < table.position.max()] if value == "next_rank" else table
    wide = pivot.pivot_table(index="depth", columns="position", values=value)
    labels = table.drop_duplicates("depth").set_index("depth").label
    z = wide.to_numpy(dtype=float)
    shown = np.log10(1 + z) if value == "next_rank" else z
    fig = go.Figure(
        go.Heatmap(
            z=shown,
            x=[str(c) for c in wide.columns],
            y=[labels[d] for d in wide.index],
            customdata=z,
            colorscale=SEQUENTIAL_REVERSED,
            colorbar={"title": {"text": "log10(1 + rank)" if value == "next_rank" else "KL (nats)"}},
            hovertemplate="%{y}<br>position %{x}<br>" + value + " %{customdata:.4g}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    what = "rank of the actual next token" if value == "next_rank" else "KL(final || depth)"
    return apply_style(fig, f"Lens: {what} per depth", "position", "depth")


def mla_attention_figure(rows: pd.DataFrame, query: int, what: str) -> go.Figure:
    """Bars: one MLA head's attention from token ``query`` to each key position 0..query, keys on a numeric axis
    (in position order, not as text: 0, 1, 2, ..., never 0, 105, 112, 12)."""
    keys = rows.key.astype(int).to_numpy()
    order = np.argsort(keys, kind="stable")
    fig = go.Figure(
        go.Bar(
            x=keys[order],
            y=rows.prob.to_numpy()[order],
            marker_color=LAYER_TYPE_COLORS["MLA"],
            hovertemplate="key %{x}<br>attention %{y:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(type="linear", range=[-0.5, query + 0.5])
    fig.update_yaxes(rangemode="tozero")
    return apply_style(fig, f"MLA attention from token {query} ({what})", "key position", "attention weight")


# ----------------------------------------------------------------------------------------- views
# The experiment's inputs travel in the view options, as picks do (``analysis.views.picks``): ``edits`` (a list of edit
# dicts, ``k3core.interp.interventions.edit_from_dict``), ``patching`` (``patching_spec``), ``attribution``
# (``attribution_spec``) and ``lens_value``. A view whose spec is absent (the report, a Compare section) says so
# (NotApplicable) instead of guessing an experiment; the lens needs none (no edits: the baseline's).
EDITS, PATCHING, ATTRIBUTION, LENS_VALUE = "edits", "patching", "attribution", "lens_value"


def patching_spec(
    position: int,
    token: int,
    metric: dict,
    sites: list[str] | None = None,
    per_position: bool = False,
    positions: list[int] | None = None,
) -> dict:
    """The ``patching`` view option: corrupt ``position`` to ``token``; ``metric`` is ``patching.Metric.to_dict()``;
    per position over the window ``positions`` = [from, to) (None: every position)."""
    return {
        "position": int(position),
        "token": int(token),
        "metric": dict(metric),
        "sites": list(sites) if sites else None,
        "per_position": bool(per_position),
        "positions": list(positions) if positions else None,
    }


def attribution_spec(
    prompt_tokens: int,
    target: list[int] | None = None,
    method: str = "feature_ablation",
    baseline: int = 0,
    steps: int = 64,
    samples: int = 8,
    seed: int = 0,
) -> dict:
    """The ``attribution`` view option: the text's first ``prompt_tokens`` tokens attributed for ``target`` (token
    ids; None: the text's next 4 tokens), with the method's steps (IG), samples and seed (Shapley)."""
    return {
        "prompt_tokens": int(prompt_tokens),
        "target": [int(t) for t in target] if target else None,
        "method": method,
        "baseline": int(baseline),
        "steps": int(steps),
        "samples": int(samples),
        "seed": int(seed),
    }


def _needs_model(ctx) -> None:
    if ctx.model is None or ctx.input_ids is None:
        raise NotApplicable("experiments rerun the model: this run has no loaded model or tokens")


def _spec(ctx, name: str, what: str) -> dict:
    _needs_model(ctx)
    spec = ctx.options.get(name)
    if not spec:
        raise NotApplicable(f"no {what} chosen (the view option {name!r} is unset; there is no default)")
    return spec


def _token_label(ctx: AnalysisContext):
    """A short printable label of a token id (escapes shown as text: '\\x00', never a raw control character)."""
    return lambda i: repr(ctx.token_texts([int(i)])[0])[1:-1] or "∅"


def _first_row(ctx):
    model = ctx.model
    return ctx.input_ids[:1].to(next(model.parameters()).device)


def experiment_effects(ctx: AnalysisContext) -> tuple[pd.DataFrame, dict]:
    """(per-token effects table, summary) of the edits in ``ctx.options["edits"]`` (``effects.run_experiment``),
    computed once per edit list on the context."""
    import json

    from analysis.experiments import effects
    from k3core.interp.interventions import edit_from_dict

    dicts = _spec(ctx, EDITS, "edits")

    def compute():
        ids = _first_row(ctx)
        exp = effects.run_experiment(ctx.model, ids, [edit_from_dict(d) for d in dicts])
        ids_cpu = ids.cpu()
        cpu = effects.Experiment(exp.edits, exp.base_logits.cpu(), exp.edited_logits.cpu())
        return cpu.effects(ids_cpu, _token_label(ctx)), cpu.summary(ids_cpu)

    return ctx.once(f"experiment:edits:{json.dumps(dicts, sort_keys=True)}", compute)


def experiment_patching(ctx: AnalysisContext) -> pd.DataFrame:
    """``patching.activation_patching`` of the spec in ``ctx.options["patching"]`` (``patching_spec``)."""
    import json

    from analysis.experiments import patching

    spec = _spec(ctx, PATCHING, "patching (corrupted token and metric)")

    def compute():
        ids = _first_row(ctx)
        corrupted = ids.clone()
        corrupted[0, spec["position"]] = spec["token"]
        positions = tuple(spec["positions"]) if spec.get("positions") else None
        return patching.activation_patching(
            ctx.model,
            ids,
            corrupted,
            patching.Metric(**spec["metric"]),
            sites=spec.get("sites") or list(patching.SITES),
            per_position=spec.get("per_position", False),
            positions=positions,
        )

    return ctx.once(f"experiment:patching:{json.dumps(spec, sort_keys=True)}", compute)


def _attribution_inputs(ctx, spec: dict):
    import torch

    ids = ctx.input_ids[0].cpu()
    n = spec["prompt_tokens"]
    target = torch.tensor(spec["target"]) if spec.get("target") else ids[n : n + 4]
    return ids[:n], target


def experiment_token_attribution(ctx: AnalysisContext) -> TokenAttribution:
    """``attribution.token_attribution`` of the spec in ``ctx.options["attribution"]`` (``attribution_spec``)."""
    import json

    from analysis.experiments import attribution

    spec = _spec(ctx, ATTRIBUTION, "attribution (prompt, target and method)")
    x, y = _attribution_inputs(ctx, spec)
    return ctx.once(
        f"experiment:attribution:{json.dumps(spec, sort_keys=True)}",
        lambda: attribution.token_attribution(
            ctx.model,
            x,
            y,
            spec["method"],
            spec["baseline"],
            ctx.tokenizer,
            spec["steps"],
            spec["samples"],
            spec["seed"],
        ),
    )


def experiment_layer_attribution(ctx: AnalysisContext) -> LayerAttribution:
    """``layer_attribution`` of the prompt, target and steps in ``ctx.options["attribution"]``."""
    import json

    from analysis.experiments.layer_attribution import layer_attribution

    spec = _spec(ctx, ATTRIBUTION, "attribution (prompt, target and steps)")
    x, y = _attribution_inputs(ctx, spec)
    key = json.dumps({k: spec.get(k) for k in ("prompt_tokens", "target", "steps")}, sort_keys=True)
    return ctx.once(f"experiment:layers:{key}", lambda: layer_attribution(ctx.model, x, y, spec["steps"]))


def experiment_lens(ctx: AnalysisContext) -> pd.DataFrame:
    """``lens.lens_table`` of the forward with ``ctx.options["edits"]`` applied (none: the baseline's)."""
    import json

    from analysis.metrics import lens
    from k3core.interp.interventions import edit_from_dict, intervene

    _needs_model(ctx)
    dicts = ctx.options.get(EDITS) or []

    def compute():
        ids = _first_row(ctx)
        with intervene(ctx.model, [edit_from_dict(d) for d in dicts]):
            labels, logits = lens.lens_logits(ctx.model, ids)
        return lens.lens_table(labels, logits.cpu(), ids.cpu(), 5, _token_label(ctx))

    return ctx.once(f"experiment:lens:{json.dumps(dicts, sort_keys=True)}", compute)


def _loss_change_view(ctx):
    table, _ = experiment_effects(ctx)
    return loss_change_figure(table, repeat_start=ctx.repeat_start), table


def _patching_view(ctx):
    df = experiment_patching(ctx)
    return patching_figure(df), df


def _attribution_view(ctx):
    result = experiment_token_attribution(ctx)
    return attribution_figure(result), result.table()


def _layer_attribution_view(ctx):
    result = experiment_layer_attribution(ctx)
    return layer_attribution_figure(result), result.table


def _lens_view(ctx):
    table = experiment_lens(ctx)
    value = ctx.options.get(LENS_VALUE) or "next_rank"
    fig = lens_figure(table, value)
    if ctx.options.get(EDITS):
        fig.update_layout(title_text=fig.layout.title.text + " (edited)")
    return fig, table.drop(columns=["top_ids"], errors="ignore")


def _views():
    no_diff = Comparison(no_difference="an experiment's result is already a comparison, baseline against edited")
    return [
        View(
            "experiment_loss_change",
            "Per-token loss change of the edits",
            "experiment",
            _loss_change_view,
            needs_model=True,
            description="Edited - baseline next-token loss per position (positive, red: the edit hurts).",
            compare=Comparison(difference=("loss_change",), keys=("position",)),
        ),
        View(
            "experiment_patching",
            "Activation patching",
            "experiment",
            _patching_view,
            needs_model=True,
            description="Fraction of the clean - corrupted metric gap restored by writing one clean activation into "
            "the corrupted run: (patched - corrupted) / (clean - corrupted).",
            compare=no_diff,
        ),
        View(
            "experiment_attribution",
            "Token attribution",
            "experiment",
            _attribution_view,
            needs_model=True,
            description="Attribution of each target token's log-probability to each prompt token.",
            compare=no_diff,
        ),
        View(
            "experiment_layer_attribution",
            "Layer attribution",
            "experiment",
            _layer_attribution_view,
            needs_model=True,
            description="Integrated gradients over multipliers of every sub-layer output, in depth order.",
            compare=no_diff,
        ),
        View(
            "experiment_lens",
            "Lens (AttnRes / logit lens)",
            "experiment",
            _lens_view,
            needs_model=True,
            description="What the model would predict if it stopped at each depth; the last depth is its own "
            "prediction (with edits: the edited model's).",
            compare=no_diff,
        ),
    ]


VIEWS = _views()
