"""Figures of the weight-only diagnostics (analysis.weights): what a checkpoint learned, read from its
small tensors. They need no trace and no model: a context carrying a ``WeightSummary`` (``ctx.weights``)
is enough, so they work for a checkpoint far too large to load. For a loaded run without a summary the
summary is computed from the model's parameters (once per model).

This module lists the views, in report order; their builders live by subject in ``weights_kda``,
``weights_attnres``, ``weights_router`` and ``weights_norms_params``, and ``weights_source.weights_of`` finds
the summary."""

from __future__ import annotations

from analysis.figures.weights_attnres import build_query_norms, build_scale_bias
from analysis.figures.weights_kda import build_kda_half_life, build_kda_heads
from analysis.figures.weights_norms_params import build_norms, build_params
from analysis.figures.weights_router import (
    build_expert_norms,
    build_router_bias,
    build_router_bias_spread,
    build_router_norms,
)
from analysis.views.view import Comparison, View

UNITS = (
    "expert / head e of one checkpoint and expert / head e of another are different learned units; "
    "compare the per-layer views"
)

VIEWS: list[View] = [
    View(
        "weights_kda_half_life",
        "KDA resting half-life by layer",
        "weights",
        build_kda_half_life,
        description="The KDA decay gate with zero input, g0, as a half-life ln2/(-g0) in tokens per channel: "
        "median and 10th-90th percentiles over each layer's channels. MLA layers keep every token (unbounded).",
        from_weights=True,
        compare=Comparison(difference=("half_life_median",), keys=("layer",)),
    ),
    View(
        "weights_kda_heads",
        "KDA resting half-life per head",
        "weights",
        build_kda_heads,
        description="Median resting half-life over each head's channels, layer x head (log colour scale).",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "attnres_query_norms",
        "AttnRes pseudo-query norms",
        "attnres",
        build_query_norms,
        description="Norm of each learned pseudo-query (attention site, MLP site, output mix): the learned "
        "sharpness of attention over depth; 0 means a uniform average of the sources.",
        from_weights=True,
        compare=Comparison(difference=("query_norm",), keys=("layer", "site")),
    ),
    View(
        "attnres_scale_bias",
        "Residual scale and bias per depth",
        "attnres",
        build_scale_bias,
        description="Scale/bias residual runs: learned scale and bias per depth and site (mean, with the "
        "standard deviation over channels), against the initial scale.",
        from_weights=True,
        compare=Comparison(difference=("scale_mean", "bias_mean"), keys=("layer", "site")),
    ),
    View(
        "weights_router_bias",
        "Router selection bias per layer x expert",
        "weights",
        build_router_bias,
        description="e_score_correction_bias: what load balancing pushed up (red) or down (blue) per expert; it "
        "steers which experts are chosen, not their weights.",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "moe_bias",
        "Router selection bias spread per layer",
        "moe",
        build_router_bias_spread,
        description="Per MoE layer: the selection bias's standard deviation, mean and min-max range over experts.",
        from_weights=True,
        compare=Comparison(difference=("std",), keys=("layer",)),
    ),
    View(
        "weights_router_norms",
        "Router weight norm per expert",
        "weights",
        build_router_norms,
        description="L2 norm of each expert's router row: how strongly the router's score for that expert "
        "responds to the hidden state.",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
    View(
        "weights_norms",
        "Norm weights by depth",
        "weights",
        build_norms,
        description="Mean and max gain of the input, post-attention, KDA output and latent expert RMSNorms.",
        from_weights=True,
        compare=Comparison(difference=("mean",), keys=("layer", "norm"), x="layer"),
    ),
    View(
        "weights_params",
        "Parameters by depth and kind",
        "weights",
        build_params,
        description="Parameter counts per decoder layer (plus embedding and output) split by kind, from the "
        "safetensors header shapes alone.",
        from_weights=True,
        compare=Comparison(difference=("params",), keys=("layer", "kind"), x="layer"),
    ),
    View(
        "weights_expert_norms",
        "Routed expert weight norms",
        "weights",
        build_expert_norms,
        description="Frobenius norm of each routed expert's three matrices, layer x expert (needs --experts: it "
        "reads every expert matrix).",
        from_weights=True,
        compare=Comparison(no_difference=UNITS),
    ),
]
