"""``k3lab inspect RUN``: a terminal summary of a checkpoint (or a preset name), from headers alone.

    k3lab inspect RUN [--text FILE | --sample NAME] [--max-tokens N] [--json]
    k3lab inspect RUN --plan --gpu-memory 141GB [--ranks N] [--dtype bfloat16]

``--plan``: the GPUs a resident pipeline-parallel run needs (``k3core.distributed.rank_plan``: contiguous layer ranges,
the embedding on the first rank, the output mix, norm and LM head on the last), from the headers alone.

The numbers come from ``analysis.weights.checkpoint_summary`` (headers only; a 5 TB checkpoint answers in seconds) and,
with ``--text`` / ``--sample``, from a quick trace through ``analysis.runs.loading.load_run`` (headline numbers).
Exit codes: 0 success, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from analysis.output.format import format_bytes, format_count, format_number
from analysis.weights.checkpoint_summary import config_summary, layer_map
from k3core.modeling.config import K3Config
from k3core.utils import input_limits as limits
from k3lab.options import Parser, add_device_options, arg_int


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
        from analysis.metrics.headline import HEADLINE_LABELS

        out += ["", "-- headline numbers (quick trace)"]
        out += [f"  {HEADLINE_LABELS.get(k, k):40s} {format_number(v)}" for k, v in headline.items() if k != "label"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from analysis.runs.texts import DEFAULT_MAX_TOKENS, SAMPLES

    p = Parser(
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
    p.add_argument(
        "--max-tokens",
        type=arg_int(2, limits.MAX_TOKENS),
        default=DEFAULT_MAX_TOKENS,
        help="tokens for the quick trace",
    )
    add_device_options(p, when="with --text/--sample: ")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan = p.add_argument_group("multi-GPU plan (pipeline parallel, `k3lab trace` under torchrun)")
    plan.add_argument(
        "--plan", action="store_true", help="how many GPUs a resident run needs and which layers each rank holds"
    )
    plan.add_argument("--gpu-memory", default="141GB", metavar="SIZE", help="memory of one GPU (default 141GB, H200)")
    plan.add_argument(
        "--reserve",
        default="10%",
        metavar="SIZE",
        help="kept free on each GPU for activations, the CUDA context and buffers (default 10%% of --gpu-memory)",
    )
    plan.add_argument(
        "--ranks", type=arg_int(1, limits.MAX_RANKS), default=None, help="split over exactly this many ranks instead"
    )
    plan.add_argument(
        "--gpus-per-node",
        type=arg_int(1, 1024),
        default=8,
        help="for the node count and torchrun line (default 8)",
    )
    args = p.parse_args(argv)
    if args.plan:
        return print_plan(args)

    from pathlib import Path

    from analysis.metrics.history import final_numbers
    from analysis.runs import loading as runs_mod
    from analysis.runs import texts
    from analysis.weights.checkpoint_summary import checkpoint_summary, header_breakdown, parameter_breakdown
    from k3core.loading.folder import CheckpointFiles
    from k3core.loading.tensor_info import CheckpointError
    from k3core.modeling.model import K3ForCausalLM
    from k3core.modeling.presets import PRESETS

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
                if args.text:
                    sample = texts.text_input(
                        Path(args.text).read_text(encoding="utf-8", errors="replace"),
                        run.config,
                        args.max_tokens,
                        tokenizer=run.tokenizer,
                    )
                else:
                    sample = texts.sample_input(args.sample, run.config, args.max_tokens, tokenizer=run.tokenizer)
                from analysis.metrics.headline import headline_numbers

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


def usable_bytes(gpu_memory: str, reserve: str) -> int:
    """One GPU's bytes minus the reserve ("10%" of it, or a size). Raises ValueError."""
    from k3core.utils.units import parse_bytes

    total = parse_bytes(gpu_memory, bare=2**30, what="--gpu-memory")  # a bare number is GiB here
    percent = reserve.strip().endswith("%")
    held = (
        total * float(reserve.strip()[:-1]) / 100 if percent else parse_bytes(reserve, 2**30, "--reserve", zero_ok=True)
    )
    if held >= total:
        raise ValueError(f"--reserve {reserve} leaves nothing of --gpu-memory {gpu_memory}")
    return int(total - held)


def format_plan(plan, source: str, dtype: str, gpus_per_node: int) -> str:
    n = len(plan.ranks)
    nodes = -(-n // gpus_per_node)
    head = f"== {source}: a resident run in {dtype} needs {n} GPU(s)"
    if plan.capacity is not None:
        head += f" of {format_bytes(plan.capacity)} usable each"
    lines = [head + f" ({format_bytes(plan.total_bytes)} of weights), {nodes} node(s) of {gpus_per_node}", ""]
    lines.append(f"  {'rank':>4}  {'node':>4}  {'layers':>9}  {'memory':>10}  holds")
    for row, share in zip(plan.as_rows(), plan.ranks):
        lines.append(
            f"  {row['rank']:>4}  {share.rank // gpus_per_node:>4}  {row['layers']:>9}  "
            f"{format_bytes(row['bytes']):>10}  {row['holds']}"
        )
    per_node = min(n, gpus_per_node)
    lines += [
        "",
        f"  torchrun --nnodes {nodes} --nproc-per-node {per_node} -m k3lab trace RUN --text FILE --out DIR "
        f"--device cuda --dtype {dtype}",
        "  (weights only; activations, the decode state and buffers come out of --reserve)",
    ]
    return "\n".join(lines)


def print_plan(args) -> int:
    """``k3lab inspect RUN --plan``: the rank plan of a resident run (k3core.distributed.rank_plan), headers only."""
    from analysis.runs.loading import DTYPES
    from k3core.distributed.rank_plan import plan_for, sizes_of
    from k3core.loading.tensor_info import CheckpointError

    dtype = args.dtype or "bfloat16"
    try:
        sizes, layers = sizes_of(args.run, DTYPES[dtype])
        capacity = None if args.ranks else usable_bytes(args.gpu_memory, args.reserve)
        plan = plan_for(sizes, layers, capacity=capacity, world_size=args.ranks)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload = {
            "source": args.run,
            "dtype": dtype,
            "capacity_bytes": plan.capacity,
            "total_bytes": plan.total_bytes,
            "gpus": len(plan.ranks),
            "ranks": plan.as_rows(),
        }
        print(json.dumps(payload, indent=1))
    else:
        print(format_plan(plan, args.run, dtype, args.gpus_per_node))
    return 0
