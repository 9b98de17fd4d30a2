"""``k3lab trace RUN [--text FILE ...] --out DIR``: trace a checkpoint on one or more texts and write a trace folder
(``k3core.interp.trace_folder``: the traces, a run card, config and tokenizer) that ``k3lab report DIR`` and the app
open without the weights.

On one process the work is ``analysis.runs.trace_writer.write_run_traces``. Under torchrun with more than one process
(WORLD_SIZE > 1) it is the pipeline-parallel trace (``analysis.runs.trace_writer.write_pipeline_traces``,
``k3core.distributed.pipeline``): each rank loads and runs its own layers, rank 0 writes DIR.

    torchrun --nproc-per-node 8 -m k3lab trace RUN --text a.txt --text b.txt --out DIR --device cuda --dtype bfloat16

Exit codes: 0 written, 2 bad input (unreadable checkpoint, missing text, DIR not empty), 3 a pipeline rank failed,
died or hung (the message names it and its layers; nothing is written).
"""

from __future__ import annotations

import argparse
import os
import sys

from k3core.utils import input_limits as limits
from k3lab.options import Parser, add_device_options, arg_float, arg_int


def build_parser() -> argparse.ArgumentParser:
    from analysis.runs.texts import DEFAULT_MAX_TOKENS, SAMPLES

    p = Parser(
        prog="k3lab trace",
        description="Run a checkpoint on one or more texts, record every trace item, and write DIR: one trace per "
        "text (trace-N.npz), a run card (run_card.json: config, tokens and their strings, tokenizer, where and how "
        "it was made), config.json and the tokenizer files. DIR is written whole or not at all. `k3lab report DIR` "
        "and `k3lab app DIR` open it without the checkpoint.",
    )
    p.add_argument("run", metavar="RUN", help="checkpoint folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--text", metavar="FILE", action="append", help="UTF-8 text file (repeat for several texts: one trace each)"
    )
    src.add_argument(
        "--sample", metavar="NAME", choices=SAMPLES, help=f"built-in input: {', '.join(SAMPLES)} (default shakespeare)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="trace folder to write (must not exist, or be empty)")
    p.add_argument(
        "--max-tokens",
        type=arg_int(2, limits.MAX_TOKENS),
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens per text (default {DEFAULT_MAX_TOKENS}, at most {limits.MAX_TOKENS:,})",
    )
    add_device_options(p)
    p.add_argument(
        "--timeout",
        type=arg_float(1, 86_400),
        default=300.0,
        help="under torchrun: seconds a rank waits for another before all exit naming it (default 300)",
    )
    p.add_argument(
        "--edit",
        action="append",
        metavar="EDIT",
        help="on one process: trace the edited forward (repeatable; JSON or KIND.OP key=value, as k3lab experiment); "
        "the run card lists the edits",
    )
    p.add_argument("--logits", action="store_true", help="under torchrun: also keep the logits in the traces")
    p.add_argument(
        "--pipeline", action="store_true", help="run the pipeline code even on one process (torchrun, for benchmarks)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or args.pipeline:
        if args.edit:
            print("k3lab trace: --edit runs on one process only (not under torchrun)", file=sys.stderr)
            return 2
        return _pipeline(args)

    from analysis.runs import loading as runs_mod
    from analysis.runs.trace_writer import read_inputs, write_run_traces
    from k3core.interp.trace_folder import check_out_dir
    from k3core.loading.tensor_info import CheckpointError

    try:
        check_out_dir(args.out)
        run = runs_mod.load_run(args.run, device=args.device, dtype=args.dtype)
        inputs = read_inputs(run, args.text, args.sample, args.max_tokens)
        edits = None
        if args.edit:
            from k3core.interp.interventions import compile_edits, parse_edit

            edits = [parse_edit(e) for e in args.edit]
            compile_edits(run.config, edits)  # names checked before any forward
        out = write_run_traces(run, inputs, args.out, edits=edits)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab trace: {exc}", file=sys.stderr)
        return 2
    tokens = ", ".join(f"{c.name} {c.n}" for c in inputs)
    print(f"k3lab trace: wrote {out} ({len(inputs)} trace(s): {tokens} tokens)")
    return 0


def _pipeline(args) -> int:
    """One rank of the pipeline-parallel trace; a failure ends the process at once (no teardown that could wait on
    a dead peer)."""
    from analysis.runs.trace_writer import write_pipeline_traces
    from k3core.distributed.pipeline import PipelineError
    from k3core.loading.tensor_info import CheckpointError

    rank = os.environ.get("RANK", "?")
    try:
        summary = write_pipeline_traces(
            args.run,
            args.text,
            args.sample,
            args.max_tokens,
            args.out,
            args.dtype,
            args.timeout,
            keep_logits=args.logits,
        )
    except PipelineError as exc:
        print(f"k3lab trace: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    except (CheckpointError, ValueError, OSError) as exc:
        where = "" if str(exc).startswith("rank ") else f"rank {rank}: "
        print(f"k3lab trace: {where}{exc}", file=sys.stderr, flush=True)
        os._exit(2)
    a, b = summary["layers"]
    print(
        f"k3lab trace: rank {summary['rank']}: layers {a}-{b - 1}, read {summary['bytes_read']:,} bytes, "
        f"{summary['seconds']:.2f} s" + (f"; wrote {args.out}" if summary["rank"] == 0 else ""),
        flush=True,
    )
    return 0
