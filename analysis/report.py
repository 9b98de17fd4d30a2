"""Headless report: every view of one run (or a comparison of two) in one offline HTML file, plus data files.

    k3lab report RUN [RUN2] [--text FILE | --sample NAME] --out DIR [--no-static] [--max-tokens N]

Writes into DIR:

- ``report.html``: one self-contained page (plotly.js inline once, no network needed) with the run's
  config and model card, the input, the headline table, and every view of ``analysis.views.all_views()``
  (views that do not apply are listed with the reason);
- ``figures/<view>.{csv,json}`` and, unless ``--no-static`` or when Chromium is missing, ``.png``/``.svg``;
  for two runs ``<view>__side.*`` (side by side, shared axes) and ``<view>__diff.*`` (A - B);
- ``headline.json``: the headline numbers of each run (and the delta A - B for two runs).

Exit codes: 0 success, 1 the report was written but some view failed unexpectedly, 2 bad input
(unreadable checkpoint, missing text file, unknown sample, a non byte-level model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from analysis.cli_options import add_device_options
from analysis.report_html import Entry, render_html
from analysis.views import AnalysisContext, View
from k3core.runtime import configure_threads


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
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created if needed)")
    p.add_argument("--no-static", action="store_true", help="skip PNG/SVG export (no browser start; fastest)")
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
    p.add_argument("--save-trace", action="store_true", help="also write each run's trace (.npz)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _labels(runs) -> list[str]:
    from analysis.compare import distinct_labels

    names = [r.label for r in runs]
    return list(distinct_labels(*names)) if len(names) == 2 else names


def select_views(views: list[View], wanted: str | None = None, skip_model_views: bool = False) -> list[View]:
    """Views whose key or section is in the comma-separated ``wanted`` (all when None), optionally without the
    ones that need the model."""
    if wanted:
        names = {w.strip() for w in wanted.split(",") if w.strip()}
        views = [v for v in views if v.key in names or v.section in names]
    if skip_model_views:
        views = [v for v in views if not v.needs_model]
    return views


def build_single(views: list[View], ctx: AnalysisContext, progress: Any) -> list[Entry]:
    from analysis.views import NotApplicable

    entries = []
    for view in views:
        entry = Entry(view.key, view.title, view.section, view.description)
        t0 = time.perf_counter()
        try:
            entry.figure, entry.table = view.build(ctx)
        except NotApplicable as exc:
            entry.note = str(exc) or "not applicable"
        except Exception as exc:  # noqa: BLE001 - one broken view must not lose the whole report
            entry.error = f"{type(exc).__name__}: {exc}"
        entry.seconds = time.perf_counter() - t0
        entries.append(entry)
        progress.update(1)
    return entries


def build_comparison(views: list[View], a: AnalysisContext, b: AnalysisContext, progress: Any) -> list[Entry]:
    """Per view, as the view declares (``View.compare``): side by side on shared axes (history views: one
    figure with run B overlaid) and, for views with a declared difference, A - B."""
    from analysis.compare import build_both, difference_view, has_difference, side_by_side
    from analysis.views import NotApplicable

    entries = []
    for view in views:
        t0 = time.perf_counter()
        key = view.key if view.compare.overlay else f"{view.key}__side"  # overlaid: one figure, not two halves
        side = Entry(key, view.title, view.section, view.description)
        built = None
        try:
            built = None if view.compare.overlay else build_both(view, a, b)
            side.figure, side.table = side_by_side(view, a, b, built=built)
        except NotApplicable as exc:
            side.note = str(exc)
        except Exception as exc:  # noqa: BLE001 - one broken view must not lose the whole report
            side.error = f"{type(exc).__name__}: {exc}"
        entries.append(side)
        if side.figure is not None and has_difference(view):
            diff = Entry(
                f"{view.key}__diff",
                f"{view.title}: difference A - B",
                view.section,
                f"A - B of {', '.join(view.compare.difference)} on a diverging scale centred at 0.",
            )
            try:
                diff.figure, diff.table = difference_view(view, a, b, built=built)
                entries.append(diff)
            except NotApplicable as exc:
                side.note = f"no difference view: {exc}"
            except Exception as exc:  # noqa: BLE001
                diff.error = f"{type(exc).__name__}: {exc}"
                entries.append(diff)
        side.seconds = time.perf_counter() - t0
        progress.update(1)
    return entries


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="k3lab report", unit="step", disable=quiet, file=sys.stderr, leave=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.runs) > 2:
        print("k3lab report: give one run, or two runs to compare", file=sys.stderr)
        return 2
    if args.max_tokens < 2:
        print("k3lab report: --max-tokens must be at least 2", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(args.out)

    from analysis import runs as runs_mod
    from analysis.export import export_many, static_export_available
    from analysis.headline import headline_numbers, headline_table
    from analysis.views import all_views
    from k3core.checkpoint import CheckpointError

    views = select_views(all_views(), args.views, args.skip_model_views)
    n_static = 0 if args.no_static else 1
    progress = _progress(len(args.runs) * 2 + len(views) + 2 + n_static, args.quiet)
    try:
        runs = []
        for path in args.runs:
            runs.append(runs_mod.load_run(path, device=args.device, dtype=args.dtype, max_memory=args.max_memory))
            configure_threads(runs[-1].model)
            progress.update(1)
        timings["load"] = time.perf_counter() - t_start
        labels = _labels(runs)
        cfg = runs[0].config
        if args.text:
            text_path = Path(args.text)
            if not text_path.is_file():
                raise ValueError(f"{text_path}: no such text file")
            sample = runs_mod.text_input(
                text_path.read_text(encoding="utf-8", errors="replace"),
                cfg,
                args.max_tokens,
                name=text_path.name,
                tokenizer=runs[0].tokenizer,
            )
        else:
            sample = runs_mod.sample_input(
                args.sample or runs_mod.DEFAULT_SAMPLE, cfg, args.max_tokens, tokenizer=runs[0].tokenizer
            )
        for run in runs[1:]:
            if run.config.vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"the runs have different vocabularies ({cfg.vocab_size} vs "
                    f"{run.config.vocab_size}); they cannot read the same input"
                )
            digests = {getattr(r.tokenizer, "digest", None) for r in (runs[0], run)}
            if sample.name != "mqar" and len(digests) > 1:
                raise ValueError(
                    f"the runs have different tokenizers ({runs[0].tokenizer!r} vs {run.tokenizer!r}); "
                    "the same token ids would be different texts"
                )
        t0 = time.perf_counter()
        contexts = []
        for run, label in zip(runs, labels):
            contexts.append(runs_mod.trace_run(run, sample, what="all", label=label))
            progress.update(1)
        timings["trace"] = time.perf_counter() - t0
    except (CheckpointError, ValueError, OSError) as exc:
        progress.close()
        print(f"k3lab report: {exc}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    if len(contexts) == 2:
        entries = build_comparison(views, contexts[0], contexts[1], progress)
    else:
        entries = build_single(views, contexts[0], progress)
    headlines = [headline_numbers(c) for c in contexts]
    progress.update(1)
    timings["views"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    formats = ("csv", "json") if args.no_static else ("csv", "json", "png", "svg")
    static_note = None
    if not args.no_static:
        ok, why = static_export_available()
        if not ok:
            formats, static_note = ("csv", "json"), why
    shown = [e for e in entries if e.figure is not None]
    meta = {e.key: {"view": e.key, "title": e.title, "section": e.section, "runs": labels} for e in shown}
    results = export_many([(e.figure, e.table, e.key) for e in shown], out / "figures", formats, meta=meta)
    for e in shown:
        e.files = results.get(e.key, {})
    progress.update(n_static)
    timings["files"] = time.perf_counter() - t0

    headline_json = {
        "runs": headlines,
        "input": {"name": sample.name, "description": sample.description, "tokens": int(sample.input_ids.shape[1])},
        "checkpoints": [
            {"label": lab, "path": str(r.path), "fingerprint": r.fingerprint, "device": r.device, "dtype": r.dtype}
            for r, lab in zip(runs, labels)
        ],
    }
    if len(headlines) == 2:
        table = headline_table(headlines[0], headlines[1])
        headline_json["delta_a_minus_b"] = dict(zip(table["metric"], table["delta"]))
    (out / "headline.json").write_text(json.dumps(_json_safe(headline_json), indent=1) + "\n")
    if args.save_trace:
        for ctx, tag in zip(contexts, "AB"):
            ctx.trace.save(out / f"trace_{tag}.npz")

    timings["total"] = time.perf_counter() - t_start
    (out / "report.html").write_text(render_html(entries, runs, labels, headlines, sample, timings), encoding="utf-8")
    progress.update(1)
    progress.close()

    failed = [e for e in entries if e.error]
    skipped = [e for e in entries if e.note and e.figure is None]
    export_problems = {f"{e.key}.{fmt}": v for e in shown for fmt, v in e.files.items() if isinstance(v, str)}
    print(
        f"k3lab report: wrote {out / 'report.html'} ({len(shown)} figures, {len(skipped)} not applicable, "
        f"{len(failed)} failed) in {time.perf_counter() - t_start:.1f} s"
    )
    slow = sorted(entries, key=lambda e: -e.seconds)[:3]
    print(
        "  slowest views: "
        + ", ".join(f"{e.key} {e.seconds:.1f} s" for e in slow)
        + "; stages: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    )
    for e in skipped:
        print(f"  skipped {e.key}: {e.note}")
    if static_note:
        print(f"  no PNG/SVG: {static_note}")
    elif export_problems:
        first = next(iter(export_problems.items()))
        print(f"  {len(export_problems)} export(s) failed, e.g. {first[0]}: {first[1]}")
    for e in failed:
        print(f"  FAILED {e.key}: {e.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
