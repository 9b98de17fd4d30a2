"""Comparison (side by side, A - B, headline numbers) and training history, on hand cases and real k3-nano traces."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from analysis import compare as cmp
from analysis import history as hist
from analysis.figures import degradation as fig_dg
from analysis.figures import history as fig_hist
from analysis.runs import run_from_model, trace_run
from analysis.views import AnalysisContext, NotApplicable, View
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.trace import Trace

METRICS = {
    "history": [
        {
            "step": 0,
            "tokens": 0,
            "loss": 5.5,
            "moe": {"maxvio": [1.0, 2.0], "cv": [0.5, 0.7]},
            "attnres": {"embedding_weight": [0.5, 0.4]},
        },
        {
            "step": 10,
            "tokens": 4096,
            "loss": 3.0,
            "moe": {"maxvio": [0.5, 1.0], "cv": [0.2, 0.4]},
            "attnres": {"embedding_weight": [0.3, 0.2]},
        },
        {
            "step": 20,
            "tokens": 8192,
            "loss": 2.5,
            "moe": {"maxvio": [0.2, 0.4], "cv": [0.1, 0.3]},
            "attnres": {"embedding_weight": [0.2, 0.2]},
        },
    ],
    "eval": [{"step": 10, "val_bpb": 3.2, "mqar_acc": 0.1}, {"step": 20, "val_bpb": 2.9, "mqar_acc": 0.4}],
    "tokens_seen": 8192,
}


def nano(seed: int, **overrides) -> K3ForCausalLM:
    torch.manual_seed(seed)
    overrides.setdefault("kda_chunk_size", 16)
    return K3ForCausalLM.from_config(K3Config.from_preset("k3-nano", **overrides)).eval()


IDS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pair() -> tuple[AnalysisContext, AnalysisContext]:
    a = trace_run(run_from_model(nano(0), metrics=METRICS), IDS, label="A")
    b = trace_run(run_from_model(nano(1)), IDS, label="B")
    return a, b


# ----------------------------------------------------------------------------- headline numbers
def test_moe_load_stats_hand_cases():
    even = cmp.moe_load_stats(np.array([2, 2, 2, 2]))
    assert even == {"maxvio": 0.0, "cv": 0.0, "entropy_norm": pytest.approx(1.0), "dead": 0.0}
    one = cmp.moe_load_stats(np.array([4, 0, 0, 0]))
    assert one["maxvio"] == pytest.approx(3.0)  # 4 / 1 - 1
    assert one["entropy_norm"] == pytest.approx(0.0)
    assert one["dead"] == 3.0
    assert one["cv"] == pytest.approx(np.std([4, 0, 0, 0]) / 1.0)
    two = cmp.moe_load_stats(np.array([1, 1, 0, 0]))
    assert two["entropy_norm"] == pytest.approx(math.log(2) / math.log(4))


def test_headline_numbers_of_a_real_trace(pair):
    a, _ = pair
    h = cmp.headline_numbers(a)
    nll = a.trace["token_nll"]
    assert h["loss"] == pytest.approx(float(np.nanmean(nll)))
    assert h["bits_per_byte"] == pytest.approx(h["loss"] / math.log(2))
    assert 0 <= h["sink_rate"] <= 1 and 0 <= h["mla_entropy_norm_mean"] <= 1
    assert 0 < h["rank_collapse_mean"] <= 1
    assert h["moe_maxvio_max"] >= 0 and 0 < h["moe_entropy_norm_mean"] <= 1
    # AttnRes pseudo-queries start at zero: every depth mix is uniform, so the embedding weight is 1/n_sources
    sources = a.trace.meta["attnres_sources"]
    assert h["attnres_embedding_weight_mean"] == pytest.approx(np.mean([1 / len(v) for v in sources.values()]))
    assert h["kda_horizon_mean"] >= 1.0
    assert h["train_final_val_bpb"] == 2.9


def test_headline_numbers_without_optional_data():
    tr = Trace()
    tr.add("tokens", np.zeros((1, 3), dtype=np.int64), ("batch", "token"))
    ctx = AnalysisContext(trace=tr, config=K3Config.from_preset("k3-nano"), label="bare")
    h = cmp.headline_numbers(ctx)
    assert math.isnan(h["loss"]) and math.isnan(h["sink_rate"]) and math.isnan(h["moe_maxvio_max"])


def test_headline_table_delta_is_a_minus_b():
    df = cmp.headline_table({"label": "x", "loss": 3.0, "sink_rate": 0.5}, {"label": "y", "loss": 2.0})
    row = df.set_index("metric").loc["loss"]
    assert (row["a"], row["b"], row["delta"]) == (3.0, 2.0, 1.0)
    assert math.isnan(df.set_index("metric").loc["sink_rate", "delta"])
    assert df.attrs["label_a"] == "x" and df.attrs["label_b"] == "y"


# ----------------------------------------------------------------------------- difference
def test_difference_table_hand_case():
    a = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "v": [1.0, 2.0, 3.0, 4.0]})
    b = pd.DataFrame({"layer": [1, 1, 0, 0], "head": [1, 0, 1, 0], "v": [0.5, 0.5, 0.5, 0.5]})
    diff = cmp.difference_table(a, b)
    assert diff.attrs["keys"] == ["layer", "head"]
    np.testing.assert_allclose(diff.sort_values(["layer", "head"])["v_diff"], [0.5, 1.5, 2.5, 3.5])
    fig = cmp.difference_figure(diff, "v", "t")
    hm = fig.data[0]
    assert hm.zmid == 0 and hm.zmin == -3.5 and hm.zmax == 3.5
    np.testing.assert_allclose(np.asarray(hm.z), [[0.5, 1.5], [2.5, 3.5]])


def test_difference_table_refuses_misaligned_tables():
    a = pd.DataFrame({"layer": [0, 1], "v": [1.0, 2.0]})
    with pytest.raises(NotApplicable, match="shapes"):
        cmp.difference_table(a, a.iloc[:1])
    with pytest.raises(NotApplicable, match="do not match"):
        cmp.difference_table(a, a.assign(layer=[5, 6]))
    with pytest.raises(NotApplicable, match="columns"):
        cmp.difference_table(a, a.rename(columns={"v": "w"}))


def test_difference_view_of_a_run_with_itself_is_zero(pair):
    a, _ = pair
    view = next(v for v in fig_dg.VIEWS if v.key == "degradation_entropy")
    fig, diff = cmp.difference_view(view, a, a)
    assert np.allclose(diff["entropy_norm_diff"], 0.0)
    assert fig.data[0].zmid == 0


def test_difference_view_between_different_layouts_is_not_applicable(pair):
    a, _ = pair
    other = trace_run(run_from_model(nano(0, full_attn_layers=[2, 4])), IDS, label="C")
    view = next(v for v in fig_dg.VIEWS if v.key == "degradation_entropy")
    with pytest.raises(NotApplicable):
        cmp.difference_view(view, a, other)


# ----------------------------------------------------------------------------- side by side
def test_side_by_side_shares_axes_and_colours(pair):
    a, b = pair
    view = next(v for v in fig_dg.VIEWS if v.key == "degradation_kda_state_rank")
    fa, _ = view.build(a)
    fb, _ = view.build(b)
    fig, df = cmp.side_by_side(view, a, b)
    assert len(fig.data) == len(fa.data) + len(fb.data)
    left, right = fig.data[0], fig.data[1]
    assert (left.zmin, left.zmax) == (right.zmin, right.zmax)
    assert left.showscale is False
    assert right.xaxis == "x2" and right.yaxis == "y2"
    assert fig.layout.xaxis2.matches == "x" and fig.layout.yaxis2.matches == "y"
    assert fig.layout.xaxis.domain[1] <= fig.layout.xaxis2.domain[0]
    assert set(df["run"]) == {"A", "B"}
    assert any("A" in (ann.text or "") for ann in fig.layout.annotations)


def test_side_by_side_of_multi_panel_and_overlay_figures(pair):
    a, b = pair
    for key in ("degradation_rank_collapse", "degradation_redundancy", "degradation_sink"):
        view = next(v for v in fig_dg.VIEWS if v.key == key)
        fa, _ = view.build(a)
        fig, _ = cmp.side_by_side(view, a, b)
        left_axes = cmp._axis_ids(fa.to_plotly_json())
        # every right-hand trace sits on renumbered axes that match their left counterparts
        for tr in fig.data[len(fa.data) :]:
            x_num, y_num = int(tr.xaxis[1:] or 1), int(tr.yaxis[1:] or 1)
            assert x_num > max(left_axes["x"]) and y_num > max(left_axes["y"]), key
        x_right = fig.layout[f"xaxis{max(left_axes['x']) + 1}"]
        assert x_right.matches == "x" and x_right.domain[0] >= 0.5, key
        fig.to_json()  # a valid figure


def test_side_by_side_when_one_run_lacks_the_view(pair):
    a, _ = pair

    def build(ctx):
        if ctx.label == "B":
            raise NotApplicable("nothing here")
        return fig_dg.build_kda_state_rank(ctx)

    view = View("test", "test view", "degradation", build)
    b = AnalysisContext(trace=a.trace, config=a.config, label="B")
    fig, df = cmp.side_by_side(view, a, b)
    assert set(df["run"]) == {"A"}
    assert any("nothing here" in (ann.text or "") for ann in fig.layout.annotations)
    with pytest.raises(NotApplicable):
        cmp.side_by_side(View("none", "none", "x", lambda c: (_ for _ in ()).throw(NotApplicable("no"))), a, b)


# ----------------------------------------------------------------------------- history
def test_history_long_and_final_numbers():
    long = hist.history_long(METRICS)
    assert set(long["metric"]) >= {"loss", "moe.maxvio", "moe.cv", "attnres.embedding_weight", "val_bpb"}
    maxvio = long[long["metric"] == "moe.maxvio"]
    assert list(maxvio["index"].unique()) == [0.0, 1.0]
    final = hist.final_numbers(METRICS)
    assert final["final_loss"] == 2.5 and final["final_val_bpb"] == 2.9 and final["best_val_bpb"] == 2.9
    assert final["final_mqar_acc"] == 0.4 and final["tokens_seen"] == 8192 and final["last_step"] == 20


NATIVE = {  # the layout k3core.train writes (format "k3lab-metrics", version 1), abridged
    "format": "k3lab-metrics",
    "version": 1,
    "status": "finished",
    "step": 4,
    "seed": 0,
    "data": {"unigram_baseline_bpb": 4.8},
    "history": {
        "train": [
            {"step": 2, "tokens": 256, "loss": 5.5, "bpb": 7.9, "lr": 1e-3},
            {"step": 4, "tokens": 512, "loss": 5.0, "bpb": 7.2, "lr": 1e-3},
        ],
        "val": [{"step": 4, "tokens": 512, "val_loss": 4.9, "val_bpb": 7.1, "mqar_accuracy": 0.25}],
        "moe": [
            {
                "step": 2,
                "layers": {
                    "1": {"load": [3, 1], "max_vio": 0.5, "cv": 0.5, "bias": [0.0, 0.1]},
                    "2": {"load": [2, 2], "max_vio": 0.0, "cv": 0.0, "bias": [0.0, 0.0]},
                },
            }
        ],
        "attnres": [
            {
                "step": 4,
                "mode": "block_attnres",
                "sites": {
                    "1.attn": {"query_norm": 0.5, "mean_weights": [0.75, 0.25], "sources": ["embedding", "block 1"]},
                    "output": {"query_norm": 0.1, "mean_weights": [0.5, 0.5], "sources": ["embedding", "block 1"]},
                },
            }
        ],
    },
    "final": {"step": 4, "tokens_seen": 512, "val_loss": 4.9, "val_bpb": 7.1, "mqar_accuracy": 0.25},
}


def test_history_reads_the_native_training_metrics():
    curves = hist.curves_table(NATIVE, "r")
    by_curve = {c: list(g["value"]) for c, g in curves.groupby("curve")}
    assert by_curve == {
        "train loss": [5.5, 5.0],
        "train bits/byte": [7.9, 7.2],
        "val bits/byte": [7.1],
        "val loss": [4.9],
        "MQAR accuracy": [0.25],
    }
    assert list(curves["tokens"].dropna().unique()) == [256.0, 512.0]
    moe = hist.moe_balance_table(NATIVE, "r")
    maxvio = moe[moe["stat"] == "MaxVio"].set_index("index")["value"]
    assert maxvio.to_dict() == {1.0: 0.5, 2.0: 0.0}
    ar = hist.attnres_history_table(NATIVE, "r").set_index(["site", "metric"])["value"]
    assert ar[("1.attn", "embedding_weight")] == 0.75 and ar[("output", "query_norm")] == 0.1
    p = np.array([0.75, 0.25])
    assert ar[("1.attn", "mix_entropy")] == pytest.approx(-(p * np.log(p)).sum() / np.log(2))
    final = hist.final_numbers(NATIVE)
    assert final["val_bpb"] == 7.1 and final["final_loss"] == 5.0 and final["unigram_baseline_bpb"] == 4.8
    assert final["tokens_seen"] == 512 and "seed" not in final and "version" not in final
    ctx = AnalysisContext(trace=Trace(), config=K3Config.from_preset("k3-nano"), metrics=NATIVE, label="r")
    for view in fig_hist.VIEWS:
        fig, df = view.build(ctx)
        assert len(fig.data) and len(df), view.key


def test_history_accepts_columns_lists_and_aliases():
    cols = {"step": [1, 2], "train/loss": [4.0, 3.0], "val_bits_per_byte": [4.5, 3.5]}
    curves = hist.curves_table(cols, "r")
    assert set(curves["curve"]) == {"train loss", "val bits/byte"}
    as_list = hist.curves_table([{"step": 1, "loss": 2.0}], "r")
    assert list(as_list["value"]) == [2.0]
    layered = hist.moe_balance_table({"history": [{"step": 5, "maxvio": {"1": 0.5, "3": 0.9}}]})
    assert sorted(layered["index"]) == [1.0, 3.0]
    assert hist.history_long(None).empty and hist.history_long({"unrelated": "x"}).empty
    assert hist.final_numbers({"history": "not a list"}) == {}


def test_history_views_overlay_runs_and_say_not_applicable(pair):
    a, _ = pair
    ctx = AnalysisContext(
        trace=a.trace,
        config=a.config,
        metrics=METRICS,
        label="A",
        options={"overlay_metrics": {"B": {"history": [{"step": 0, "loss": 4.0}, {"step": 20, "loss": 2.0}]}}},
    )
    fig, df = fig_hist.build_curves(ctx)
    assert set(df["run"]) == {"A", "B"}
    assert {t.name for t in fig.data} == {"A", "B"}
    fig, df = fig_hist.build_moe(ctx)
    assert set(df["stat"]) == {"MaxVio", "CV"}
    mean_a = df[(df["run"] == "A") & (df["stat"] == "MaxVio") & (df["step"] == 0)]["value"].mean()
    assert mean_a == pytest.approx(1.5)
    fig, _ = fig_hist.build_attnres(ctx)
    assert len(fig.data) == 1
    bare = AnalysisContext(trace=a.trace, config=a.config, label="bare")
    for view in fig_hist.VIEWS:
        with pytest.raises(NotApplicable):
            view.build(bare)
    no_moe = AnalysisContext(trace=a.trace, config=a.config, metrics={"history": [{"step": 1, "loss": 1.0}]})
    with pytest.raises(NotApplicable, match="MoE"):
        fig_hist.build_moe(no_moe)
