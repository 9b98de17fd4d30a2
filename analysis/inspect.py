"""``k3lab inspect RUN``: a terminal summary of a checkpoint (or a preset name), from headers alone.

    k3lab inspect RUN [--text FILE | --sample NAME] [--max-tokens N] [--json]

Prints the key config fields, parameter counts (total and active per token, by component), the layer
map (per layer: KDA/MLA, dense FFN/MoE, width multiplier, parameters, AttnRes block boundaries) and
headline numbers: the final training numbers from metrics.json when present, and with ``--text`` /
``--sample`` those of a quick trace (analysis.headline.headline_numbers). A checkpoint folder is read
through ``k3core.checkpoint_files.CheckpointFiles``: config.json and the safetensors headers only
(parameter counts from shapes, bytes by dtype, skipped multimodal tensors, names and shapes checked
against the config), so a 5 TB checkpoint answers in seconds; only ``--text`` / ``--sample`` load
weights. RUN may also be a preset name (``k3lab inspect kimi-k3``): its shapes are built on the meta
device, so any size works, without weights.
Exit codes: 0 success, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

from analysis.cli_options import add_device_options
from analysis.format import format_bytes, format_count, format_number
from k3core.checkpoint_files import CheckpointFiles
from k3core.config import K3Config
from k3core.runtime import configure_threads

if TYPE_CHECKING:  # k3core.model imports torch: loaded only where a model is built
    from k3core.model import K3ForCausalLM

COMPONENTS = (
    "embedding",
    "KDA attention",
    "MLA attention",
    "dense FFN",
    "MoE router",
    "MoE routed experts",
    "MoE shared experts",
    "MoE latent projections",
    "residual (AttnRes / scale-bias)",
    "norms",
    "LM head",
)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


# ----------------------------------------------------------------------------- pure summaries
def config_summary(cfg: K3Config) -> dict[str, Any]:
    """The config fields a reader needs first (the full dict is cfg.to_dict())."""
    out: dict[str, Any] = {
        "name": cfg.name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "mla_layers (1-based)": list(cfg.full_attn_layers),
        "kda": f"{cfg.kda_num_heads} heads x {cfg.kda_head_dim}, gate {cfg.kda_gate}"
        + (f" (lower bound {cfg.kda_gate_lower_bound})" if cfg.kda_gate == "lower_bound" else "")
        + f", output gate {cfg.kda_output_gate}, chunk {cfg.kda_chunk_size}",
        "mla": f"{cfg.num_attention_heads} heads, q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, "
        f"qk {cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim} (NoPE), v {cfg.v_head_dim}, "
        f"output gate {cfg.mla_output_gate}",
        "ffn": f"{cfg.hidden_act}, dense width {cfg.intermediate_size}",
        "residual": cfg.residual
        + (f" (block size {cfg.attn_res_block_size})" if cfg.residual == "block_attnres" else ""),
    }
    if cfg.num_experts:
        latent = f", latent {cfg.routed_expert_hidden_size}" if cfg.routed_expert_hidden_size else " (not latent)"
        out["moe"] = (
            f"{cfg.num_experts} experts, top-{cfg.num_experts_per_token}, {cfg.num_shared_experts} shared, "
            f"width {cfg.moe_intermediate_size}{latent}, first {cfg.first_k_dense_replace} layer(s) dense, "
            f"balancing {cfg.balancing}"
        )
    else:
        out["moe"] = "none (dense FFN everywhere)"
    if cfg.layer_width_multipliers is not None:
        out["layer_width_multipliers"] = list(cfg.layer_width_multipliers)
    return out


def component_of(name: str, cfg: K3Config) -> str:
    """Which component a parameter (by its state-dict name) belongs to."""
    if ".block_sparse_moe.experts." in name:  # first: nearly every tensor of a big MoE checkpoint
        return "MoE routed experts"
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "LM head"
    if "_res_" in name or "output_attn_res" in name:
        return "residual (AttnRes / scale-bias)"
    m = _LAYER_RE.match(name)
    if m and ".self_attn." in name:
        return "MLA attention" if cfg.is_mla_layer(int(m.group(1))) else "KDA attention"
    if ".block_sparse_moe.shared_experts." in name:
        return "MoE shared experts"
    if ".block_sparse_moe.gate." in name:
        return "MoE router"
    if ".block_sparse_moe." in name:
        return "MoE latent projections"
    if ".mlp." in name:
        return "dense FFN"
    return "norms"


def parameter_breakdown(model: K3ForCausalLM) -> dict[str, dict[str, int]]:
    """{component: {"total": n, "active": n}}; routed experts count k of E per token as active."""
    cfg = model.config
    out = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        comp = component_of(name, cfg)
        n = p.numel()
        out[comp]["total"] += n
        out[comp]["active"] += round(n * share) if comp == "MoE routed experts" else n
    return {k: v for k, v in out.items() if v["total"]}


def header_breakdown(files: CheckpointFiles, cfg: K3Config) -> dict[str, dict[str, int]]:
    """``parameter_breakdown`` from the safetensors headers alone (shapes; no tensor is read)."""
    out = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    for name, info in files.tensors.items():
        comp = component_of(name, cfg)
        out[comp]["total"] += info.numel
        out[comp]["active"] += round(info.numel * share) if comp == "MoE routed experts" else info.numel
    return {k: v for k, v in out.items() if v["total"]}


def bytes_by_dtype(files: CheckpointFiles) -> dict[str, int]:
    """Declared bytes per storage format (``MXFP4``, ``BF16``, ``F32``, ...), largest first."""
    return files.bytes_by_format()


def params_by_layer(files: CheckpointFiles) -> dict[int, int]:
    """Parameters per decoder layer, from header shapes."""
    out: dict[int, int] = {}
    for name, info in files.tensors.items():
        m = _LAYER_RE.match(name)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + info.numel
    return out


def header_check(files: CheckpointFiles, cfg: K3Config) -> dict[str, Any]:
    """How the headers compare with the config: tensor names missing / unexpected, shapes that differ."""
    from k3core.checkpoint import build_meta_model, published_shapes, stored_shape_ok
    from k3core.model import K3ForCausalLM

    expected = published_shapes(build_meta_model(K3ForCausalLM, cfg, None))
    missing = sorted(set(expected) - set(files.tensors))
    unexpected = sorted(set(files.tensors) - set(expected))
    shapes = sorted(
        k for k in set(expected) & set(files.tensors) if not stored_shape_ok(k, files.tensors[k].shape, expected[k])
    )
    return {"matches_config": not (missing or unexpected or shapes), "missing": missing, "unexpected": unexpected,
            "mis_shaped": shapes}  # fmt: skip


def checkpoint_summary(files: CheckpointFiles) -> dict[str, Any]:
    """Everything ``k3lab inspect`` says about a checkpoint folder without reading a tensor."""
    cfg = files.config
    return {
        "files": len(files.files),
        "tensors": len(files.tensors),
        "bytes_total": files.bytes_total,
        "bytes_by_dtype": bytes_by_dtype(files),
        "skipped_tensors": list(files.skipped),
        "params_by_layer": params_by_layer(files),
        "check": header_check(files, cfg),
        "bytes_read": files.bytes_read,
    }


def layer_map(cfg: K3Config) -> list[dict[str, Any]]:
    """Per layer: index, mixer (KDA/MLA), FFN (dense FFN / MoE / LatentMoE), FFN width, width multiplier and
    the AttnRes block (block_attnres: a new block starts every attn_res_block_size layers)."""
    rows = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        ffn = ("LatentMoE" if cfg.is_latent_moe else "MoE") if moe else "dense FFN"
        width = cfg.scaled_width(cfg.moe_intermediate_size if moe else cfg.intermediate_size, i)
        row = {
            "layer": i,
            "mixer": "MLA" if cfg.is_mla_layer(i) else "KDA",
            "ffn": ffn,
            "ffn_width": width,
            "width_mult": cfg.width_multiplier(i),
            "attnres_block": None,
            "block_start": False,
        }
        if cfg.residual == "block_attnres":
            row["attnres_block"] = i // cfg.attn_res_block_size + 1
            row["block_start"] = i % cfg.attn_res_block_size == 0
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- printing
def format_layer_map(cfg: K3Config, params: dict[int, int] | None = None) -> str:
    rows = layer_map(cfg)
    block = cfg.residual == "block_attnres"
    head = f"{'layer':>5}  {'mixer':5}  {'ffn':10}  {'width':>6}  {'mult':>5}" + ("  params" if params else "")
    lines = [head + ("  attnres block" if block else "")]
    for r in rows:
        line = f"{r['layer']:>5}  {r['mixer']:5}  {r['ffn']:10}  {r['ffn_width']:>6}  {r['width_mult']:>5.2g}"
        if params:
            line += f"  {format_count(params.get(r['layer'], 0)):>6s}"
        if block:
            line += f"  {'+-- ' if r['block_start'] else '|   '}block {r['attnres_block']}"
        lines.append(line)
    counts = Counter(r["mixer"] for r in rows)
    lines.append(
        f"layout: {''.join('M' if r['mixer'] == 'MLA' else 'k' for r in rows)}  "
        f"(k = KDA x{counts['KDA']}, M = MLA x{counts['MLA']})"
    )
    return "\n".join(lines)


def format_checkpoint(summary: dict[str, Any]) -> list[str]:
    out = ["", f"-- checkpoint files (headers only): {summary['files']} file(s), {summary['tensors']:,} tensors, "
           f"{format_bytes(summary['bytes_total'])} declared"]  # fmt: skip
    out += [f"  {dtype:8s} {format_bytes(n):>12s}" for dtype, n in summary["bytes_by_dtype"].items()]
    skipped = summary["skipped_tensors"]
    if skipped:
        more = f" ... (+{len(skipped) - 6})" if len(skipped) > 6 else ""
        out.append(f"  skipped (not the text model): {len(skipped)}: {', '.join(skipped[:6])}{more}")
    check = summary["check"]
    if check["matches_config"]:
        out.append("  every tensor the config needs is there, with its shape")
    else:
        for key in ("missing", "unexpected", "mis_shaped"):
            if check[key]:
                out.append(f"  {key.replace('_', '-')}: {len(check[key])}: {', '.join(check[key][:6])}")
    return out


def format_report(
    cfg: K3Config,
    breakdown: dict[str, dict[str, int]],
    training: dict | None,
    headline: dict | None,
    source: str,
    checkpoint: dict[str, Any] | None = None,
) -> str:
    out = [f"== {source}", "", "-- config"]
    out += [f"  {k:24s} {v}" for k, v in config_summary(cfg).items()]
    total = sum(v["total"] for v in breakdown.values())
    active = sum(v["active"] for v in breakdown.values())
    params = f"{format_count(total)} total, {format_count(active)} active per token ({total:,} / {active:,})"
    out += ["", f"-- parameters: {params}"]
    for c, v in breakdown.items():
        n, n_active, share = format_count(v["total"]), format_count(v["active"]), 100 * v["total"] / total
        out.append(f"  {c:34s} {n:>9s} total {n_active:>9s} active  ({share:5.1f}%)")
    if checkpoint is not None:
        out += format_checkpoint(checkpoint)
    per_layer = checkpoint["params_by_layer"] if checkpoint else None
    out += ["", "-- layer map", *("  " + line for line in format_layer_map(cfg, per_layer).splitlines())]
    if training:
        out += ["", "-- training (metrics.json)"] + [f"  {k:24s} {format_number(v)}" for k, v in training.items()]
    if headline:
        from analysis.headline import HEADLINE_LABELS

        out += ["", "-- headline numbers (quick trace)"]
        out += [f"  {HEADLINE_LABELS.get(k, k):40s} {format_number(v)}" for k, v in headline.items() if k != "label"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from analysis.runs import DEFAULT_MAX_TOKENS, SAMPLES

    p = argparse.ArgumentParser(
        prog="k3lab inspect",
        description="Print a checkpoint's config, parameter counts, layer map and headline numbers. A checkpoint "
        "folder is answered from its config.json and safetensors headers alone (seconds, whatever its size: "
        "parameter counts from shapes, bytes by dtype, skipped multimodal tensors, a check against the config); "
        "only --text / --sample load the model.",
    )
    p.add_argument("run", help="checkpoint folder, or a preset name (shapes only)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="load the model and trace this text for headline numbers")
    src.add_argument("--sample", metavar="NAME", choices=SAMPLES, help="load the model and trace a built-in input")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens for the quick trace")
    add_device_options(p, when="with --text/--sample: ")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)

    from pathlib import Path

    from analysis import runs as runs_mod
    from analysis.history import final_numbers
    from k3core.checkpoint import CheckpointError
    from k3core.model import K3ForCausalLM
    from k3core.presets import PRESETS

    path = Path(args.run)
    training = headline = checkpoint = None
    try:
        if not path.exists() and args.run in PRESETS:
            if args.text or args.sample:
                raise ValueError("a preset has no weights: --text/--sample need a checkpoint folder")
            model = K3ForCausalLM.from_config(args.run, device="meta")
            cfg, breakdown = model.config, parameter_breakdown(model)
            source = f"preset {args.run} (shapes only, no weights)"
        else:
            files = CheckpointFiles.open(path)
            cfg, source = files.config, f"checkpoint {path}"
            breakdown = header_breakdown(files, cfg)
            checkpoint = checkpoint_summary(files)
            metrics, _ = runs_mod.read_metrics(path)
            training = final_numbers(metrics) if metrics else None
            if args.text or args.sample:
                run = runs_mod.load_run(path, device=args.device, dtype=args.dtype, max_memory=args.max_memory)
                configure_threads(run.model)
                if args.text:
                    sample = runs_mod.text_input(
                        Path(args.text).read_text(encoding="utf-8", errors="replace"),
                        run.config,
                        args.max_tokens,
                        tokenizer=run.tokenizer,
                    )
                else:
                    sample = runs_mod.sample_input(args.sample, run.config, args.max_tokens, tokenizer=run.tokenizer)
                from analysis.headline import headline_numbers

                headline = headline_numbers(runs_mod.trace_run(run, sample, what="all"))
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload = {
            "source": source,
            "config": config_summary(cfg),
            "parameters": breakdown,
            "layer_map": layer_map(cfg),
            "checkpoint": checkpoint,
            "training": training,
            "headline": headline,
        }
        print(json.dumps(payload, indent=1, default=str))
    else:
        print(format_report(cfg, breakdown, training, headline, source, checkpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
