"""Layer density allocated by a config: parameters, FLOPs per token and decode cache per layer (no data).

- parameters of each layer by kind (``params_by_kind``: the one definition of "parameters of layer i by
  kind", under ``k3core.loading.names.PARAMETER_RULE``: the router selection bias is not counted);
  ``analysis.weights.layout.params_by_depth`` counts the same from stored shapes, checked equal on every
  sample and preset by tests/analysis/metrics/test_allocation.py; the allocation table's ``params`` are their sum per
  layer (``K3ForCausalLM.num_parameters`` in total) and ``active_params`` count k of E routed experts;
- FLOPs per token at sequence length T:
  ``flops = 2 * active matmul weights  +  sequence mixing  +  depth mixing``
  * matmul weights: every ``nn.Linear`` and depthwise-conv weight a token passes through (the router,
    the k chosen experts, shared experts, projections); norms, ``A_log`` and ``dt_bias`` are
    elementwise and not counted; the embedding is a lookup (0 FLOPs);
  * MLA sequence mixing (naive, not weight-absorbed): ``2 * H * (d_qk + d_v) * T_eff`` with
    ``T_eff = (T + 1) / 2`` keys on average over a causal prefill of T tokens, or ``T_eff = T`` for
    decoding the T-th token (scores Q K^T: 2 H d_qk T_eff; values A V: 2 H d_v T_eff);
  * KDA sequence mixing (recurrent form, per token, constant in T): ``7 * H * d^2``
    (decay Diag(alpha) S: d^2; prediction S^T k: 2 d^2; delta-rule rank-1 write: 2 d^2; readout S^T q: 2 d^2);
  * AttnRes depth mixing per site with n sources: ``4 * n * D`` (logits n D mult-adds, the mix n D);
- cache / state bytes per sequence at length T:
  * KDA: ``4 * H * d * d`` (fp32 state) ``+ (kernel - 1) * 3 * H * d * b`` (conv tails), constant in T;
  * MLA: ``(kv_lora + d_rope) * T * b``, linear in T;
  where b is the activation dtype's bytes (2 for bf16).

Measured counterparts: ``analysis.metrics.kda_memory`` (from a trace) and ``analysis.metrics.importance`` (from the
model).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from analysis.weights.layout import KINDS, depth_label
from k3core.modeling.config import K3Config

DEFAULT_LENGTHS = tuple(2**p for p in range(10, 21))  # 1K .. 1M tokens


def _kda_params(config: K3Config) -> tuple[int, int]:
    """(all params, matmul params) of one KDA layer.

    q, k, v, o: 4 D H d; convs 3 H d kernel; decay f_a D d + f_b d H d; b_proj D H; A_log H; dt_bias H d;
    output gate D H d (full) or D d + d H d (low rank); o_norm d.
    """
    D, H, d, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.kda_conv_size
    gate = D * H * d if config.kda_output_gate == "full" else D * d + d * H * d
    matmul = 4 * D * H * d + 3 * H * d * K + D * d + d * H * d + D * H + gate
    elementwise = H + H * d + d
    return matmul + elementwise, matmul


def _mla_params(config: K3Config) -> tuple[int, int]:
    """(all params, matmul params) of one MLA layer.

    q: D q_lora + q_lora H d_qk (+ q_lora norm) or D H d_qk; kv_a: D (kv_lora + rope) (+ kv_lora norm);
    kv_b: kv_lora H (d_nope + d_v); gate D H d_v (gated MLA); o: H d_v D.
    """
    D, H = config.hidden_size, config.num_attention_heads
    qk, v = config.qk_head_dim, config.v_head_dim
    norms = config.kv_lora_rank
    if config.q_lora_rank:
        q = D * config.q_lora_rank + config.q_lora_rank * H * qk
        norms += config.q_lora_rank
    else:
        q = D * H * qk
    matmul = q + D * (config.kv_lora_rank + config.qk_rope_head_dim)
    matmul += config.kv_lora_rank * H * (config.qk_nope_head_dim + v) + H * v * D
    if config.mla_output_gate:
        matmul += D * H * v
    return matmul + norms, matmul


def _ffn_params(config: K3Config, layer: int) -> tuple[int, int, int, int]:
    """(all, active, matmul, active matmul) params of layer's FFN.

    Dense: 3 D w. MoE: router E D; latent down/up 2 D L (+ L norm); experts 3 E m W (W = L or D);
    shared 3 D (n_shared m). Active counts k of the E routed experts.
    """
    D = config.hidden_size
    if not config.is_moe_layer(layer):
        p = 3 * D * config.scaled_width(config.intermediate_size, layer)
        return p, p, p, p
    E, k = config.num_experts, config.num_experts_per_token
    m = config.scaled_width(config.moe_intermediate_size, layer)
    latent = config.routed_expert_hidden_size
    width = latent or D
    fixed_matmul = E * D + _shared_expert_params(config, layer)
    fixed_other = 0
    if latent:
        fixed_matmul += 2 * D * latent
        fixed_other += latent if config.latent_moe_use_norm else 0
    per_expert = 3 * m * width
    total = fixed_matmul + fixed_other + E * per_expert
    active = fixed_matmul + fixed_other + k * per_expert
    return total, active, fixed_matmul + E * per_expert, fixed_matmul + k * per_expert


def _shared_expert_params(config: K3Config, layer: int) -> int:
    """Shared experts of an MoE layer: 3 D (n_shared m)."""
    m = config.scaled_width(config.moe_intermediate_size, layer)
    return 3 * config.hidden_size * config.num_shared_experts * m


def _residual_params(config: K3Config) -> int:
    """Per-layer residual parameters: AttnRes 2 sites x (norm D + query D); scale/bias 4 D; plain 0."""
    D = config.hidden_size
    if config.uses_attnres:
        return 4 * D
    if config.residual == "scale_bias":
        return 4 * D
    return 0


def params_by_kind(config: K3Config) -> pd.DataFrame:
    """Parameters of each depth by kind, from the config: the one definition of "parameters of layer i by kind"
    (k3core PARAMETER_RULE: the router selection bias is not counted). Columns as
    ``analysis.weights.layout.params_by_depth``: layer (-1 = embedding, L = output: LM head, final norm,
    output mix), depth, kind (of ``KINDS``), params; only (depth, kind) pairs with parameters.

    Layer i: its mixer (KDA or MLA, formulas in ``_kda_params`` / ``_mla_params``); dense FFN 3 D w, or routed
    experts (router E D, latent projections and norm, E experts) and shared experts; norms/other:
    the two layer norms 2 D and the residual parameters. Embedding V D; output: LM head V D (none when tied)
    with the final norm D and the AttnRes output mix 2 D under norms/other.
    """
    D, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    rows: list[tuple[int, str, int]] = [(-1, "embedding / LM head", V * D)]
    for i in range(L):
        mla = config.is_mla_layer(i)
        rows.append((i, "MLA" if mla else "KDA", (_mla_params(config) if mla else _kda_params(config))[0]))
        ffn_all = _ffn_params(config, i)[0]
        if config.is_moe_layer(i):
            shared = _shared_expert_params(config, i)
            rows += [(i, "routed experts", ffn_all - shared)]
            rows += [(i, "shared experts", shared)]
        else:
            rows.append((i, "dense FFN", ffn_all))
        rows.append((i, "norms/other", 2 * D + _residual_params(config)))
    out_mix = 2 * D if config.uses_attnres else 0
    rows += [(L, "norms/other", D + out_mix), (L, "embedding / LM head", 0 if config.tie_word_embeddings else V * D)]
    table = [
        {"layer": i, "depth": depth_label(i, L), "kind": kind, "params": p}
        for i, kind, p in sorted(rows, key=lambda r: (r[0], KINDS.index(r[1])))
        if p
    ]
    df = pd.DataFrame(table, columns=["layer", "depth", "kind", "params"])
    df.attrs["keys"] = ["layer", "depth", "kind"]
    return df


def ffn_kind(config: K3Config, layer: int) -> str:
    """ "dense FFN", "LatentMoE" or "MoE" (routed experts at full width)."""
    if not config.is_moe_layer(layer):
        return "dense FFN"
    return "LatentMoE" if config.is_latent_moe else "MoE"


def depth_mix_sources(config: K3Config) -> dict[str, int]:
    """Number of depth sources at each AttnRes site ("i.attn", "i.mlp", "output"); {} without AttnRes.

    Block AttnRes (block size s, L layers): attn site of layer i has ceil(i/s) + 1 sources (absent at
    i = 0, where the bank is empty), the mlp site floor(i/s) + 2, the output mix ceil(L/s) + 1.
    Full AttnRes: 2 i + 1, 2 i + 2 and 2 L + 1.
    """
    L = config.num_hidden_layers
    out: dict[str, int] = {}
    if config.residual == "block_attnres":
        s = config.attn_res_block_size
        for i in range(L):
            if i > 0:
                out[f"{i}.attn"] = -(-i // s) + 1
            out[f"{i}.mlp"] = i // s + 2
        out["output"] = -(-L // s) + 1
    elif config.residual == "full_attnres":
        for i in range(L):
            if i > 0:
                out[f"{i}.attn"] = 2 * i + 1
            out[f"{i}.mlp"] = 2 * i + 2
        out["output"] = 2 * L + 1
    return out


def sequence_mixing_flops(config: K3Config, layer: int, seq_len: int, mode: str = "prefill") -> float:
    """Per-token FLOPs of the token mixer beyond its projections.

    MLA: 2 H (d_qk + d_v) T_eff with T_eff = (T + 1) / 2 ("prefill", causal average) or T ("decode").
    KDA: 7 H d^2, independent of T.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if config.is_mla_layer(layer):
        t_eff = (seq_len + 1) / 2 if mode == "prefill" else float(seq_len)
        return 2.0 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * t_eff
    return 7.0 * config.kda_num_heads * config.kda_head_dim**2


def layer_cache_bytes(config: K3Config, layer: int, seq_len: int, dtype_bytes: int = 2) -> int:
    """Decode cache of one layer for one sequence of seq_len tokens.

    KDA: 4 H d d (fp32 state) + (kernel - 1) 3 H d b (conv tails). MLA: (kv_lora + d_rope) T b.
    """
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if config.is_mla_layer(layer):
        return (config.kv_lora_rank + config.qk_rope_head_dim) * seq_len * dtype_bytes
    H, d = config.kda_num_heads, config.kda_head_dim
    return 4 * H * d * d + (config.kda_conv_size - 1) * 3 * H * d * dtype_bytes


def layer_allocation(
    config: K3Config, seq_len: int = 4096, dtype_bytes: int = 2, mode: str = "prefill"
) -> pd.DataFrame:
    """Per-layer allocation table from the config alone (formulas in the module docstring).

    One row per decoder layer plus "embedding" and "output" rows (layer -1 and L), so that
    ``params.sum()`` equals ``K3ForCausalLM(config).num_parameters()`` and ``active_params.sum()``
    equals ``num_parameters(active=True)``. Columns: layer, part, layer_type, ffn_kind,
    width_multiplier, ffn_width, params, active_params, matmul_flops, mixing_flops, depth_mix_flops,
    flops (per token at seq_len), cache_bytes (per sequence at seq_len).
    """
    D, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    mix = depth_mix_sources(config)
    by_layer = params_by_kind(config).groupby("layer")["params"].sum()
    rows = [
        dict(
            layer=-1,
            part="embedding",
            layer_type="embedding",
            ffn_kind="",
            width_multiplier=np.nan,
            ffn_width=0,
            params=int(by_layer[-1]),
            active_params=int(by_layer[-1]),
            matmul_flops=0.0,
            mixing_flops=0.0,
            depth_mix_flops=0.0,
            cache_bytes=0,
        )
    ]
    for i in range(L):
        mixer_mm = (_mla_params(config) if config.is_mla_layer(i) else _kda_params(config))[1]
        ffn_all, ffn_act, _, ffn_act_mm = _ffn_params(config, i)
        params = int(by_layer[i])
        if config.is_moe_layer(i):
            width = config.scaled_width(config.moe_intermediate_size, i)
        else:
            width = config.scaled_width(config.intermediate_size, i)
        depth = sum(4.0 * mix.get(f"{i}.{side}", 0) * D for side in ("attn", "mlp"))
        rows.append(
            dict(
                layer=i,
                part=f"L{i}",
                layer_type="MLA" if config.is_mla_layer(i) else "KDA",
                ffn_kind=ffn_kind(config, i),
                width_multiplier=config.width_multiplier(i),
                ffn_width=width,
                params=params,
                active_params=params - (ffn_all - ffn_act),
                matmul_flops=2.0 * (mixer_mm + ffn_act_mm),
                mixing_flops=sequence_mixing_flops(config, i, seq_len, mode),
                depth_mix_flops=depth,
                cache_bytes=layer_cache_bytes(config, i, seq_len, dtype_bytes),
            )
        )
    rows.append(
        dict(
            layer=L,
            part="output",
            layer_type="output",
            ffn_kind="",
            width_multiplier=np.nan,
            ffn_width=0,
            params=int(by_layer[L]),
            active_params=int(by_layer[L]),
            matmul_flops=2.0 * V * D,
            mixing_flops=0.0,
            depth_mix_flops=4.0 * mix.get("output", 0) * D,
            cache_bytes=0,
        )
    )
    df = pd.DataFrame(rows)
    df["flops"] = df["matmul_flops"] + df["mixing_flops"] + df["depth_mix_flops"]
    df["seq_len"] = seq_len
    return df


def cache_bytes_by_length(config: K3Config, lengths: Iterable[int] | None = None, dtype_bytes: int = 2) -> pd.DataFrame:
    """Tidy decode-cache size per sequence against length T (default 1K .. 1M, powers of two).

    Rows (seq_len, layer_type in {"KDA", "MLA", "total"}, n_layers, bytes, bytes_per_layer): KDA flat
    in T, MLA linear in T (formulas in ``layer_cache_bytes``).
    """
    lengths = list(DEFAULT_LENGTHS if lengths is None else lengths)
    if not lengths:
        raise ValueError("lengths is empty")
    types = config.layer_types()
    n = {t: types.count(t) for t in ("KDA", "MLA")}
    first = {t: types.index(t) for t in n if n[t]}
    rows = []
    for T in lengths:
        total = 0
        for t in ("KDA", "MLA"):
            per = layer_cache_bytes(config, first[t], int(T), dtype_bytes) if n[t] else 0
            rows.append(dict(seq_len=int(T), layer_type=t, n_layers=n[t], bytes_per_layer=per, bytes=per * n[t]))
            total += per * n[t]
        rows.append(
            dict(seq_len=int(T), layer_type="total", n_layers=n["KDA"] + n["MLA"], bytes_per_layer=np.nan, bytes=total)
        )
    return pd.DataFrame(rows)


def allocated_vs_measured(
    allocation: pd.DataFrame, importance: pd.DataFrame | None = None, kda: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per decoder layer on one depth axis: allocation columns, importance pivoted to
    ``<method>_<sublayer>`` columns (e.g. ``ablation_attn``, ``gxa_ffn``) with the ablation's noise floor
    (``ablation_noise_<sublayer>``, when the importance has a ``noise`` column), and the KDA summary.

    ``allocation``: from ``layer_allocation``; ``importance``: tidy (layer, sublayer, method, importance)
    from ``analysis.metrics.importance``; ``kda``: from ``kda_layer_summary``. Also adds each layer's share of
    the decoder's active parameters and FLOPs (``active_share``, ``flops_share``).
    """
    layers = allocation[allocation["part"].str.startswith("L")].copy()
    layers["active_share"] = layers["active_params"] / layers["active_params"].sum()
    layers["flops_share"] = layers["flops"] / layers["flops"].sum()
    out = layers
    if importance is not None and not importance.empty:
        wide = importance.pivot_table(index="layer", columns=["method", "sublayer"], values="importance")
        wide.columns = [f"{m}_{s}" for m, s in wide.columns]
        out = out.merge(wide.reset_index(), on="layer", how="left")
        if "noise" in importance:  # the ablation's noise floor: ablation_noise_<sublayer>
            noise = importance[importance["method"] == "ablation"].pivot_table(
                index="layer", columns="sublayer", values="noise", dropna=False
            )
            noise.columns = [f"ablation_noise_{s}" for s in noise.columns]
            out = out.merge(noise.reset_index(), on="layer", how="left")
    if kda is not None and not kda.empty:
        out = out.merge(kda, on="layer", how="left")
    return out.reset_index(drop=True)
