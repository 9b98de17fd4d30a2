"""``k3lab report RUN [RUN2] [--text FILE | --sample NAME] [--layer N] [--head H] --out DIR``: the headless report
of one run, or a comparison of two (``analysis.report.write_report`` does the work; this module parses, shows
progress, prints). ``--layer`` / ``--head`` focus the views that have a layer/head picker in the app.

Exit codes: 0 success, 1 the report was written but some view failed unexpectedly, 2 bad input
(unreadable checkpoint, missing text file, unknown sample, runs that cannot read the same text, a --layer/--head
that no selected view can focus on).
"""

from __future__ import annotations

import argparse
import sys

from k3lab.options import add_device_options, add_output_options


def build_parser() -> argparse.ArgumentParser:
    from analysis.runs import DEFAULT_MAX_TOKENS, SAMPLES

    p = argparse.ArgumentParser(
        prog="k3lab report",
        description="Write a headless HTML report (every figure, "
        "its data, headline numbers) for one run, or a comparison of two runs.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="checkpoint folder(s): one run, or two to compare")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="UTF-8 text file to run the model on")
    src.add_argument(
        "--sample",
        metavar="NAME",
        choices=SAMPLES,
        help=f"built-in input: {', '.join(SAMPLES)} (default: held-out Shakespeare)",
    )
    add_output_options(p)
    add_device_options(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens of the input to trace (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--views",
        metavar="LIST",
        help="comma-separated view keys or sections to include (default: every view of analysis.views.all_views())",
    )
    p.add_argument(
        "--skip-model-views",
        action="store_true",
        help="skip views that rerun the model (importance by ablation / gradients: the slow ones)",
    )
    p.add_argument(
        "--layer",
        type=int,
        metavar="N",
        help="focus the per-layer views (KDA, MLA, MoE, AttnRes ones with a layer picker in the app) on decoder "
        "layer N (0-based); views whose run has no such layer are listed as not applicable (default: all layers)",
    )
    p.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="focus the per-head views (KDA and MLA) on head H (0-based; default: all heads)",
    )
    p.add_argument("--save-trace", action="store_true", help="also write each run's trace (.npz)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.runs) > 2:
        print("k3lab report: give one run, or two runs to compare", file=sys.stderr)
        return 2
    if args.max_tokens < 2:
        print("k3lab report: --max-tokens must be at least 2", file=sys.stderr)
        return 2

    from tqdm import tqdm

    from analysis.report import select_views, write_report
    from analysis.views import all_views
    from k3core.checkpoint import CheckpointError

    steps = 2 * len(args.runs) + len(select_views(all_views(), args.views, args.skip_model_views)) + 3
    progress = tqdm(total=steps, desc="k3lab report", unit="step", disable=args.quiet, file=sys.stderr, leave=False)
    try:
        result = write_report(
            args.runs,
            args.out,
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
        )
    except (CheckpointError, ValueError, OSError) as exc:
        progress.close()
        print(f"k3lab report: {exc}", file=sys.stderr)
        return 2
    progress.close()
    timings = result.timings
    print(
        f"k3lab report: wrote {result.out / 'report.html'} ({len(result.shown)} figures, {len(result.skipped)} not "
        f"applicable, {len(result.failed)} failed) in {timings['total']:.1f} s"
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
