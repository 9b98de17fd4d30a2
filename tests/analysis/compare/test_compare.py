"""Compare right by construction (analysis.compare.two_runs): for EVERY view, two different runs side by side keep both
runs' numbers unchanged and every axis range covers both; declared differences equal A - B by hand."""

from __future__ import annotations

import base64
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from analysis import weights as wt
from analysis.compare import two_runs as cmp
from analysis.compare.shared_scales import AXIS_TOP
from analysis.figures import degradation as fig_dg
from analysis.figures import experiment as fx
from analysis.figures import weights_kda as wt_figs
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import run_from_model, trace_run
from analysis.views.catalogue import all_views, section_views
from analysis.views.view import Comparison, NotApplicable, View
from tests.conftest import nano_model

SAMPLES = Path(__file__).resolve().parents[3] / "sample_checkpoints"

IDS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
METRICS_A = {
    "history": [{"step": 0, "tokens": 0, "loss": 5.5, "moe": {"maxvio": [1.0, 2.0]}}, {"step": 10, "loss": 3.0}]
}
METRICS_B = {
    "history": [{"step": 0, "tokens": 0, "loss": 9.0, "moe": {"maxvio": [4.0, 0.5]}}, {"step": 30, "loss": 1.0}]
}


def with_expert_norms(ctx: AnalysisContext) -> AnalysisContext:
    """The run with its weight summary read as ``k3lab weights --experts`` reads it (every expert matrix), so
    the expert-norm view applies; the other weight views give the same numbers as from the model alone."""
    summary = wt.summarize_source(wt.StateDictSource(ctx.model), experts=True, label=ctx.label)
    return replace(ctx, weights=summary)


@pytest.fixture(scope="module")
def seeds() -> tuple[AnalysisContext, AnalysisContext]:
    """Two runs of one architecture (AttnRes), different weights, expert norms read."""
    a = trace_run(run_from_model(nano_model(0, kda_chunk_size=16), metrics=METRICS_A), IDS, label="seed0")
    b = trace_run(run_from_model(nano_model(1, kda_chunk_size=16), metrics=METRICS_B), IDS, label="seed1")
    return with_expert_norms(a), with_expert_norms(b)


@pytest.fixture(scope="module")
def scale_bias_seeds() -> tuple[AnalysisContext, AnalysisContext]:
    """Two scale-bias runs of one architecture, different weights: the seeds pair for the views of that
    residual mode (which apply to neither AttnRes seed)."""
    a = trace_run(
        run_from_model(nano_model(3, kda_chunk_size=16, residual="scale_bias"), metrics=METRICS_A), IDS, label="sb3"
    )
    b = trace_run(
        run_from_model(nano_model(4, kda_chunk_size=16, residual="scale_bias"), metrics=METRICS_B), IDS, label="sb4"
    )
    return with_expert_norms(a), with_expert_norms(b)


@pytest.fixture(scope="module")
def shapes() -> tuple[AnalysisContext, AnalysisContext]:
    """Two runs of different shapes: 4 vs 6 layers, AttnRes vs scale-bias residuals, one vs two MLA layers;
    expert norms read for A only (B's half is the placeholder)."""
    a = trace_run(run_from_model(nano_model(0, kda_chunk_size=16), metrics=METRICS_A), IDS, label="four")
    big = nano_model(2, kda_chunk_size=16, num_hidden_layers=6, full_attn_layers=[3, 6], residual="scale_bias")
    b = trace_run(run_from_model(big, metrics=METRICS_B), IDS, label="six")
    return with_expert_norms(a), b


# ----------------------------------------------------------------------------- independent checks of a figure
def _arr(value):
    """A trace attribute as numbers: plotly keeps unvalidated arrays in its base64 form {dtype, bdata, shape}."""
    if isinstance(value, dict) and "bdata" in value:
        out = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        return out.reshape([int(n) for n in value["shape"].split(",")]) if value.get("shape") else out
    return value


def _values(trace, letter: str) -> list:
    """What a trace puts on an axis, read straight from the trace: its coordinates (box names when a box has
    none, heatmap cell indices when a heatmap has none) and, for precomputed boxes, the fences."""
    coords = _arr(getattr(trace, letter, None))
    if coords is None and trace.type == "heatmap":
        coords = range(np.asarray(_arr(trace.z)).shape[1 if letter == "x" else 0])
    if coords is None and trace.type == "box" and letter == "x":
        coords = [trace.name]
    vals = [] if coords is None else list(np.asarray(coords, dtype=object).ravel())
    if trace.type == "box" and letter == "y":
        for attr in ("lowerfence", "upperfence"):
            if getattr(trace, attr) is not None:
                vals += list(np.asarray(_arr(getattr(trace, attr)), dtype=object))
    return vals


def _axis(fig, trace, letter: str):
    ref = getattr(trace, f"{letter}axis") or letter
    return fig.layout[f"{letter}axis{ref[1:]}"]


def assert_ranges_cover(fig, where: str) -> None:
    """Every axis carrying shown data has an explicit range containing every value on it, in plotly's units; with
    a dropdown (a layer selector), each button's ranges contain the traces that button shows."""
    for menu in fig.layout.updatemenus or []:
        for button in menu.buttons:
            state = go.Figure(fig)
            state.update_traces(visible=False)
            for tr, shown in zip(state.data, button.args[0]["visible"]):
                tr.visible = shown
            state.layout.updatemenus = []
            state.update_layout({k: v for k, v in button.args[1].items() if k.endswith(".range")})
            assert_ranges_cover(state, f"{where} [{button.label}]")
    for tr in fig.data:
        if tr.type in ("pie", "table") or tr.visible is False:
            continue
        for letter in ("x", "y"):
            vals = _values(tr, letter)
            if not vals:
                continue
            ax = _axis(fig, tr, letter)
            assert ax.range is not None, f"{where}: {letter}axis of {tr.name!r} has no explicit range"
            lo, hi = sorted(ax.range)
            if any(isinstance(v, str) for v in vals):
                cats = list(ax.categoryarray)
                for v in vals:
                    assert str(v) in cats, f"{where}: category {v!r} missing"
                    assert lo <= cats.index(str(v)) <= hi, f"{where}: category {v!r} outside {ax.range}"
                continue
            v = np.asarray([float(x) for x in vals if x is not None], dtype=np.float64)
            v = v[np.isfinite(v)]
            if ax.type == "log":
                v = np.log10(v[v > 0])
            if v.size:
                assert lo <= v.min() and v.max() <= hi, f"{where}: {letter} {v.min()}..{v.max()} outside {ax.range}"


def _same(x, y) -> bool:
    x, y = _arr(x), _arr(y)
    if x is None or y is None:
        return x is None and y is None
    x, y = np.asarray(x, dtype=object), np.asarray(y, dtype=object)
    if x.shape != y.shape:
        return False
    try:
        return bool(np.array_equal(x.astype(np.float64), y.astype(np.float64), equal_nan=True))
    except (TypeError, ValueError):
        return [str(v) for v in x.ravel()] == [str(v) for v in y.ravel()]


def assert_numbers_unchanged(single, combined, start: int, where: str) -> None:
    for i, tr in enumerate(single.data):
        out = combined.data[start + i]
        assert out.type == tr.type, where
        for attr in ("x", "y", "z", "q1", "median", "q3", "lowerfence", "upperfence"):
            if attr == "y" and tr.meta == AXIS_TOP:  # markers at the top of the shared axis: a place, not a value
                continue
            if hasattr(tr, attr):
                assert _same(getattr(tr, attr), getattr(out, attr)), f"{where}: trace {i} {attr} changed"


def assert_one_colour_scale(fig, n_a: int, where: str) -> None:
    for ta, tb in zip(fig.data[:n_a], fig.data[n_a:]):
        if ta.type == "heatmap" and tb.type == "heatmap":
            assert (ta.zmin, ta.zmax) == (tb.zmin, tb.zmax), where
            assert ta.showscale is False and tb.showscale is not False, f"{where}: two colour bars"
            for t in (ta, tb):
                z = np.asarray(_arr(t.z), dtype=np.float64)
                z = z[np.isfinite(z)]
                assert z.size == 0 or (t.zmin <= z.min() and z.max() <= t.zmax), where


VIEWS = [v for v in all_views() if not v.compare.overlay]
# an experiment view needs its inputs in the options (the Experiment page sets them; without them: NotApplicable)
EXPERIMENT_INPUTS = {
    "experiment_loss_change": {"edits": [{"kind": "value", "point": "mixer_out", "op": "scale", "value": 0.5}]},
    "experiment_patching": {"patching": fx.patching_spec(2, 32, {"kind": "span_loss", "start": 3, "stop": 8})},
    "experiment_attribution": {"attribution": fx.attribution_spec(4, [1, 2])},
    "experiment_layer_attribution": {"attribution": fx.attribution_spec(4, [1, 2], steps=4)},
}


def _with_experiment_inputs(view, a, b):
    options = EXPERIMENT_INPUTS.get(view.key, {})
    return a.with_options(**options), b.with_options(**options)


@pytest.mark.parametrize("pair_name", ["seeds", "shapes"])
@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.key)
def test_every_view_side_by_side_keeps_both_runs_numbers_and_covers_them(view, pair_name, request):
    a, b = _with_experiment_inputs(view, *request.getfixturevalue(pair_name))
    built = cmp.build_both(view, a, b)
    if pair_name == "seeds" and all(isinstance(r, NotApplicable) for r in built):
        a, b = _with_experiment_inputs(view, *request.getfixturevalue("scale_bias_seeds"))  # the other residual mode
        built = cmp.build_both(view, a, b)
    assert not all(isinstance(r, NotApplicable) for r in built), f"{view.key} applies to neither run of {pair_name}"
    fig, table = cmp.side_by_side(view, a, b, built=built)
    where = f"{view.key}/{pair_name}"
    n_a = len(built[0][0].data) if not isinstance(built[0], NotApplicable) else 0  # a placeholder has none
    if not isinstance(built[0], NotApplicable):
        assert_numbers_unchanged(built[0][0], fig, 0, where + " A")
    if not isinstance(built[1], NotApplicable):
        assert_numbers_unchanged(built[1][0], fig, n_a, where + " B")
    assert_ranges_cover(fig, where)
    assert_one_colour_scale(fig, n_a, where)
    applies = [ctx.label for r, ctx in zip(built, (a, b)) if not isinstance(r, NotApplicable)]
    assert set(table["run"]) == set(applies)
    labels = [ann for ann in fig.layout.annotations if ann.name == "run label"]
    assert [ann.text.split("<br>")[0] for ann in labels] == [f"<b>{a.label}</b>", f"<b>{b.label}</b>"]
    # the labels sit above the plot area and above any subplot title of the top row
    assert all(ann.y == 1.0 and ann.yanchor == "bottom" and ann.yshift > 0 for ann in labels)
    titles = [ann for ann in fig.layout.annotations if ann.name != "run label" and ann.yanchor == "bottom"]
    assert all(lab.yshift >= 8 + 22 for lab in labels) or not any(t.y >= 0.99 for t in titles)
    fig.to_json()


def test_history_views_overlay_run_b_in_one_figure(seeds):
    a, b = seeds
    view = next(v for v in all_views() if v.key == "history_curves")
    fig, df = cmp.side_by_side(view, a, b)
    assert set(df["run"]) == {"seed0", "seed1"}
    b_loss = df[(df["run"] == "seed1") & (df["curve"] == "train loss")]["value"].tolist()
    assert b_loss == [9.0, 1.0]
    with pytest.raises(NotApplicable, match="overlaid"):
        cmp.difference_view(view, a, b)


# ----------------------------------------------------------------------------- differences
DIFF_VIEWS = [v for v in all_views() if cmp.has_difference(v)]


@pytest.mark.parametrize("view", DIFF_VIEWS, ids=lambda v: v.key)
def test_declared_difference_is_a_minus_b(view, seeds, scale_bias_seeds):
    a, b = _with_experiment_inputs(view, *seeds)
    if all(isinstance(r, NotApplicable) for r in cmp.build_both(view, a, b)):
        a, b = _with_experiment_inputs(view, *scale_bias_seeds)  # a view of the other residual mode
    spec = view.compare
    value = spec.difference[0]
    try:
        fig, diff = cmp.difference_view(view, a, b)
    except NotApplicable as exc:
        if "zero everywhere" in str(exc):  # e.g. allocation from one config: A and B agree in every row
            ta, tb = view.build(a)[1], view.build(b)[1]
            pd.testing.assert_frame_equal(ta[list(spec.difference)], tb[list(spec.difference)])
            return
        assert view.compare.same_weights and "one checkpoint" in str(exc), f"{view.key}: {exc}"
        with pytest.raises(NotApplicable, match="zero everywhere"):  # one run against itself: nothing to show
            cmp.difference_view(view, a, a.with_options(label="again"))
        return  # A - B of one checkpoint on two texts: test_expert_rows_differ_only_for_one_checkpoint_on_two_texts
    # heads of two checkpoints are different learned units: their difference is taken over the mean over heads
    units = [k for k in ("head", "expert") if b is not a and not spec.same_weights]
    reduce = list(spec.reduce) + units
    keys = [k for k in (spec.keys or view.build(a)[1].attrs["keys"]) if k not in reduce]
    ta, tb = view.build(a)[1], view.build(b)[1]
    if reduce:  # by hand: mean over the reduced keys
        ta, tb = (t.groupby(keys, sort=False)[value].mean().reset_index() for t in (ta, tb))
    expected = ta.set_index(keys)[value].astype(float) - tb.set_index(keys)[value].astype(float)
    got = diff.set_index(keys)[f"{value}_diff"]
    np.testing.assert_allclose(got.loc[expected.index].to_numpy(), expected.to_numpy(), rtol=1e-12, equal_nan=True)
    assert set(diff.attrs["values"]) == set(spec.difference)
    # only the declared columns: never a constant like width_multiplier or n_layers
    assert not any(c.endswith("_diff") and c[:-5] not in spec.difference for c in diff.columns)
    assert len(fig.data) >= 1
    height = fig.layout.height or 0
    assert height <= 900, f"{view.key}: difference figure {height} px tall"


def test_views_without_a_declared_difference_say_why(seeds):
    a, b = seeds
    for view in all_views():
        if not cmp.has_difference(view):
            with pytest.raises(NotApplicable) as info:
                cmp.difference_view(view, a, b)
            assert str(info.value) == view.compare.no_difference


def test_kda_state_norm_difference_is_one_row_per_layer_not_a_staircase(seeds):
    a, b = seeds
    view = next(v for v in all_views() if v.key == "kda_state_norm")
    fig, diff = cmp.difference_view(view, a, b)
    kda_layers = a.config.layer_types().count("KDA")
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap"
    assert np.asarray(fig.data[0].z).shape[0] == kda_layers


def test_hidden_rms_difference_is_bars_over_depth_not_a_diagonal(seeds):
    a, b = seeds
    view = next(v for v in all_views() if v.key == "attnres_hidden_rms")
    fig, diff = cmp.difference_view(view, a, b)
    assert {t.type for t in fig.data} == {"bar"}
    ta, tb = view.build(a)[1], view.build(b)[1]
    np.testing.assert_allclose(fig.data[0].y, ta["mean"].to_numpy() - tb["mean"].to_numpy())
    assert list(fig.data[0].x) == list(ta["label"])


def test_expert_rows_differ_only_for_one_checkpoint_on_two_texts(seeds):
    a, b = seeds
    view = next(v for v in all_views() if v.key == "moe_load_heatmap")
    with pytest.raises(NotApplicable, match="one checkpoint"):
        cmp.difference_view(view, a, b)
    other_text = trace_run(run_from_model(a.model), IDS.flip(-1), label="reversed text")
    fig, diff = cmp.difference_view(view, a, other_text)
    share_a = view.build(a)[1].set_index(["layer", "expert"])["share"]
    share_b = view.build(other_text)[1].set_index(["layer", "expert"])["share"]
    got = diff.set_index(["layer", "expert"])["share_diff"]
    np.testing.assert_allclose(got.loc[share_a.index], (share_a - share_b).to_numpy())


def test_weights_views_on_two_texts_of_one_run_say_it_is_one_checkpoint(seeds):
    """Compare "one run, two texts" on the Weights section: the same weights, not "different learned units"."""
    a, b = seeds
    other_text = trace_run(run_from_model(a.model), IDS.flip(-1), label="reversed text")
    view = next(v for v in all_views() if v.section == "weights" and not cmp.has_difference(v))
    with pytest.raises(NotApplicable, match="one checkpoint's weights, which do not depend on the text"):
        cmp.difference_view(view, a, other_text)
    with pytest.raises(NotApplicable, match="different learned units"):
        cmp.difference_view(view, a, b)


# ----------------------------------------------------------------------------- labels, placeholders
def test_distinct_labels():
    assert cmp.distinct_labels("MQAR", "Shakespeare") == ("MQAR", "Shakespeare")
    assert cmp.distinct_labels("k3", "k3") == ("k3 (A)", "k3 (B)")


def test_a_run_without_the_view_gets_a_wrapped_note_inside_its_half(seeds):
    a, _ = seeds
    reason = "the trace was recorded without 'attnres' and this sentence is long enough to need wrapping twice"

    def build(ctx):
        if ctx.label == "B":
            raise NotApplicable(reason)
        return fig_dg.build_kda_state_rank(ctx)

    view = View("test", "test view", "degradation", build, compare=Comparison())
    b = AnalysisContext(trace=a.trace, config=a.config, label="B")
    fig, df = cmp.side_by_side(view, a, b)
    assert set(df["run"]) == {"seed0"}
    note = next(ann for ann in fig.layout.annotations if "not applicable" in (ann.text or ""))
    assert note.x > 0.55 and all(len(line) <= 60 for line in note.text.split("<br>"))
    with pytest.raises(NotApplicable):
        cmp.side_by_side(View("none", "none", "x", lambda c: (_ for _ in ()).throw(NotApplicable("no"))), a, b)


def test_side_by_side_titles_name_runs_once(seeds):
    a, b = seeds
    view = next(v for v in all_views() if v.key == "moe_imbalance")
    fig, _ = cmp.side_by_side(view, a, b)
    labels = [ann.text for ann in fig.layout.annotations if ann.name == "run label"]
    # each run named once, in bold; "— seed0" of each single title is not repeated. The subtitles under the names are
    # each run's own title where the two differ (issue 39: the title counts the layers within the sampling floor)
    assert [label.split("<br>")[0] for label in labels] == ["<b>seed0</b>", "<b>seed1</b>"]
    assert not any("seed" in line for label in labels for line in label.split("<br>")[1:]), labels
    assert fig.layout.title.text == "Expert load imbalance: seed0 vs seed1"


@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="needs Chromium for plotly.js")
def test_plotly_draws_the_allocation_bars_inside_their_axes(seeds):
    """The Compare bug: plotly.js autoranged matched bar axes to -1..4 while the bars were ~10^4. With
    explicit ranges the rendered (full) figure's parameter axes cover the bars; log axes in log10."""
    a, b = seeds
    view = next(v for v in all_views() if v.key == "density_allocation")
    fig, table = cmp.side_by_side(view, a, b)
    full = fig.full_figure_for_development(warn=False)
    params = table[table["part"].str.startswith("L")]["active_params"]  # the top panel: active per token
    lo, hi = full.layout.yaxis.range
    assert lo <= 0 and hi >= params.max()
    flops = table[table["part"].str.startswith("L")]["flops"]
    lo, hi = full.layout.yaxis2.range
    assert lo <= math.log10(flops.min()) and hi >= math.log10(flops.max())
    assert tuple(full.layout.yaxis4.range) == tuple(full.layout.yaxis.range)


def test_a_placeholder_half_adds_no_title_under_the_other_label(seeds, scale_bias_seeds):
    a, _ = seeds
    sb, _ = scale_bias_seeds
    view = next(v for v in all_views() if v.key == "attnres_scale_bias")
    fig, _ = cmp.side_by_side(view, a, sb)
    labels = [ann.text for ann in fig.layout.annotations if ann.name == "run label"]
    assert labels == ["<b>seed0</b>", "<b>sb3</b>"]


def test_weights_only_contexts_compare_and_keep_the_mla_band_and_one_legend_entry():
    """The Weights page's "Compare with": two checkpoints read without a trace compare view by view (the issue's
    AttributeError on ``trace.meta``), the half-life axis reaches the last MLA band (k3-full's layer 7) and the
    band's legend entry is listed once, not once per half."""
    summaries = [wt.read_weight_summary(SAMPLES / name) for name in ("k3-full", "plain-moe")]
    a, b = (AnalysisContext(trace=None, config=s.config, label=s.label, weights=s) for s in summaries)
    assert not cmp.same_weights(a, b) and cmp.same_weights(a, replace(a, label="again"))
    for view in section_views("weights"):
        for compare in (cmp.side_by_side, cmp.difference_view):
            try:
                compare(view, a, b)
            except NotApplicable as exc:
                assert "Error" not in str(exc), f"{view.key}: {exc}"
    view = next(v for v in section_views("weights") if v.key == "weights_kda_half_life")
    fig, _ = cmp.side_by_side(view, a, b)
    last_mla = max(summaries[0].structure.query("mixer == 'mla'")["layer"])
    assert fig.layout.xaxis.range[1] >= last_mla + 0.4 and fig.layout.xaxis2.range == fig.layout.xaxis.range
    assert [s.name for s in fig.layout.shapes if s.showlegend] == [wt_figs.MLA_UNBOUNDED]
