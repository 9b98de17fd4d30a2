"""How many bytes a recording holds, from the config, the text length and ``what`` alone (before any forward).

``record_bytes`` adds up every array ``k3core.interp.recorder.record`` keeps (their shapes follow from the config,
``T`` and the recorder's options; see the recorder's list) and the working bytes it holds while recording (the
float64 copies of a depth's states and its carry to the next depth, the Gram sketch's projection, the stacking of the
per-depth moments at the end). The streamed plan (``k3core.loading.streamed_run.plan_streaming``) counts it against
the memory budget; tests/k3core/interp/test_trace_size.py holds it against what recordings hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .attention_stats import DEFAULT_BLOCK, position_bins
from .hidden_moments import GRAM_ITEM, SKETCH_DIM, uses_sketch
from .kda_attention_stats import KDA_STATS, distance_bins

F32, F64, I64 = 4, 8, 8

#: The items ``record(model, what=...)`` knows; "all" is WHAT_ALL, the default everything but the attention maps
#: (quadratic in length). "attn_probs" (the attention maps) and "kda_attn" (KDA's implicit-attention statistics:
#: O(T^2 K) per head, about 7x a plain forward's time at 16K tokens on k3-full; benchmarks/bench_kda_attention.py)
#: are recorded when named.
WHAT_ALL = ("hidden", "kda", "kda_attn", "mla", "attn_probs", "attnres", "moe", "latent", "loss")
WHAT_DEFAULT = tuple(w for w in WHAT_ALL if w not in ("attn_probs", "kda_attn"))
#: Items recorded only when named (not in "all"): the exact D x D hidden-state Gram matrices at any width.
WHAT_ON_REQUEST = (GRAM_ITEM,)


@dataclass(frozen=True)
class TraceSize:
    """Bytes of a recording: ``arrays`` (what the finished trace holds), ``working`` (held besides while it records)."""

    arrays: int
    working: int
    by_item: dict[str, int]

    @property
    def total(self) -> int:
        return self.arrays + self.working


def resolve_what(what: Iterable[str] | str | None) -> tuple[str, ...]:
    """``record``'s ``what`` as items: None or "default" -> WHAT_DEFAULT, "all" -> WHAT_ALL, one name -> (name,)."""
    if what is None or what == "default":
        return WHAT_DEFAULT
    if what == "all":
        return WHAT_ALL
    return (what,) if isinstance(what, str) else tuple(what)


def attnres_sources(config: Any) -> int:
    """At most how many depth sources an AttnRes site mixes (the embedding, each completed block, the partial sum)."""
    sublayers = 2 * config.num_hidden_layers
    if config.residual == "block_attnres":
        return 2 + math.ceil(sublayers / max(1, config.attn_res_block_size))
    return 1 + sublayers


def second_moment_bytes(width: int, layers: int, bins: int, what: Iterable[str] | str | None = None) -> int:
    """Bytes of one sequence's second moments of the hidden states (``k3core.interp.hidden_moments``): exact Gram
    and cross Gram matrices, 8 (2 L + 1) n_bins D^2, up to the sketch width (or when asked for by name), else the
    k x k sketches and tr G, 8 (2 L + 1) n_bins k^2 + 8 (L + 1) n_bins (k + 1)."""
    what = frozenset(resolve_what(what))
    if not uses_sketch(width, what):
        return (2 * layers + 1) * bins * width * width * F64
    k = SKETCH_DIM
    return (2 * layers + 1) * bins * k * k * F64 + (layers + 1) * bins * (k + 1) * F64


def trace_estimate(config: Any, tokens: int) -> int:
    """The bytes a default trace (``record(model)``) of one sequence of ``tokens`` tokens holds: what a streamed
    plan keeps room for (``k3core.loading.streamed_run.plan_streaming(trace_estimate=...)``)."""
    return record_bytes(config, tokens).total


def record_bytes(
    config: Any,
    T: int,
    what: Iterable[str] | str | None = None,
    max_batch: int = 1,
    max_tokens: int | None = None,
    window: int | None = 1024,
    max_attn_len: int = 1024,
    attn_block: int = DEFAULT_BLOCK,
) -> TraceSize:
    """The bytes ``record(model, what, ...)`` holds for one forward of ``max_batch`` sequences of ``T`` tokens on a
    model of ``config`` (arguments as ``record``'s). An estimate from shapes: attention-map windows and AttnRes
    source counts are taken at their largest."""
    what = frozenset(resolve_what(what))
    B = max_batch
    n = T if max_tokens is None else min(T, max_tokens)
    W = n if window is None else min(window, n)
    bins = len(position_bins(n)) - 1
    L, D = config.num_hidden_layers, config.hidden_size
    items: dict[str, int] = {"tokens": B * n * I64 + (bins + 1) * I64}
    working = 0
    if "loss" in what:
        items["loss"] = B * n * F32
    if "hidden" in what:
        depth = L + 1
        size = depth * B * (W * D * F32 + n * F32) + bins * I64
        moments = 2 * depth * B * bins * D * F64 + L * B * bins * F64  # sum, unit_sum; cos_sum
        moments += second_moment_bytes(D, L, bins, what) * B
        if uses_sketch(D, what):
            working += D * SKETCH_DIM * F64 + 2 * B * n * SKETCH_DIM * F64  # R; a depth's projected states, its carry
        items["hidden"] = size + moments
        # a depth's float64 states and unit vectors, the previous depth's (the carry); the moments stacked at the end
        working += 4 * B * n * D * F64 + moments
    kda = [i for i in range(L) if not config.is_mla_layer(i)]
    mla = [i for i in range(L) if config.is_mla_layer(i)]
    if "kda" in what and kda:
        H, K = config.kda_num_heads, config.kda_head_dim
        steps = math.ceil(n / config.kda_chunk_size)
        per = B * H * (W * K + bins * K + 2 * n + 2 * steps + K * K) * F32 + steps * I64
        items["kda"] = len(kda) * per
    if kda and ("kda_attn" in what or "attn_probs" in what):
        H, K = config.kda_num_heads, config.kda_head_dim
        per = 0
        if "kda_attn" in what:
            dist = len(distance_bins(n)) - 1
            per += B * H * (len(KDA_STATS) * n + bins * dist) * F32 + (dist + 1) * I64
            # one head at a time: the one-hot carry [K, T + C], a row block's rows, p, x log x, prefix sums [C, T]
            working += (K * (n + config.kda_chunk_size) + 5 * config.kda_chunk_size * n) * F32
        if "attn_probs" in what:
            q = min(max_attn_len, n)
            per += B * H * (q * q + q) * F32
        items["kda_attn"] = len(kda) * per
        working += B * n * H * (3 * K + 1) * F32  # a layer's q, k, g, beta held until its core output
    if mla and ("mla" in what or "attn_probs" in what):
        H = config.num_attention_heads
        per = B * n * H * F32 * (4 if "mla" in what else 0)  # entropy, sink, received; gate mean
        if "attn_probs" in what:
            q = min(max_attn_len, n)
            per += B * H * q * q * F32
        items["mla"] = len(mla) * per
        working += B * H * min(attn_block, n) * n * F32 * 4  # a query block's scores, probabilities and their logs
    moe = [i for i in range(L) if config.is_moe_layer(i)]
    if "moe" in what and moe:
        E, k = config.num_experts, config.num_experts_per_token
        per = B * n * (E * F32 + k * (I64 + F32)) + E * (I64 + F32)
        if "latent" in what:
            per += B * W * (config.routed_expert_hidden_size or D) * F32
        items["moe"] = len(moe) * per
    if "attnres" in what and config.uses_attnres:
        items["attnres"] = (2 * L + 1) * (B * n * attnres_sources(config) * F32 + F32)
    if "attnres" in what and config.residual == "scale_bias":
        items["attnres"] = 4 * L * D * F32
    return TraceSize(arrays=sum(items.values()), working=working, by_item=items)
