"""Headline numbers (analysis.metrics.headline): each summary against a hand-built trace, then a real k3-nano trace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis.metrics import headline as hl
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import run_from_model, trace_run
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model

METRICS = {"history": [{"step": 10, "val_bpb": 3.2}, {"step": 20, "val_bpb": 2.9}]}


def test_moe_summary_hand_case():
    tr = Trace()
    tr.add(names.moe_load(1), np.array([2, 2, 4, 0]), ("expert",))  # mean 2: MaxVio 1, CV sqrt(2)/2, 1 dead
    tr.add(names.moe_load(3), np.array([2, 2, 2, 2]), ("expert",))  # balanced: 0, 0, entropy 1
    s = hl.moe_summary(tr)
    assert s["moe_maxvio_max"] == pytest.approx(1.0)
    assert s["moe_cv_mean"] == pytest.approx((math.sqrt(2) / 2 + 0.0) / 2)
    p = np.array([0.25, 0.25, 0.5])  # the first layer's non-zero shares
    ent = -(p * np.log(p)).sum() / math.log(4)
    assert s["moe_entropy_norm_mean"] == pytest.approx((ent + 1.0) / 2)
    assert s["moe_dead_experts"] == 1.0
    assert all(math.isnan(v) for v in hl.moe_summary(Trace()).values())


def test_kda_half_life_summary_hand_case():
    # one layer, one head, 3 channels; g constant over tokens: alpha = exp(g), half-life ln 2 / (-g)
    g = np.zeros((1, 4, 1, 3))
    g[..., 0] = math.log(0.5) / 2  # half-life 2
    g[..., 1] = math.log(0.5) / 4  # half-life 4
    g[..., 2] = 0.0  # alpha = 1: never forgets, infinite half-life
    tr = Trace()
    tr.add(names.kda_g(0), g, ("batch", "token", "head", "channel"))
    s = hl.kda_half_life_summary(tr)
    assert s["kda_half_life_mean"] == pytest.approx(3.0)  # mean of the finite 2 and 4
    assert s["kda_half_life_median"] == pytest.approx(4.0)  # median of (2, 4, inf)
    assert s["kda_half_life_inf_share"] == pytest.approx(1 / 3)


def test_attnres_embedding_weight_hand_case():
    tr = Trace()
    tr.add(names.attnres("1.attn"), np.array([[[0.75, 0.25], [0.25, 0.75]]]), ("batch", "token", "source"))
    tr.add(names.attnres("output"), np.array([[[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]]), ("batch", "token", "source"))
    assert hl.attnres_embedding_weight(tr) == pytest.approx((0.5 + 0.2) / 2)
    assert math.isnan(hl.attnres_embedding_weight(Trace()))


def test_headline_numbers_of_a_real_trace():
    torch.manual_seed(0)
    model = nano_model(seed=None, kda_chunk_size=16)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    ctx = trace_run(run_from_model(model, metrics=METRICS), ids, label="A")
    h = hl.headline_numbers(ctx)
    nll = ctx.trace[names.TOKEN_NLL]
    assert h["loss"] == pytest.approx(float(np.nanmean(nll)))
    assert h["bits_per_byte"] == pytest.approx(h["loss"] / math.log(2))
    assert 0 <= h["sink_rate"] <= 1 and 0 <= h["mla_entropy_norm_mean"] <= 1
    assert 0 < h["rank_collapse_mean"] <= 1
    assert h["moe_maxvio_max"] >= 0 and 0 < h["moe_entropy_norm_mean"] <= 1
    # AttnRes pseudo-queries start at zero: every depth mix is uniform, so the embedding weight is 1/n_sources
    sources = ctx.trace.meta["attnres_sources"]
    assert h["attnres_embedding_weight_mean"] == pytest.approx(np.mean([1 / len(v) for v in sources.values()]))
    assert h["kda_half_life_mean"] > 0.0
    assert h["train_final_val_bpb"] == 2.9
    assert h["tokens"] == 40


def test_headline_numbers_without_optional_data():
    tr = Trace()
    tr.add(names.TOKENS, np.zeros((1, 3), dtype=np.int64), ("batch", "token"))
    ctx = AnalysisContext(trace=tr, config=from_preset("k3-nano"), label="bare")
    h = hl.headline_numbers(ctx)
    assert math.isnan(h["loss"]) and math.isnan(h["sink_rate"]) and math.isnan(h["moe_maxvio_max"])
    assert math.isnan(h["kda_half_life_median"]) and h["tokens"] == 3


def test_headline_table_delta_is_a_minus_b():
    df = hl.headline_table({"label": "x", "loss": 3.0, "sink_rate": 0.5}, {"label": "y", "loss": 2.0})
    row = df.set_index("metric").loc["loss"]
    assert (row["a"], row["b"], row["delta"]) == (3.0, 2.0, 1.0)
    assert math.isnan(df.set_index("metric").loc["sink_rate", "delta"])
    assert df.attrs["label_a"] == "x" and df.attrs["label_b"] == "y"
    assert df.set_index("metric").loc["loss", "description"] == hl.HEADLINE_LABELS["loss"]
