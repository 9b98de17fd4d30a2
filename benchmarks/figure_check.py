"""A figure check in a real browser: every view of every page drawn by plotly.js in Chromium, and its drawn SVG
read back for what a reader would not trust.

    .venv/bin/python -m benchmarks.figure_check                 # the four samples, two Compare pairs
    .venv/bin/python -m benchmarks.figure_check --shots docs/screenshots

``figure_problems(page, specs)`` draws plotly figure specs (``fig.to_plotly_json()``) one at a time in a local
HTML page (plotly.js from the plotly package: offline) and returns, per figure, what is wrong:

- two text boxes overlap: the title, subplot titles, annotations, axis titles, legend entries, colour bar titles
  and tick labels of different axes (bounding boxes of the drawn SVG text);
- a bar, marker or line vertex outside its axis range (the drawn position in pixels against the axis length;
  stacked bars by their stacked ends);
- a legend that scrolls or is cut by the figure's edge;
- a series (trace name) whose colour differs between the two panels of a pair, or a line/marker series whose
  colour has no legend entry in a figure with a legend;
- a panel (x/y subplot) with no data and no note inside it;
- a note (an annotation inside a plot area) over drawn data (points, bars, heatmap cells);
- a colour bar with fewer than four labelled ticks.

Dropdowns (a layer selector) are walked: every button is applied and the figure checked again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = ("k3-full", "plain-moe", "plain-residual", "scale-bias")
PAIRS = (("k3-full", "plain-residual"), ("plain-moe", "scale-bias"))
WIDTH = 900  # px: the app's main column on a 1280-px window (analysis.figures.style.FIGURE_WIDTH)


@dataclass
class Drawn:
    """One figure to check: where it is shown (page, view) and its plotly spec."""

    where: str
    spec: dict


def plotly_js() -> str:
    """plotly.js as the plotly package ships it (the version plotly.py writes figures for)."""
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


CHECK_JS = Path(__file__).with_suffix(".js").read_text(encoding="utf-8").replace("WIDTH_PX", str(WIDTH))
# Every shown chart of an app page: its Streamlit key ("fig-<view>") and its problems (a chart in a closed
# expander, e.g. a difference A - B, is not on screen: the offline pass checks those figures).
APP_CHECK_JS = """async () => {
  const out = [];
  for (const gd of document.querySelectorAll('[data-testid="stPlotlyChart"] .js-plotly-plot')) {
    const box = gd.getBoundingClientRect();
    if (!gd.offsetParent || box.width < 10 || box.height < 10 || gd.closest('details:not([open])')) continue;
    let key = null;
    for (let el = gd; el && !key; el = el.parentElement) {
      const c = Array.from(el.classList || []).find(c => c.startsWith('st-key-'));
      if (c) key = c.slice('st-key-'.length);
    }
    out.push([key, await window.k3labCheckFigure(gd)]);
  }
  return out;
}"""


def page_html() -> str:
    """A page with plotly.js inline and one empty figure div."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><script>"
        + plotly_js()
        + "</script></head><body style='margin:0;background:white'><div id='fig'></div></body></html>"
    )


def open_check_page(browser):
    """A fresh page with plotly.js and the check loaded, ready for ``figure_problems``."""
    page = browser.new_page(viewport={"width": WIDTH + 40, "height": 900})
    page.set_content(page_html())
    page.wait_for_function("() => window.Plotly !== undefined")
    page.add_script_tag(content=CHECK_JS)
    return page


def figure_problems(page, spec: dict, shot: Path | None = None) -> list[str]:
    """What is wrong with one figure spec drawn in ``page`` (see the module doc); a screenshot when asked."""
    problems = page.evaluate("spec => window.k3labDrawAndCheck(spec)", json.loads(json.dumps(spec, default=_plain)))
    if shot is not None:
        page.locator("#fig").screenshot(path=str(shot))
    return problems


def app_page_problems(page) -> dict[str, list[str]]:
    """The problems of every chart drawn on an open app page, by the chart's key (the check is loaded first)."""
    page.add_script_tag(content=CHECK_JS)
    return {key: problems for key, problems in page.evaluate(APP_CHECK_JS)}


def _plain(value):
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value)}")


# ----------------------------------------------------------------------------- every view of every page
def sample_contexts(names=SAMPLES, tokens: int = 64) -> dict:
    """Each shipped sample loaded and traced on MQAR, as the app's Compare link ``text=mqar&tokens=64`` does (the
    long-context measurements that rerun the model at a few short distances and lengths)."""
    from analysis.runs import loading as runs_mod
    from analysis.runs import texts

    out = {}
    options = {"recall_distances": (16, 64), "recall_examples": 8, "cost_lengths": (64, 256)}
    for name in names:
        run = runs_mod.load_run(REPO / "sample_checkpoints" / name)
        sample = texts.sample_input("mqar", run.config, tokens, tokenizer=run.tokenizer)
        out[name] = runs_mod.trace_run(run, sample, what="all", label=name, options=options)
    return out


def all_figures(contexts: dict, pairs=PAIRS) -> list[Drawn]:
    """Every view of every sample (single-run pages) and, for each pair, every side-by-side and difference view,
    as the app draws them (``screen_figure``). Each view is built once per sample; the comparisons reuse it."""
    from analysis.compare.two_runs import difference_view, has_difference, side_by_side
    from analysis.figures.style import screen_figure
    from analysis.views.catalogue import all_views
    from analysis.views.view import NotApplicable

    views = all_views()
    out: list[Drawn] = []
    built: dict[tuple[str, str], object] = {}
    for name, ctx in contexts.items():
        for view in views:
            try:
                built[name, view.key] = fig, _ = view.build(ctx)
            except NotApplicable as exc:
                built[name, view.key] = exc
                continue
            out.append(Drawn(f"{name}/{view.section}/{view.key}", screen_figure(fig).to_plotly_json()))
    for a_name, b_name in pairs:
        a, b = contexts[a_name], contexts[b_name]
        where = f"compare {a_name} vs {b_name}"
        for view in views:
            both = None if view.compare.overlay else [built[a_name, view.key], built[b_name, view.key]]
            try:
                fig, _ = side_by_side(view, a, b, built=both)
            except NotApplicable:
                continue
            out.append(Drawn(f"{where}/{view.section}/{view.key}", screen_figure(fig).to_plotly_json()))
            if has_difference(view):
                try:
                    fig, _ = difference_view(view, a, b, built=both)
                except NotApplicable:
                    continue
                out.append(Drawn(f"{where}/{view.section}/{view.key} A-B", screen_figure(fig).to_plotly_json()))
    return out


def experiment_specs(ctx) -> dict[str, dict]:
    """The Experiment page's defaults for one sample, as view options (``analysis.figures.experiment``): a ban of
    experts 0-1 in the last MoE layer, patching (every site; per position over two sites in a window), token
    attribution (feature ablation; IG frozen, 4 steps) and layer attribution, both lenses."""
    from analysis.figures import experiment as fx
    from k3core.interp.edit_kinds import MoEEdit

    cfg, T = ctx.config, int(ctx.input_ids.shape[1])
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    edits = [MoEEdit("ban", layer=moe[-1], experts=[0, 1]).to_dict()] if moe else []
    metric = {"kind": "span_loss", "start": 3, "stop": T}
    target = [int(t) for t in ctx.input_ids[0, 8:10]]
    specs = {
        "patching": {"patching": fx.patching_spec(2, 32, metric)},
        "patching per position": {
            "patching": fx.patching_spec(2, 32, metric, ["resid", "mixer_out"], True, [0, 8]),
        },
        "attribution": {"attribution": fx.attribution_spec(8, target)},
        "attribution ig_frozen_routing": {"attribution": fx.attribution_spec(8, target, "ig_frozen_routing", steps=4)},
        "layer attribution": {"attribution": fx.attribution_spec(8, target, steps=4)},
    }
    if edits:
        specs["loss change"] = {"edits": edits}
    for which, chosen in (("baseline", []), ("edited", edits)):
        for value in ("next_rank", "kl_to_final"):
            specs[f"lens {which} {value}"] = {"edits": chosen, "lens_value": value}
    return specs


EXPERIMENT_VIEW_OF = {
    "loss change": "experiment_loss_change",
    "patching": "experiment_patching",
    "patching per position": "experiment_patching",
    "attribution": "experiment_attribution",
    "attribution ig_frozen_routing": "experiment_attribution",
    "layer attribution": "experiment_layer_attribution",
}


def experiment_figures(contexts: dict) -> list[Drawn]:
    """The Experiment page's figures of every sample at the page's defaults (``experiment_specs``), built by its
    Views as the page draws them, and a token's MLA attention (drawn on the page's Token section, not a View)."""
    from analysis.experiments.effects import forward_logits
    from analysis.figures import experiment as fx
    from analysis.figures.style import screen_figure
    from analysis.metrics.token_detail import token_detail

    views = {view.key: view for view in fx.VIEWS}
    out: list[Drawn] = []
    for name, ctx in contexts.items():
        figs: dict[str, object] = {}
        for what, options in experiment_specs(ctx).items():
            view = views[EXPERIMENT_VIEW_OF.get(what, "experiment_lens")]
            figs[what], _ = view.build(ctx.with_options(**options))
        if ctx.trace.layer_indices("mla"):
            detail = token_detail(ctx.trace, forward_logits(ctx.model, ctx.input_ids[:1]), 40, top_k=5)
            rows = detail.mla[(detail.mla.layer == detail.mla.layer.min()) & (detail.mla.head == 0)]
            figs["MLA attention"] = fx.mla_attention_figure(rows, 40, "first MLA layer, head 0")
        out += [Drawn(f"{name}/experiment/{k}", screen_figure(f).to_plotly_json()) for k, f in figs.items()]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shots", help="folder for a PNG of every figure")
    parser.add_argument("--only", help="check only figures whose place contains this text")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from benchmarks.bench_app import CHROMIUM, CHROMIUM_ARGS

    t0 = time.perf_counter()
    drawn = all_figures(sample_contexts())
    if args.only:
        drawn = [d for d in drawn if args.only in d.where]
    t1 = time.perf_counter()
    bad = 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = open_check_page(browser)
        for d in drawn:
            shot = None
            if args.shots:
                Path(args.shots).mkdir(parents=True, exist_ok=True)
                shot = Path(args.shots) / (d.where.replace("/", "__").replace(" ", "_") + ".png")
            problems = figure_problems(page, d.spec, shot)
            if problems:
                bad += 1
                print(d.where)
                for p in dict.fromkeys(problems):
                    print("   ", p)
        browser.close()
    t2 = time.perf_counter()
    print(f"{len(drawn)} figures ({t1 - t0:.1f} s to build), {bad} with problems ({t2 - t1:.1f} s in Chromium)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
