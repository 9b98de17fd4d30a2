"""Headless report: every view of one run (or a comparison of two) in one offline HTML file, plus data files.

``write_report(paths, out, ...)`` is what ``k3lab report`` (k3lab/report.py) and the app's "Download all"
run. It writes into ``out``:

- ``report.html``: one self-contained page (plotly.js inline once, no network needed) with the run's
  config and model card, the input, the headline table, and every view of ``analysis.views.catalogue.all_views()``
  (views that do not apply are listed with the reason);
- ``figures/<view>.{csv,json}`` and, unless ``static`` is off or Chromium is missing, ``.png``/``.svg``;
  for two runs ``<view>__side.*`` (side by side, shared axes) and ``<view>__diff.*`` (A - B);
- ``headline.json``: the headline numbers of each run (and the delta A - B for two runs).

``picks`` ({"layer": 3, "head": 1}, ``k3lab report --layer/--head``) focuses every view that has a layer/head
picker (``View.picks``) on that layer / head; their files are named ``<view>_L3H1.*``; a view whose run lacks
that layer or head is listed as not applicable with the valid ones. Without picks nothing changes.

Bad input (unreadable checkpoint, missing text file, unknown sample, runs that cannot read the same text)
raises ``k3core.loading.tensor_info.CheckpointError``, ``ValueError`` or ``OSError`` before anything is written.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.compare.two_runs import (
    build_both,
    difference_view,
    distinct_labels,
    has_difference,
    quantised_copy,
    side_by_side,
)
from analysis.metrics.headline import compare_headlines, headline_numbers
from analysis.output.export import export_many, provenance, static_export_available
from analysis.output.report_html import Entry, render_html
from analysis.runs import loading as runs_mod
from analysis.runs import texts
from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view as view_mod
from analysis.views.catalogue import all_views
from analysis.views.view import NotApplicable, View
from k3core.utils.files import check_output_folder

REPORT_PAGE = "report.html"


def _labels(runs: list[runs_mod.Run]) -> list[str]:
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


def focused(view: View, ctx: AnalysisContext, picks: dict[str, int] | None) -> tuple[AnalysisContext, str]:
    """The context a view is drawn from under ``picks`` (only the axes the view picks) and its key's suffix
    ("_L3H1"; "" and ``ctx`` itself when the view has no picker or nothing is picked)."""
    pick = pk.pick_of(picks or {}, view.picks.axes) if view.picks is not None else {}
    if not pick:
        return ctx, ""
    return ctx.with_options(**pick), "_" + pk.pick_text(pick.get(view_mod.LAYER), pick.get(view_mod.HEAD))


def check_picks(views: list[View], picks: dict[str, int] | None) -> None:
    """ValueError when a layer/head is picked but no selected view has a picker for it (it would do nothing)."""
    for axis in pk.pick_of(picks or {}):
        if not any(v.picks is not None and axis in v.picks.axes for v in views):
            having = sorted(v.key for v in all_views() if v.picks is not None and axis in v.picks.axes)
            raise ValueError(f"--{axis}: none of the selected views has a {axis} picker; views that do: {having}")
        if picks[axis] < 0:
            raise ValueError(f"--{axis} must be 0 or more, got {picks[axis]}")


def build_single(
    views: list[View], ctx: AnalysisContext, progress: Any, picks: dict[str, int] | None = None
) -> list[Entry]:
    entries = []
    for view in views:
        vctx, tag = focused(view, ctx, picks)
        entry = Entry(view.key + tag, view.title, view.section, view.description)
        t0 = time.perf_counter()
        try:
            entry.figure, entry.table = view.build(vctx)
        except NotApplicable as exc:
            entry.note = str(exc) or "not applicable"
        except Exception as exc:  # noqa: BLE001 - one broken view must not lose the whole report
            entry.error = f"{type(exc).__name__}: {exc}"
        entry.seconds = time.perf_counter() - t0
        entries.append(entry)
        progress.update(1)
    return entries


def build_comparison(
    views: list[View], a: AnalysisContext, b: AnalysisContext, progress: Any, picks: dict[str, int] | None = None
) -> list[Entry]:
    """Per view, as the view declares (``View.compare``): side by side on shared axes (history views: one
    figure with run B overlaid) and, for views with a declared difference, A - B. One pick for both runs."""
    from analysis.views.view import NotApplicable

    entries = []
    base_a, base_b = a, b
    for view in views:
        t0 = time.perf_counter()
        (a, tag), (b, _) = focused(view, base_a, picks), focused(view, base_b, picks)
        name = view.key + tag
        key = name if view.compare.overlay else f"{name}__side"  # overlaid: one figure, not two halves
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
                f"{name}__diff",
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


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass


@dataclass
class ReportResult:
    """What ``write_report`` wrote: the entries (figures, notes, errors), the stage timings in seconds, why
    PNG/SVG were not written (None: they were, or were not asked for) and each export that failed."""

    out: Path
    entries: list[Entry]
    timings: dict[str, float]
    static_note: str | None = None
    export_problems: dict[str, str] = field(default_factory=dict)

    @property
    def shown(self) -> list[Entry]:
        return [e for e in self.entries if e.figure is not None]

    @property
    def failed(self) -> list[Entry]:
        return [e for e in self.entries if e.error]

    @property
    def skipped(self) -> list[Entry]:
        return [e for e in self.entries if e.note and e.figure is None]


def report_input(
    runs: list[runs_mod.Run],
    text_file: str | Path | None,
    sample: str | None,
    max_tokens: int,
    text_index: int | None = None,
) -> texts.Input:
    """The one input every run reads: ``text_file`` (UTF-8) or the built-in ``sample`` (default Shakespeare),
    read with the first run's tokenizer; for a trace folder, its recorded text ``text_index`` (default 0) when
    neither is given. Raises ValueError when the runs cannot read the same token ids, or for a text index the
    first run (a trace folder) has no text for."""
    cfg = runs[0].config
    if text_index is not None and (text_file or sample):
        raise ValueError("give a text index (a trace folder's recorded text), or a text file or sample: not both")
    if text_index is not None or (runs[0].recorded is not None and not text_file and not sample):
        chosen = runs_mod.recorded_input(runs[0], text_index or 0)  # a trace folder: a text it recorded
    elif text_file:
        text_path = Path(text_file)
        if not text_path.is_file():
            raise ValueError(f"{text_path}: no such text file")
        text = text_path.read_text(encoding="utf-8", errors="replace")
        chosen = texts.text_input(text, cfg, max_tokens, name=text_path.name, tokenizer=runs[0].tokenizer)
    else:
        chosen = texts.sample_input(sample or texts.DEFAULT_SAMPLE, cfg, max_tokens, tokenizer=runs[0].tokenizer)
    for run in runs[1:]:
        if run.config.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"the runs have different vocabularies ({cfg.vocab_size} vs "
                f"{run.config.vocab_size}); they cannot read the same input"
            )
        digests = {getattr(r.tokenizer, "digest", None) for r in (runs[0], run)}
        if chosen.name != "mqar" and len(digests) > 1:
            raise ValueError(
                f"the runs have different tokenizers ({runs[0].tokenizer!r} vs {run.tokenizer!r}); "
                "the same token ids would be different texts"
            )
    return chosen


def check_report_folder(out: str | Path) -> Path:
    """``out`` when a report may be written there (``check_output_folder``: an earlier report is replaced);
    OutputFolderError (a ValueError) otherwise."""
    return check_output_folder(out, (REPORT_PAGE,), "report")


def write_report(
    paths: list[str | Path],
    out: str | Path,
    text_file: str | Path | None = None,
    sample: str | None = None,
    max_tokens: int = texts.DEFAULT_MAX_TOKENS,
    device: str = "cpu",
    dtype: str | None = None,
    static: bool = True,
    max_memory: str | None = None,
    views: str | None = None,
    skip_model_views: bool = False,
    save_trace: bool = False,
    progress: Any = None,
    picks: dict[str, int] | None = None,
    text_index: int | None = None,
    window: int | None = None,
    options: dict[str, Any] | None = None,
) -> ReportResult:
    """Load one run (or two to compare) through ``analysis.runs.loading.load_run``, trace them on one input
    (``report_input``), build every selected view and write the report folder ``out`` (see the module docstring).

    ``text_index``: the first run is a trace folder and the report is of its recorded text of that number
    (``report_input``). ``views`` is a comma-separated list of view keys or sections (None: all); ``progress`` has
    ``update(n)`` (a tqdm bar; None: silent) and gets ``2 * len(paths) + len(views) + 3`` steps. ``window`` bounds the
    bulky per-token trace arrays (``analysis.runs.loading.trace_run``; long texts), ``options`` are view options (e.g.
    the long-context views' ``recall_distances`` and ``cost_lengths``). Raises CheckpointError,
    ValueError or OSError for bad input, before anything is written."""
    if not 1 <= len(paths) <= 2:
        raise ValueError("give one run, or two runs to compare")
    if max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    progress = progress or _NoProgress()
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    out = check_report_folder(out)
    selected = select_views(all_views(), views, skip_model_views)
    check_picks(selected, picks)
    runs = []
    for path in paths:
        runs.append(runs_mod.load_run(path, device=device, dtype=dtype, max_memory=max_memory))
        progress.update(1)
    timings["load"] = time.perf_counter() - t_start
    labels = _labels(runs)
    chosen = report_input(runs, text_file, sample, max_tokens, text_index)
    t0 = time.perf_counter()
    contexts = []
    for run, label in zip(runs, labels):
        contexts.append(runs_mod.trace_run(run, chosen, what="all", label=label, window=window, options=options))
        progress.update(1)
    timings["trace"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if len(contexts) == 2:
        entries = build_comparison(selected, contexts[0], contexts[1], progress, picks)
    else:
        entries = build_single(selected, contexts[0], progress, picks)
    headlines = [headline_numbers(c) for c in contexts]
    progress.update(1)
    timings["views"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    formats = ("csv", "json", "png", "svg") if static else ("csv", "json")
    static_note = None
    if static:
        ok, why = static_export_available()
        if not ok:
            formats, static_note = ("csv", "json"), why
    shown = [e for e in entries if e.figure is not None]
    made_on = provenance(*contexts)  # the run(s), text(s) and token count(s) in every CSV header and JSON
    meta = {e.key: {"view": e.key, "title": e.title, "section": e.section, "runs": labels, **made_on} for e in shown}
    results = export_many([(e.figure, e.table, e.key) for e in shown], out / "figures", formats, meta=meta)
    for e in shown:
        e.files = results.get(e.key, {})
    progress.update(1)
    timings["files"] = time.perf_counter() - t0

    headline_json = {
        "runs": headlines,
        "input": {
            "name": chosen.name,
            "description": chosen.description,
            "tokens": int(chosen.input_ids.shape[1]),
            "text_index": chosen.extra.get("recorded_index"),
        },
        "checkpoints": [
            # the folder's name, not its path: the report is shared, the machine's layout is not its business
            {
                "label": lab,
                "folder": Path(str(r.path)).name,
                "fingerprint": r.fingerprint,
                "device": r.device,
                "dtype": r.dtype,
            }
            for r, lab in zip(runs, labels)
        ],
    }
    comparison = None
    if len(headlines) == 2:
        # two checkpoints trained apart (not one run twice, nor a quantised copy) also differ by their seed
        separate = runs[0].fingerprint != runs[1].fingerprint and not quantised_copy(runs[0].path, runs[1].path)
        comparison = compare_headlines(*contexts, *headlines, separate_training=separate)
        table = comparison.table
        headline_json["delta_a_minus_b"] = dict(zip(table["metric"], table["delta"]))
        if comparison.noise is not None:
            noise = comparison.noise
            headline_json["loss_noise"] = {
                "delta_nats": noise.delta,
                "ci95_nats": noise.half_width,
                "n_windows": noise.n_windows,
                "window_tokens": noise.window,
                "paired": noise.paired,
                "within_noise": noise.within_noise,
                "separate_training": comparison.separate_training,
                "statement": comparison.statement,
            }
            headline_json["ci95_a_minus_b"] = {m: c for m, c in zip(table["metric"], table["ci95"]) if math.isfinite(c)}
    (out / "headline.json").write_text(json.dumps(_json_safe(headline_json), indent=1) + "\n")
    if save_trace:
        for ctx, tag in zip(contexts, "AB"):
            ctx.trace.save(out / f"trace_{tag}.npz")

    timings["total"] = time.perf_counter() - t_start
    page = render_html(entries, runs, labels, headlines, chosen, timings, comparison)
    (out / REPORT_PAGE).write_text(page, encoding="utf-8")
    progress.update(1)
    problems = {f"{e.key}.{fmt}": v for e in shown for fmt, v in e.files.items() if isinstance(v, str)}
    return ReportResult(out, entries, timings, static_note, problems)
