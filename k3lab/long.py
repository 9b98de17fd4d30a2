"""``k3lab long RUN [RUN2] [--text FILE | --sample NAME] [--tokens N] [--window W] [--distances LIST]
[--lengths LIST] [--estimate-only] --out DIR``: the Long-context report of one run (or two on the same long text).

It prints the cost estimate first (``analysis.experiments.long_runs.estimate_cost``: a calibration forward scaled by the
FLOP model), then records every position of the text (bulky arrays windowed at ``--window``) and writes the
``long_context`` views with ``k3lab report`` (``analysis.output.report.write_report``): loss by position, KDA state and
decay horizon, MLA entropy and sink over position, recall by distance and seconds / memory per token against T.
Exit codes as ``k3lab report``.
"""

from __future__ import annotations

import argparse
import sys

from k3core.utils import input_limits as limits
from k3lab import report as report_cmd
from k3lab.options import arg_int

MAX_LENGTHS = 32  # values of --distances / --lengths


def _lengths(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1 or max(out) > limits.MAX_TOKENS or len(out) > MAX_LENGTHS:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_LENGTHS} comma-separated token counts in 1..{limits.MAX_TOKENS:,}, "
            f"got {limits.shown(value)}"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = report_cmd.build_parser()
    p.prog = "k3lab long"
    p.description = "Long-context diagnostics: the cost estimate, then every position of one long text."
    p.set_defaults(views="long_context", window=1024, max_tokens=16384)
    p.add_argument(
        "--tokens",
        type=arg_int(2, limits.MAX_TOKENS),
        dest="max_tokens",
        help="tokens of the text to read (default 16384)",
    )
    p.add_argument(
        "--distances",
        type=_lengths,
        help=f"recall distances (default 16,64,256; 16 examples each; at most {MAX_LENGTHS} of "
        f"1..{limits.MAX_TOKENS:,})",
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        help=f"lengths T of the cost figure (default 128,512,2048; at most {MAX_LENGTHS} of 1..{limits.MAX_TOKENS:,})",
    )
    p.add_argument("--estimate-only", action="store_true", help="print the cost estimate and stop")
    return p


def _estimate(args: argparse.Namespace) -> None:
    from analysis.experiments.long_runs import estimate_cost
    from analysis.output.format import format_bytes
    from analysis.runs.loading import load_run

    run = load_run(args.runs[0], device=args.device, dtype=args.dtype, max_memory=args.max_memory)
    if run.model is None:
        print(f"{args.runs[0]}: a trace folder (no model): no estimate, its recorded trace is read", file=sys.stderr)
        return
    table = estimate_cost(run.model, [args.max_tokens])
    row = table.iloc[-1]
    cal = table.attrs["calibration"]
    print(
        f"estimate for {args.max_tokens:,} tokens of {run.label}: about {row['seconds']:,.0f} s and "
        f"{format_bytes(row['bytes'])} of peak memory growth (from {cal['tokens']} tokens in {cal['seconds']:.2f} s; "
        "MLA on the math attention path counted as quadratic)",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 2:
        print("k3lab long: --tokens must be at least 2", file=sys.stderr)
        return 2
    from analysis.output.report import check_report_folder
    from k3core.loading.tensor_info import CheckpointError

    try:
        if not args.estimate_only:
            check_report_folder(args.out)  # before the model loads
        _estimate(args)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab long: {exc}", file=sys.stderr)
        return 2
    if args.estimate_only:
        return 0
    options = {}
    if args.distances:
        options["recall_distances"] = args.distances
    if args.lengths:
        options["cost_lengths"] = args.lengths
    args.view_options = options
    args.text_index = None
    return report_cmd._report(args, args.out, None)
