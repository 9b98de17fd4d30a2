"""``k3lab weights PATH --out DIR``: weight-only diagnostics of a checkpoint of any size (no model built).

The work is ``analysis.weights`` (reading the small tensors into a ``WeightSummary``) and
``analysis.output.weights_folder.write_outputs`` (the output folder); this module parses the options and prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3lab.options import Parser, add_output_options

WEIGHTS_HELP = """\
Weight-only diagnostics: what a checkpoint learned, read from its small tensors without building
the model, so a 5 TB checkpoint (Kimi K3) answers in seconds on a laptop.

Reads the safetensors headers (parameter layout by depth and kind comes from the shapes), then only
the small tensors, one at a time: KDA A_log / dt_bias (resting decay g0 and its half-life
ln2/(-g0) tokens per channel), AttnRes pseudo-queries (norm per site), scale/bias residuals, router
selection biases and router weights (per layer x expert), and the norm weights. With --experts it
also streams every routed expert matrix for per-expert weight norms (most of the checkpoint; the
byte count is printed first).

Writes into DIR: weights.json (a stable format for scripts), index.html (every figure on one
offline page), and figures/<view>.{html,csv,png,svg} (PNG/SVG need Chromium; without it they are
skipped with a message). Exit codes: 0 done, 1 some figure failed, 2 bad checkpoint.
"""


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="k3lab weights", description=WEIGHTS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint folder (config.json + model.safetensors, or shards + index; the Kimi K3 "
        "repo's language_model. prefix and vision tensors are handled) or one .safetensors file",
    )
    parser.add_argument(
        "--experts",
        action="store_true",
        help="also read every routed expert matrix for per-expert weight norms (reads most of the checkpoint)",
    )
    add_output_options(parser)
    args = parser.parse_args(argv)

    import time

    from tqdm import tqdm

    from analysis import weights as wt
    from analysis.output.format import format_bytes
    from analysis.output.weights_folder import check_weights_folder, write_outputs
    from k3core.loading.tensor_info import CheckpointError

    started = time.perf_counter()
    try:
        check_weights_folder(args.out)
        source = wt.open_source(args.path)
    except (CheckpointError, ValueError) as exc:
        print(f"k3lab weights: {exc}", file=sys.stderr)
        return 2
    print(
        f"k3lab weights: {len(source.tensors):,} tensors, {format_bytes(source.bytes_total)} declared"
        + (f", {len(source.skipped)} skipped (not the text model)" if source.skipped else "")
    )
    if args.experts:
        n = wt.expert_bytes(source)
        print(f"k3lab weights: --experts will read {n:,} bytes ({format_bytes(n)}) of expert matrices")
    bar = tqdm(
        total=0,
        desc="reading",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=args.quiet,
        file=sys.stderr,
        leave=False,
    )

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    label = Path(args.path).resolve().name
    try:
        summary = wt.summarize_source(
            source, experts=args.experts, progress=progress, label=label, path=args.path, started=started
        )
    except CheckpointError as exc:
        bar.close()
        print(f"k3lab weights: {exc}", file=sys.stderr)
        return 2
    bar.close()
    result = write_outputs(summary, args.out, static=not args.no_static)
    share = 100 * summary.bytes_read / max(summary.bytes_total, 1)
    print(
        f"k3lab weights: read {format_bytes(summary.bytes_read)} ({share:.4f}% of declared) in "
        f"{summary.seconds:.2f} s; {summary.total_params:,} parameters in {summary.num_layers} layers"
    )
    for note in summary.notes:
        print(f"k3lab weights: note: {note}")
    static_msgs = {
        m
        for files in result["figures"].values()
        for f, m in files.items()
        if f in ("png", "svg") and not isinstance(m, Path)
    }
    for message in sorted(static_msgs)[:1]:
        print(f"k3lab weights: PNG/SVG not written: {message}", file=sys.stderr)
    for key, message in result["errors"].items():
        print(f"k3lab weights: figure {key} failed: {message}", file=sys.stderr)
    print(f"k3lab weights: wrote {result['json']} and {result['index']}")
    return 1 if result["errors"] else 0
