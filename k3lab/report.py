"""``k3lab report RUN [RUN2] [--text FILE | --sample NAME | --text-index N|all] [--layer N] [--head H] --out DIR``:
the headless report of one run, or a comparison of two (``analysis.output.report.write_report`` does the work; this
module parses, shows progress, prints). ``--layer`` / ``--head`` focus the views that have a layer/head picker in the
app. ``--text-index`` picks a trace folder's recorded text (default its text 0); ``all`` writes one report per text,
in ``DIR/text-0``, ``DIR/text-1``, ...

Exit codes: 0 success, 1 the report was written but some view failed unexpectedly, 2 bad input
(unreadable checkpoint, missing text file, unknown sample, runs that cannot read the same text, a --layer/--head
that no selected view can focus on, a --text-index the trace folder has no text for).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3core.utils.input_limits import MAX_INDEX, MAX_TOKENS, shown
from k3lab.options import Parser, add_device_options, add_output_options, arg_int

ALL_TEXTS = "all"


def text_index_arg(value: str) -> int | str:
    """``--text-index``: a whole number 0 or more, or "all"."""
    if value.strip().lower() == ALL_TEXTS:
        return ALL_TEXTS
    try:
        index = int(value)
    except ValueError:
        index = -1
    if index < 0:
        raise argparse.ArgumentTypeError(f"expected a text number (0, 1, ...) or 'all', got {shown(value)}")
    return index


def build_parser() -> argparse.ArgumentParser:
    from analysis.runs.texts import DEFAULT_MAX_TOKENS, SAMPLES

    p = Parser(
        prog="k3lab report",
        description="Write a headless HTML report (every figure, "
        "its data, headline numbers) for one run, or a comparison of two runs.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="checkpoint or trace folder(s) (`k3lab trace`): one run, or two to compare",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="UTF-8 text file to run the model on")
    src.add_argument(
        "--sample",
        metavar="NAME",
        choices=SAMPLES,
        help=f"built-in input: {', '.join(SAMPLES)} (default: held-out Shakespeare)",
    )
    src.add_argument(
        "--text-index",
        type=text_index_arg,
        metavar="N|all",
        help="when RUN is a trace folder (`k3lab trace --text A --text B ...`): report its recorded text N "
        "(0-based, in the order traced; default 0), or 'all': one report per text, in OUT/text-0, OUT/text-1, ...",
    )
    add_output_options(p)
    add_device_options(p)
    p.add_argument(
        "--max-tokens",
        type=arg_int(2, MAX_TOKENS),
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens of the input to trace (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--views",
        metavar="LIST",
        help="comma-separated view keys or sections to include (default: every view of "
        "analysis.views.catalogue.all_views())",
    )
    p.add_argument(
        "--skip-model-views",
        action="store_true",
        help="skip views that rerun the model (importance by ablation / gradients: the slow ones)",
    )
    p.add_argument(
        "--layer",
        type=arg_int(0, MAX_INDEX),
        metavar="N",
        help="focus the per-layer views (KDA, MLA, MoE, AttnRes ones with a layer picker in the app) on decoder "
        "layer N (0-based); views whose run has no such layer are listed as not applicable (default: all layers)",
    )
    p.add_argument(
        "--head",
        type=arg_int(0, MAX_INDEX),
        metavar="H",
        help="focus the per-head views (KDA and MLA) on head H (0-based; default: all heads)",
    )
    p.add_argument("--save-trace", action="store_true", help="also write each run's trace (.npz)")
    p.add_argument(
        "--window",
        type=arg_int(1, MAX_TOKENS),
        metavar="N",
        help="keep the bulky per-token trace arrays (hidden states, KDA decays, MoE latents) for the first N "
        "positions only; every diagnostic still covers the whole text, from position bins (default: all; use "
        "1024 for long texts, see `k3lab long`)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.runs) > 2:
        print("k3lab report: give one run, or two runs to compare", file=sys.stderr)
        return 2
    if args.max_tokens < 2:
        print("k3lab report: --max-tokens must be at least 2", file=sys.stderr)
        return 2

    from analysis.output.report import check_report_folder
    from k3core.loading.tensor_info import CheckpointError
    from k3core.utils.files import check_output_folder

    try:
        if args.text_index == ALL_TEXTS:  # a folder of text-N reports: its own output holds text-0
            check_output_folder(args.out, ("text-0",), "folder of reports")
        else:
            check_report_folder(args.out)
        indices = _text_indices(args)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"k3lab report: {exc}", file=sys.stderr)
        return 2
    codes = []
    for index in indices:
        out = args.out if args.text_index != ALL_TEXTS else Path(args.out) / f"text-{index}"
        codes.append(_report(args, out, index))
        if codes[-1] == 2:
            break
    return max(codes)


def _text_indices(args: argparse.Namespace) -> list[int | None]:
    """The recorded texts to report: [None] without --text-index, [N], or every text of the trace folder for
    'all'. Raises ValueError (checked before any model is loaded) when RUN is no trace folder or has no text N."""
    from analysis.runs.loading import check_text_index, load_trace_folder
    from k3core.interp.trace_folder import is_trace_dir

    if args.text_index is None:
        return [None]
    if not is_trace_dir(args.runs[0]):
        raise ValueError(
            f"--text-index picks a recorded text of a trace folder, and {args.runs[0]} is not one (no run_card.json); "
            "give a checkpoint --text FILE or --sample NAME instead"
        )
    run = load_trace_folder(args.runs[0])
    if args.text_index == ALL_TEXTS:
        return list(range(len(run.recorded.texts)))
    return [check_text_index(run, args.text_index)]


def _report(args: argparse.Namespace, out: str | Path, text_index: int | None) -> int:
    """One report (``write_report``) into ``out``, with a progress bar and a summary; its exit code."""
    from tqdm import tqdm

    from analysis.output.report import select_views, write_report
    from analysis.views.catalogue import all_views
    from k3core.loading.tensor_info import CheckpointError

    steps = 2 * len(args.runs) + len(select_views(all_views(), args.views, args.skip_model_views)) + 3
    progress = tqdm(total=steps, desc="k3lab report", unit="step", disable=args.quiet, file=sys.stderr, leave=False)
    try:
        result = write_report(
            args.runs,
            out,
            text_file=args.text,
            sample=args.sample,
            max_tokens=args.max_tokens,
            device=args.device,
            dtype=args.dtype,
            max_memory=args.max_memory,
            static=not args.no_static,
            views=args.views,
            skip_model_views=args.skip_model_views,
            save_trace=args.save_trace,
            progress=progress,
            picks={k: v for k, v in (("layer", args.layer), ("head", args.head)) if v is not None},
            text_index=text_index,
            window=args.window,
            options=getattr(args, "view_options", None),
        )
    except (CheckpointError, ValueError, OSError) as exc:
        progress.close()
        print(f"k3lab report: {exc}", file=sys.stderr)
        return 2
    progress.close()
    timings = result.timings
    of_text = "" if text_index is None else f" of recorded text {text_index}"
    print(
        f"k3lab report: wrote {result.out / 'report.html'}{of_text} ({len(result.shown)} figures, "
        f"{len(result.skipped)} not applicable, {len(result.failed)} failed) in {timings['total']:.1f} s"
    )
    slow = sorted(result.entries, key=lambda e: -e.seconds)[:3]
    print(
        "  slowest views: "
        + ", ".join(f"{e.key} {e.seconds:.1f} s" for e in slow)
        + "; stages: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    )
    for e in result.skipped:
        print(f"  skipped {e.key}: {e.note}")
    if result.static_note:
        print(f"  no PNG/SVG: {result.static_note}")
    elif result.export_problems:
        first = next(iter(result.export_problems.items()))
        print(f"  {len(result.export_problems)} export(s) failed, e.g. {first[0]}: {first[1]}")
    for e in result.failed:
        print(f"  FAILED {e.key}: {e.error}", file=sys.stderr)
    return 1 if result.failed else 0
