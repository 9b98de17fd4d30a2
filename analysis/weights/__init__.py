"""Weight-only diagnostics: what a checkpoint learned, from its small tensors, without building the model.

The tensors that describe K3's learned depth, decay and routing are tiny next to the experts: the KDA
gate's ``A_log`` and ``dt_bias``, the AttnRes pseudo-queries, the router selection biases, the norm
scales. ``read_weight_summary(path)`` reads the safetensors headers (parameter layout by depth comes
from the shapes alone) and then only those tensors, one at a time, so a 5 TB checkpoint answers in
seconds on a laptop. ``experts=True`` additionally streams every routed expert matrix for per-expert
weight norms (that reads nearly the whole checkpoint; ``expert_bytes`` says how much first).

The tables (``layout``, ``decay``, ``residual``, ``routing``) are small pure functions on numpy arrays; the
readers (``read``) only decide which tensors to fetch. A loaded model gives the same summary through
``StateDictSource`` (the app and the report use it for runs that are loaded anyway).

The numbers (formulas in each function's docstring):

- KDA resting decay: the gate with zero input, g0 = lb * sigmoid(exp(A_log) * dt_bias) (lower-bound gate,
  K3) or g0 = -exp(A_log) * softplus(dt_bias) (softplus gate, Kimi Linear), one value per head and
  channel; half-life = ln 2 / (-g0) tokens (the state's memory of that channel halves every half-life);
- AttnRes pseudo-query norm ||w|| per site (attention, MLP, output mix; 0 = uniform mix over depth);
- scale/bias residual: per depth and site the learned scale and bias (mean and std over channels);
- router selection bias e_bias per layer x expert, its spread per layer, router weight row norms;
- norm weights (input, post-attention, KDA output norm, latent expert norm): mean and max per layer;
- parameters by depth and kind, from the header shapes;
- with experts: Frobenius norm of each routed expert (w1, w2, w3 together) per layer x expert.

Modules, one job each: ``source`` (tensor sources: a checkpoint folder header-only, a loaded model),
``layout`` (layers, kinds and parameters from names and shapes; which tensors are read), ``decay`` (KDA
resting decay), ``residual`` (AttnRes queries, scale/bias, norm gains), ``routing`` (router biases and
norms, expert norms), ``summary`` (``WeightSummary``, ``summarize_values``), ``read`` (reading a source into
a summary), ``document`` (``weights.json``). The ``k3lab weights`` output folder is ``analysis.output.weights_folder``.
"""

from analysis.metrics.kda_memory import LN2, half_life

from .decay import kda_tables, live_a_log, resting_decay, spread
from .document import weights_json, write_weights_json
from .layout import (
    EXPERT_RE,
    KINDS,
    NORMS,
    expert_tensor_names,
    layer_structure,
    num_layers_of,
    numel,
    params_by_depth,
    small_tensor_names,
    tensor_kind,
)
from .read import Progress, expert_bytes, read_weight_summary, summarize_source, summary_of_model
from .residual import norm_table, query_norm_table, scale_bias_table, vector_norm
from .routing import (
    bias_stats,
    expert_norm_table,
    router_bias_spread,
    router_bias_table,
    router_norm_table,
    row_norms,
)
from .source import OffloadedWeights, StateDictSource, TensorMeta, open_source
from .summary import WeightSummary, summarize_values

__all__ = [
    "EXPERT_RE",
    "KINDS",
    "LN2",
    "NORMS",
    "OffloadedWeights",
    "Progress",
    "StateDictSource",
    "TensorMeta",
    "WeightSummary",
    "bias_stats",
    "expert_bytes",
    "expert_norm_table",
    "expert_tensor_names",
    "half_life",
    "kda_tables",
    "layer_structure",
    "live_a_log",
    "norm_table",
    "num_layers_of",
    "numel",
    "open_source",
    "params_by_depth",
    "query_norm_table",
    "read_weight_summary",
    "resting_decay",
    "router_bias_spread",
    "router_bias_table",
    "router_norm_table",
    "row_norms",
    "scale_bias_table",
    "small_tensor_names",
    "spread",
    "summarize_source",
    "summarize_values",
    "summary_of_model",
    "tensor_kind",
    "vector_norm",
    "weights_json",
    "write_weights_json",
]
