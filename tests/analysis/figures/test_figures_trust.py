"""The figure numbers behind "a figure a researcher trusts at a glance" (issue 16), one test per finding, on the
shipped samples: shared ranges that hold stacked bars and place "unbounded" markers once, one colour per series in
both panels, a layer dropdown with its own ranges and subtitles, notes inside their half, colour scales and axes
from the values present, readable and meaningful differences, one parameter-count rule, headline help from the
docs. The drawn result is checked in Chromium by tests/app/test_browser_figures.py."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import weights as wt
from analysis.compare.two_runs import difference_view, side_by_side
from analysis.figures.style import colour_ticks
from analysis.metrics.headline import HEADLINE_LABELS, headline_help
from analysis.runs.context import AnalysisContext
from analysis.views.catalogue import all_views
from analysis.views.view import NotApplicable
from benchmarks.figure_check import REPO, sample_contexts

VIEWS = {v.key: v for v in all_views()}
SAMPLE_DIR = REPO / "sample_checkpoints"


@pytest.fixture(scope="module")
def runs() -> dict[str, AnalysisContext]:
    return sample_contexts(("k3-full", "plain-residual", "plain-moe", "scale-bias"))


def _weights(name: str) -> AnalysisContext:
    summary = wt.read_weight_summary(str(SAMPLE_DIR / name))
    return AnalysisContext(trace=None, config=summary.config, label=name, weights=summary)


def _halves(fig, letter: str = "y") -> list[str]:
    return sorted(k for k in fig.layout.to_plotly_json() if k.startswith(f"{letter}axis"))


def test_stacked_bars_fit_the_shared_axis():
    a, b = _weights("k3-full"), _weights("plain-residual")
    fig, table = side_by_side(VIEWS["weights_params"], a, b)
    stacked = table.groupby(["run", "layer"])["params"].sum().max()
    for name in _halves(fig):
        lo, hi = fig.layout[name].range
        assert hi >= stacked, f"{name}: axis to {hi:,.0f}, a stack reaches {stacked:,.0f}"  # was 1.05 x one segment


def test_unbounded_memory_is_a_band_per_mla_layer_not_a_mark_on_the_half_life_axis():
    from analysis.figures.weights_kda import MLA_UNBOUNDED

    for name in ("k3-full", "plain-moe"):
        ctx = _weights(name)
        fig, _ = VIEWS["weights_kda_half_life"].build(ctx)
        mla = ctx.weights.structure.loc[ctx.weights.structure["mixer"] == "mla", "layer"].to_list()
        assert mla, name
        # no trace stands at an MLA layer: a mark there would read as a half-life (it sat at ~700 tokens)
        assert not any(set(mla) & {float(x) for x in np.asarray(t.x).ravel()} for t in fig.data), name
        bands = [sh for sh in fig.layout.shapes if sh.name == MLA_UNBOUNDED]
        assert sorted((sh.x0 + sh.x1) / 2 for sh in bands) == sorted(mla), name
        assert all(sh.yref == "paper" and (sh.y0, sh.y1) == (0, 1) for sh in bands)  # the whole height, no y value
        assert [sh.showlegend for sh in bands].count(True) == 1  # one legend entry
    fig, _ = side_by_side(VIEWS["weights_kda_half_life"], _weights("k3-full"), _weights("plain-moe"))
    assert {sh.xref for sh in fig.layout.shapes if sh.name == MLA_UNBOUNDED} == {"x", "x2"}  # a band in each half


def test_the_layer_axis_ends_at_the_last_layer(runs):
    fig, _ = side_by_side(VIEWS["density_allocation"], runs["k3-full"], runs["plain-moe"])
    layers = max(ctx.config.num_hidden_layers for ctx in (runs["k3-full"], runs["plain-moe"]))
    for name in _halves(fig, "x"):
        assert fig.layout[name].range[1] <= layers - 0.5, (name, fig.layout[name].range)  # was 9.0: empty slots


def test_a_series_keeps_its_colour_in_both_panels(runs):
    fig, _ = side_by_side(VIEWS["degradation_massive"], runs["k3-full"], runs["plain-residual"])
    colours: dict[str, set] = {}
    for t in fig.data:
        if t.name and t.type == "scatter":
            colours.setdefault(t.name, set()).add(t.line.color or t.marker.color)
    assert colours and all(len(c) == 1 for c in colours.values()), colours


def test_layer_dropdown_sets_each_layers_ranges_and_both_subtitles(runs):
    fig, _ = side_by_side(VIEWS["moe_latent_pca"], runs["k3-full"], runs["plain-moe"])
    (menu,) = fig.layout.updatemenus
    ranges = set()
    for button in menu.buttons:
        layer = button.label.split()[-1]
        changes = button.args[1]
        labels = [v for k, v in changes.items() if k.startswith("annotations[")]
        assert len(labels) == 2 and all(f"layer {layer}:" in text for text in labels), labels
        assert "title.text" not in changes  # the figure's title names both runs and stays
        ranges.add(tuple(changes["xaxis.range"]))
    # one range per layer, not one over every layer (which would make them all equal); two layers whose extreme
    # points coincide may share one
    assert len(menu.buttons) > 2 and len(ranges) >= len(menu.buttons) - 1
    # against a run without the view (no MoE): the dropdown is still there, for A's layers
    fig, _ = side_by_side(VIEWS["moe_latent_pca"], runs["k3-full"], runs["plain-residual"])
    assert fig.layout.updatemenus and len(fig.layout.updatemenus[0].buttons) > 1
    # clear of the run labels: in the title row, above where the labels start
    assert fig.layout.updatemenus[0].y > 1.0


def test_the_note_of_a_run_without_the_view_stays_in_its_half_and_is_said_once(runs):
    fig, _ = side_by_side(VIEWS["attnres_site_stats"], runs["plain-moe"], runs["scale-bias"])
    (note,) = [a for a in fig.layout.annotations if a.text.startswith("not applicable")]
    assert note.xanchor == "center" and 0.55 <= note.x <= 1.0  # B's half: it was right-anchored over A's data
    with pytest.raises(NotApplicable) as info:
        side_by_side(VIEWS["attnres_site_stats"], runs["plain-residual"], runs["scale-bias"])
    assert VIEWS["attnres_site_stats"].title not in str(info.value)  # the page prefixes the title once


def test_colour_bars_have_four_labelled_ticks_over_their_range(runs):
    assert colour_ticks(0.96, 0.99)["tickvals"] == [0.96, 0.97, 0.98, 0.99]
    seen = 0
    for view in all_views():
        try:
            fig, _ = view.build(runs["k3-full"])
        except NotApplicable:
            continue
        for t in fig.data:
            if t.type == "heatmap" and t.showscale is not False:
                z = np.asarray(t.z, dtype=np.float64)
                lo = t.zmin if t.zmin is not None and t.zmax is not None else np.nanmin(z)
                hi = t.zmax if t.zmin is not None and t.zmax is not None else np.nanmax(z)
                ticks = [v for v in (t.colorbar.tickvals or []) if lo <= v <= hi]
                assert len(ticks) >= 4, f"{view.key}: ticks {t.colorbar.tickvals} on {lo}..{hi}"
                seen += 1
    assert seen >= 5


def test_scales_follow_the_values_present(runs):
    ctx = runs["k3-full"]
    fig, df = VIEWS["degradation_entropy"].build(ctx)
    assert (fig.data[0].zmin, fig.data[0].zmax) != (0.0, 1.0)  # every value 0.96-0.99 drew one colour
    fig, df = VIEWS["degradation_sink"].build(ctx)
    top = max(float(df["first_token_mass"].max()), 0.3)
    assert fig.layout.yaxis.range[1] <= max(1.15 * top, top + 1e-9) + 1e-9
    fig, _ = VIEWS["degradation_entropy_position"].build(ctx)
    assert fig.layout.yaxis.range is None  # from the data, not a fixed 0..1.05
    fig, _ = VIEWS["moe_load_heatmap"].build(ctx)
    assert fig.data[0].colorbar.tickformat == ".1%"  # shares printed as the hover prints them


def test_many_lines_get_one_legend_entry_per_layer(runs):
    for key in ("kda_state_norm",):  # the one state-norm view (issue 15 merged the two)
        fig, table = VIEWS[key].build(runs["k3-full"])
        entries = [t.name for t in fig.data if t.showlegend is not False]
        assert entries == [f"L{layer}" for layer in sorted(table["layer"].unique())], (key, entries)


def test_history_panels_in_a_grid_and_every_run_in_the_legend(runs):
    a, b = runs["plain-moe"], runs["scale-bias"]
    fig, table = side_by_side(VIEWS["history_attnres"], a, b)
    n = table["metric"].nunique()
    cols = {fig.layout[k].domain[0] for k in _halves(fig, "x")}
    assert len(cols) <= 3 < n or n <= 3  # at most three panels a row
    legend = {t.name for t in fig.data if t.showlegend is not False}
    assert {t.name for t in fig.data} <= legend  # the scale-bias run had no entry (its metrics start later)


def test_differences_are_readable_and_never_all_zero(runs):
    a, b = runs["k3-full"], runs["plain-residual"]
    fig, diff = difference_view(VIEWS["degradation_rank_collapse"], a, b)
    titles = [fig.layout.title.text] + [fig.layout[k].title.text or "" for k in _halves(fig, "x")]
    titles += [a.text for a in fig.layout.annotations]
    assert not any("_" in t for t in titles), titles  # was `depth_label`, "layer_type KDA"
    fig, diff = difference_view(VIEWS["density_allocation"], a, runs["plain-moe"])
    assert {"embedding", "output"} <= set(fig.data[0].x)  # not layers -1 and 8
    with pytest.raises(NotApplicable, match="zero everywhere"):  # one config on two texts
        difference_view(VIEWS["density_cache_vs_length"], a, a.with_options(label="again"))
    # heads are learned units: between two checkpoints their mean is compared, on every page alike
    fig, diff = difference_view(VIEWS["degradation_entropy"], a, b)
    assert "head" not in diff.attrs["keys"] and "mean over heads" in fig.layout.title.text


def test_one_parameter_count_everywhere():
    from analysis.runs import loading as runs_mod
    from analysis.weights.checkpoint_summary import header_breakdown
    from k3core.loading.folder import CheckpointFiles

    path = SAMPLE_DIR / "k3-full"
    card = runs_mod.load_run(path).card["parameters"]
    summary = wt.read_weight_summary(str(path))
    cfg = summary.config
    header = sum(v["total"] for v in header_breakdown(CheckpointFiles.open(path), cfg).values())
    assert card == summary.total_params == int(summary.params["params"].sum()) == header == 1_568_728


def test_headline_help_comes_from_the_diagnostics_doc():
    help_text = headline_help()
    assert set(HEADLINE_LABELS) <= set(help_text)
    assert all(key not in line.split(";")[0] for key, line in help_text.items() if "_" in key)
    assert "0.3" in help_text["sink_rate"] and "fraction" in help_text["sink_rate"]
