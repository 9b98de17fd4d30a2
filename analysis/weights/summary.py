"""The weight summary: every table the weight-only views show (``WeightSummary``), built from plain arrays
(``summarize_values``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from k3core.loading.names import counts_as_parameter
from k3core.modeling.config import K3Config

from .decay import kda_tables
from .layout import layer_structure, numel, params_by_depth
from .residual import norm_table, query_norm_table, scale_bias_table
from .routing import expert_norm_table, router_bias_spread, router_bias_table, router_norm_table


@dataclass
class WeightSummary:
    """Everything the weight-only views show, as tidy tables (see each builder for the columns)."""

    label: str
    config: K3Config | None
    total_params: int
    bytes_total: int
    bytes_read: int
    seconds: float
    skipped: list[str]
    structure: pd.DataFrame  # layer, mixer, ffn, params
    params: pd.DataFrame  # params_by_depth
    kda_layers: pd.DataFrame
    kda_heads: pd.DataFrame
    query_norms: pd.DataFrame
    scale_bias: pd.DataFrame
    norms: pd.DataFrame
    router_bias: pd.DataFrame
    router_bias_stats: pd.DataFrame
    router_norms: pd.DataFrame
    expert_norms: pd.DataFrame | None = None  # only with experts=True
    notes: list[str] = field(default_factory=list)
    path: str = ""
    expert_bytes: int = 0  # what experts=True reads on top (``expert_bytes``)

    @property
    def num_layers(self) -> int:
        return len(self.structure)


def summarize_values(
    values: Mapping[str, np.ndarray],
    shapes: Mapping[str, Any],
    config: K3Config | None,
    expert_sums: Mapping[str, float] | None = None,
    notes: list[str] | None = None,
    structure: pd.DataFrame | None = None,
) -> WeightSummary:
    """A WeightSummary from plain arrays: ``values`` maps canonical tensor names to the tensors of
    ``small_tensor_names`` (router weights as their row norms), ``shapes`` every tensor's meta (shape,
    nbytes); ``expert_sums`` the sum of squares of each expert matrix (None: no expert norms); ``structure``
    the ``layer_structure`` when the caller has it already."""
    structure = layer_structure(shapes, config) if structure is None else structure[["layer", "mixer", "ffn"]]
    n = len(structure)
    params = params_by_depth(shapes, structure)
    layer_params = params[(params["layer"] >= 0) & (params["layer"] < n)].groupby("layer")["params"].sum()
    structure = structure.assign(params=[int(layer_params.get(i, 0)) for i in structure["layer"]])
    structure.attrs["keys"] = ["layer"]
    kda_layers, kda_heads = kda_tables(values, structure, config)
    bias = router_bias_table(values, n)
    return WeightSummary(
        label="",
        config=config,
        total_params=int(sum(numel(m) for name, m in shapes.items() if counts_as_parameter(name))),
        bytes_total=int(sum(int(getattr(m, "nbytes", 0)) for m in shapes.values())),
        bytes_read=0,
        seconds=0.0,
        skipped=[],
        structure=structure,
        params=params,
        kda_layers=kda_layers,
        kda_heads=kda_heads,
        query_norms=query_norm_table(values, n),
        scale_bias=scale_bias_table(values, n),
        norms=norm_table(values, n),
        router_bias=bias,
        router_bias_stats=router_bias_spread(bias),
        router_norms=router_norm_table(values, n),
        expert_norms=expert_norm_table(expert_sums, n) if expert_sums is not None else None,
        notes=list(notes or []),
    )
