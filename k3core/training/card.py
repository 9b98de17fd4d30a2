"""The model card (README.md) a finished run writes from its metrics.json."""

from __future__ import annotations

from typing import Any

from ..modeling.config import K3Config


def model_card(metrics: dict[str, Any]) -> str:
    """A short README.md for a finished run, from its metrics."""
    mc = metrics["model_config"]
    cfg = K3Config.from_dict(mc)
    fin = metrics["final"] or {}
    data = metrics["data"]
    params = metrics["params"]
    threads = f"{metrics['threads']} thread" + ("" if metrics["threads"] == 1 else "s")
    types = cfg.layer_types()
    moe = (
        (
            f"{'LatentMoE' if cfg.is_latent_moe else 'plain MoE'}: {cfg.num_experts} routed experts, top-"
            f"{cfg.num_experts_per_token}, {cfg.num_shared_experts} shared, expert width {cfg.moe_intermediate_size}"
            + (f", latent width {cfg.routed_expert_hidden_size}" if cfg.is_latent_moe else "")
            + f", balancing {cfg.balancing}"
        )
        if cfg.num_experts
        else "dense FFN in every layer"
    )
    residual = cfg.residual + (f" (block size {cfg.attn_res_block_size})" if cfg.residual == "block_attnres" else "")
    sample = (metrics.get("sample") or {}).get("text", "")
    prompt = (metrics.get("sample") or {}).get("prompt", "")
    base = data["unigram_baseline_bpb"]
    made = (
        f"A byte-level K3-style language model trained with `k3lab train` ({metrics['code_version']})."
        if fin.get("step", 0)
        else f"An untrained byte-level K3-style language model: seed {metrics['seed']}'s initialisation, validated "
        f"(`k3lab train --steps 0`, {metrics['code_version']}); the weights a run with this config and seed starts "
        "from, the reference to hold trained runs against."
    )
    lines = [
        f"# {metrics['run_name']}",
        "",
        made,
        "",
        "| | |",
        "|---|---|",
        f"| layers | {cfg.num_hidden_layers} ({''.join(t[0] for t in types)}: K = KDA, M = MLA), hidden size "
        f"{cfg.hidden_size} |",
        f"| KDA | {cfg.kda_num_heads} heads x {cfg.kda_head_dim}, gate {cfg.kda_gate} |",
        f"| FFN | {cfg.hidden_act}; {moe} |",
        f"| residual | {residual} |",
        f"| parameters | {params['total']:,} total, {params['active']:,} active per token |",
        f"| data | {data['source']}; val: {', '.join(data['val_names'])} |",
        f"| training | {fin.get('step', 0):,} steps, {fin.get('tokens_seen', 0):,} tokens, "
        f"{fin.get('wall_time_s', 0.0) / 60:.1f} min on {metrics['device']} ({threads}), "
        f"seed {metrics['seed']} |",
        f"| val bits/byte | **{fin.get('val_bpb', float('nan')):.3f}** (unigram baseline {base:.3f}) |",
        f"| MQAR accuracy | {fin.get('mqar_accuracy', float('nan')):.3f} "
        f"({metrics['eval']['mqar']['num_kv_pairs']} key-value pairs) |",
        "",
        'Load it with `K3ForCausalLM.from_pretrained("<this folder>")`; `metrics.json` holds the loss curve, '
        "validation history, MoE load and AttnRes weights over training.",
        "",
    ]
    if metrics.get("command"):
        lines += ["Reproduce:", "", "```", metrics["command"], "```", ""]
    if sample:
        lines += [
            f"Sample (temperature {metrics['sample']['temperature']}):",
            "",
            "```",
            (prompt + sample).rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)
