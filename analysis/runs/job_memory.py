"""Peak working memory of the server's long jobs, estimated from the config and the token counts before they run
(what ``app.server.job_budget`` admits against its budget). Estimates, in bytes, fp32, on top of the loaded weights;
calibrated on the k3-full sample (hidden 128, 8 layers, 2 MLA) and conservative: a forward of 1,024 / 4,096 tokens
measured +77 / +717 MB of RSS against 87 / 955 MB estimated (benchmarks/ has no timing of these; they are sizes).

    forward:      4 T (64 d + 4 V + 4 E)   (per-token activations of width d, vocabulary V, E experts; the MLA
                  prefill runs SDPA's fused kernel, O(T): k3core.ops.attention)
    trace:        forward + the recorded arrays: 4 T ((L+1) d + 2 n_kda h_kda c + L (E + latent))
                  + (n_mla + 3) min(T, A)^2 H 4 when attention is recorded (A: its query window; the kept maps
                  and one layer's window being computed)
    experiment:   forward + 2 x 4 T V (the baseline's and the edited logits kept) + T^2 + 3 min(T, Q) T H 4 when
                  the MLA layers' key mask is written: the [T, T] boolean mask an edit writes, and a query block of
                  Q = k3core.ops.attention.QUERY_BLOCK rows of scores where SDPA falls back to its math path
    patching:     forward + 2 x 4 L S T d (clean and corrupted activations per site, S sites) + logits
    attribution:  integrated gradients: 3 x steps x forward (Captum batches the steps; backward doubles it);
                  ablation and Shapley: 2 x forward; layer attribution: 3 x steps x forward
"""

from __future__ import annotations

from typing import Any

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
    if attention_len:
        a = min(t, int(attention_len))
        # the kept maps, and the work of one layer's window at a time (its scores, weights and probabilities)
        kept += (_mla_layers(config) + 3) * a * a * config.num_attention_heads * 4
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
