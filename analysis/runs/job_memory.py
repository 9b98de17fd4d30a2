"""The memory of the server's long jobs: their peak working memory, estimated from the config and the token counts
before they run (what ``app.server.job_budget`` admits against its budget), and the bytes a finished job's result
holds, measured (what the server's kept results count, ``app.server.kept_results``).

Estimates, in bytes, fp32, on top of the loaded weights; calibrated on the k3-full sample (hidden 128, 8 layers, 2 MLA)
and conservative: a forward of 1,024 / 4,096 tokens measured +77 / +717 MB of RSS against 87 / 955 MB estimated
(benchmarks/ has no timing of these; they are sizes).

    forward:      4 T (64 d + 4 V + 4 E)   (per-token activations of width d, vocabulary V, E experts; the MLA
                  prefill runs SDPA's fused kernel, O(T): k3core.ops.attention)
    trace:        forward + the recorded arrays: 4 T ((L+1) d + 2 n_kda h_kda c + L (E + latent))
                  + 8 (2 L + 1) n_bins d^2 (the hidden states' Gram sums per position bin, float64: n_bins =
                  len(k3core.interp.attention_stats.position_bins(T)) - 1, a fixed cost: 6.6 MB at 64 tokens;
                  above 1,024 channels k x k sketches, k = 256: k3core.interp.trace_size.second_moment_bytes)
                  + (n_mla + 3) min(T, A)^2 H 4 when attention is recorded (A: its query window; the kept maps
                  and one layer's window being computed)
                  + KDA's implicit attention, recorded with it: n_kda H_kda (min(T, A)^2 + min(T, A) + 6 T
                  + n_bins n_dist) 4 (maps, per-position statistics, distance profiles) and the working memory
                  of the attention statistics (k3core.interp.trace_size.record_bytes: its "kda_attn" item, working)
    experiment:   forward + 2 x 4 T V (the baseline's and the edited logits kept) + T^2 + 3 min(T, Q) T H 4 when
                  the MLA layers' key mask is written: the [T, T] boolean mask an edit writes, and a query block of
                  Q = k3core.ops.attention.QUERY_BLOCK rows of scores where SDPA falls back to its math path
    patching:     forward + 2 x 4 L S T d (clean and corrupted activations per site, S sites) + logits
    attribution:  integrated gradients: 3 x steps x forward (Captum batches the steps; backward doubles it);
                  ablation and Shapley: 2 x forward; layer attribution: 3 x steps x forward
    recorded:     a trace folder's text: exact, not estimated: the bytes its trace file's members inflate to, from
                  the zip directory (``analysis.runs.loading.recorded_bytes``), and the read is capped there

Measured (``held_bytes``): the buffers of the arrays a result holds, each buffer once (a numpy array's owning array,
a torch tensor's storage), plus the containers and strings around them; a model is never counted (the loaded
weights are outside the job budget: see ``context_bytes``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pandas as pd
import torch
from plotly.basedatatypes import BaseFigure

from k3core.interp.attention_stats import position_bins
from k3core.interp.trace_size import record_bytes, second_moment_bytes
from k3core.ops.attention import QUERY_BLOCK


def _mla_layers(config: Any) -> int:
    return sum(1 for i in range(config.num_hidden_layers) if config.is_mla_layer(i))


def forward_peak_bytes(config: Any, tokens: int, batch: int = 1) -> int:
    """One forward's working memory (see the module docstring's formula)."""
    t = int(tokens)
    per_token = 4 * t * (64 * config.hidden_size + 4 * config.vocab_size + 4 * config.num_experts)
    return batch * per_token


def trace_peak_bytes(config: Any, tokens: int, attention_len: int | None = None) -> int:
    """A traced forward: the forward plus the arrays the recorder keeps; ``attention_len``: the recorded attention
    length cap (None: attention not recorded)."""
    t, layers = int(tokens), config.num_hidden_layers
    n_kda = layers - _mla_layers(config)
    latent = config.routed_expert_hidden_size or 0
    kda_width = config.kda_num_heads * config.kda_head_dim
    kept = 4 * t * ((layers + 1) * config.hidden_size + 2 * n_kda * kda_width + layers * (config.num_experts + latent))
    kept += second_moment_bytes(config.hidden_size, layers, len(position_bins(max(t, 1))) - 1)
    if attention_len:
        a = min(t, int(attention_len))
        # the kept maps, and the work of one layer's window at a time (its scores, weights and probabilities)
        kept += (_mla_layers(config) + 3) * a * a * config.num_attention_heads * 4
        # recorded attention brings KDA's implicit attention (WHAT_ALL): its maps and per-position statistics, and
        # the working memory of the attention statistics (k3core.interp.trace_size.record_bytes, the one count)
        kda = record_bytes(config, t, ("kda_attn", "attn_probs"), max_attn_len=a)
        kept += kda.by_item.get("kda_attn", 0) + kda.working
    return forward_peak_bytes(config, t) + kept


def experiment_peak_bytes(config: Any, tokens: int) -> int:
    """An edit experiment: the baseline and the edited forward, both logits kept, and (on a model with MLA layers)
    room for a written key mask and the masked attention path's query block."""
    t = int(tokens)
    masked = t * t + 3 * min(t, QUERY_BLOCK) * t * config.num_attention_heads * 4 if _mla_layers(config) else 0
    return forward_peak_bytes(config, t) + 2 * 4 * t * config.vocab_size + masked


def patching_peak_bytes(config: Any, tokens: int, sites: int) -> int:
    """Activation patching: clean and corrupted activations at every (layer, site), then patched forwards."""
    t = int(tokens)
    cached = 2 * 4 * config.num_hidden_layers * max(int(sites), 1) * t * config.hidden_size
    return forward_peak_bytes(config, t) + cached + 2 * 4 * t * config.vocab_size


def attribution_peak_bytes(config: Any, tokens: int, method: str, steps: int = 64, layers: bool = False) -> int:
    """Token attribution by ``method`` (and the layer attribution with ``layers``) over ``tokens`` prompt + target
    tokens."""
    one = forward_peak_bytes(config, tokens)
    token_part = 3 * max(int(steps), 1) * one if method in ("integrated_gradients", "ig_frozen_routing") else 2 * one
    return max(token_part, 3 * max(int(steps), 1) * one if layers else 0)


def held_bytes(*values: Any) -> int:
    """Bytes ``values`` hold together: sum over their numpy arrays and torch tensors of their buffers' sizes (a numpy
    array's owning array ``nbytes``, a tensor's storage ``nbytes()``; each buffer once, however many views share it),
    pandas objects' ``memory_usage(deep=True)``, plotly figures' data and layout, and ``sys.getsizeof`` of the dicts,
    lists, tuples, sets, strings and dataclasses around them (walked without recursion: any nesting depth). A
    ``torch.nn.Module`` counts 0 (a model is not a result)."""
    seen: set[int] = set()
    total = 0
    todo = list(values)
    while todo:
        value = todo.pop()
        if value is None or isinstance(value, (bool, int, float, torch.nn.Module)) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, np.ndarray):
            owner = value
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            if isinstance(owner.base, torch.Tensor):  # torch's memory seen through numpy (as Trace.add keeps it)
                todo.append(owner.base)
            elif owner is value or id(owner) not in seen:
                seen.add(id(owner))
                total += int(owner.nbytes)
                if owner.dtype == object:
                    todo.extend(owner.flat)
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = -1 - storage.data_ptr()  # negative: never an id()
            if value.device.type != "meta" and key not in seen:
                seen.add(key)
                total += int(storage.nbytes())
        elif isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
            total += int(np.sum(value.memory_usage(deep=True)))
        elif isinstance(value, BaseFigure):
            todo += [value._data, value._layout]  # the figure's own property dicts (its trace objects point into them)
        elif isinstance(value, dict):
            total += sys.getsizeof(value)
            todo += [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            total += sys.getsizeof(value)
            todo.extend(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            total += sys.getsizeof(value)
            todo += [getattr(value, f.name) for f in dataclasses.fields(value)]
        else:
            total += sys.getsizeof(value)
    return total


def context_bytes(ctx: Any) -> int:
    """Bytes an ``analysis.runs.context.AnalysisContext`` holds beyond its run: ``held_bytes`` of its trace (arrays,
    axes, meta), tokens and the results computed on it since (``ctx.shared``: importance, experiments). Its model,
    tokenizer, config and weight summary belong to the run (loaded once, shared by every context of it) and are not
    counted."""
    return held_bytes(ctx.trace, ctx.input_ids, ctx.shared)
