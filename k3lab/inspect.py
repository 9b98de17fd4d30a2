"""``k3lab inspect RUN``: a terminal summary of a checkpoint (or a preset name), from headers alone.

    k3lab inspect RUN [--text FILE | --sample NAME] [--max-tokens N] [--json]

The numbers come from ``analysis.checkpoint_summary`` (headers only; a 5 TB checkpoint answers in seconds) and,
with ``--text`` / ``--sample``, from a quick trace through ``analysis.runs.load_run`` (headline numbers).
Exit codes: 0 success, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from analysis.checkpoint_summary import config_summary, layer_map
from analysis.format import format_bytes, format_count, format_number
from k3core.config import K3Config
from k3lab.options import add_device_options


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
    from analysis.checkpoint_summary import checkpoint_summary, header_breakdown, parameter_breakdown
    from analysis.history import final_numbers
    from k3core.checkpoint import CheckpointError
    from k3core.checkpoint_files import CheckpointFiles
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
