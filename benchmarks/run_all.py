"""Run the k3lab benchmark suite and print one table of side-by-side ratios.

    python -m benchmarks                  # everything (about 10-20 minutes on a busy 2-core CPU)
    python -m benchmarks --quick          # smaller sizes, a minute or two
    python -m benchmarks --only cache trace
    python -m benchmarks --only long      # T = 1K..64K in subprocesses (--full: 128K); not in the default run
    python -m benchmarks --only compile   # torch.compile of a training step: speed-up, compile time, payback (minutes)
    python -m benchmarks --update-readme  # also write the table into benchmarks/README.md

Every row compares a candidate with a reference measured in the same process, interleaved, best of
N runs: on a shared machine absolute timings are noisy, ratios much less so.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform
import re
import sys
import time
from pathlib import Path

import torch

from .common import Row, clock_name, cpu_model_name, fmt_num, use_clock

SUITES = {
    "kda": "bench_kda_ratio",
    "forward": "bench_forward",
    "cache": "bench_cache",
    "trace": "bench_trace",
    "hooks": "bench_hooks",
    "moe": "bench_moe",
    "decode": "bench_decode",
    "train": "bench_train",
    "long": "bench_long",
    "compile": "bench_compile",
}
# Run only when asked for: long (--only long) takes tens of minutes and up to 3 GiB per subprocess; compile
# (--only compile) minutes of torch.compile.
ON_REQUEST = ("long", "compile")
README = Path(__file__).with_name("README.md")
START, END = "<!-- results:start -->", "<!-- results:end -->"


def run_suites(names: list[str], quick: bool, log=print, full: bool = False) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        module = importlib.import_module(f".{SUITES[name]}", __package__)
        t0 = time.perf_counter()
        rows += module.run(quick=quick, full=full) if name == "long" else module.run(quick=quick)
        log(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows


def format_ratio(r: Row) -> str:
    return "n/a" if r.ratio != r.ratio else f"{r.ratio:.3g}"


def table(rows: list[Row], markdown: bool = False) -> str:
    """The results as aligned text, or as a Markdown table."""
    head = ["benchmark", "case", "candidate", "reference", "ratio", "target", "note"]
    body = []
    for r in rows:
        status = "" if r.ok is None else (" ok" if r.ok else " MISS")
        body.append(
            [
                r.bench,
                r.case,
                f"{r.value_label}: {fmt_num(r.value, r.unit)}",
                f"{r.base_label}: {fmt_num(r.base, r.unit)}",
                format_ratio(r),
                (r.target + status).strip(),
                r.note,
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body])


def header(argv: list[str], quick: bool) -> str:
    return (
        f"date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}\n"
        f"machine: {cpu_model_name()}, {torch.get_num_threads()} torch thread(s) "
        f"(os cpus {len(__import__('os').sched_getaffinity(0))}); clock: {clock_name()}; torch {torch.__version__}; "
        f"python {platform.python_version()}\n"
        f"command: python -m benchmarks {' '.join(argv)}".rstrip()
        + ("\nmode: --quick (smaller sizes)" if quick else "")
    )


def update_readme(text: str, path: Path = README) -> None:
    """Replace the block between the results markers in the README with ``text``."""
    content = path.read_text() if path.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in content or END not in content:
        content = content.rstrip() + f"\n\n## Latest results\n\n{START}\n{END}\n"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: f"{START}\n{text}\n{END}", content))


def main(argv: list[str] | None = None) -> list[Row]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a minute or two)")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=sorted(SUITES),
        default=[n for n in SUITES if n not in ON_REQUEST],
        help="run only these suites (default: all but long)",
    )
    ap.add_argument("--full", action="store_true", help="long: add T = 128K")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine OpenMP spin-waiting "
        "makes 2 threads erratic and often far slower)",
    )
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): process CPU time, robust to other processes on shared cores; wall: elapsed",
    )
    ap.add_argument("--update-readme", action="store_true", help="write the table into benchmarks/README.md")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    use_clock(args.clock)
    print(header(argv, args.quick))
    rows = run_suites(args.only, args.quick, full=args.full)
    print()
    print(table(rows))
    misses = [r for r in rows if r.ok is False]
    if misses:
        print(
            f"\n{len(misses)} target(s) missed: "
            + "; ".join(f"{r.bench} {r.case} ({format_ratio(r)} vs {r.target})" for r in misses)
        )
    if args.update_readme:
        update_readme(f"```\n{header(argv, args.quick)}\n```\n\n{table(rows, markdown=True)}")
        print(f"\nwrote {README}")
    return rows
