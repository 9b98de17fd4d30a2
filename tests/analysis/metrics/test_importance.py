"""Sub-layer importance (analysis.metrics.importance): ablation and gradient x activation on a real k3-nano."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.metrics import importance as im
from analysis.metrics.loss_noise import choose_window, loss_difference
from tests.conftest import nano_model, random_ids


def test_ablation_of_a_silent_sublayer_is_zero_and_of_a_live_one_matches_a_manual_ablation():
    model = nano_model(1, kda_chunk_size=16)
    ids = random_ids(24)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()  # this sub-layer's output is exactly zero
    imp = im.ablation_importance(model, ids).set_index(["layer", "sublayer"])
    assert imp.loc[(2, "attn"), "importance"] == 0.0
    assert imp.loc[(2, "attn"), "noise"] == 0.0 and not imp.loc[(2, "attn"), "significant"]
    base = imp.loc[(0, "ffn"), "base_loss"]
    base_nll = im.token_nll(model, ids)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.zero_()  # the dense FFN of layer 0, removed by hand
        manual = float(model(ids, labels=ids).loss)
    assert imp.loc[(0, "ffn"), "ablated_loss"] == pytest.approx(manual, abs=1e-6)
    assert imp.loc[(0, "ffn"), "importance"] == pytest.approx(manual - base, abs=1e-6)
    # the noise floor: the paired difference's 95% half-width over windows of the per-token losses
    by_hand = loss_difference(im.token_nll(model, ids), base_nll, paired=True, window=choose_window(23))
    assert by_hand.n_windows >= 2 and imp.loc[(0, "ffn"), "noise"] == pytest.approx(by_hand.half_width, rel=1e-9)
    live = imp.drop(index=(2, "attn"))
    assert (live["noise"] > 0).all()
    assert (imp["significant"] == (imp["importance"].abs() > imp["noise"])).all()
    assert not model.training


def test_layers_above_noise_counts_a_layer_once_when_a_sublayer_helps_beyond_its_floor():
    table = pd.DataFrame(
        [
            dict(layer=0, sublayer="attn", method="ablation", importance=0.30, noise=0.05),  # above
            dict(layer=0, sublayer="ffn", method="ablation", importance=0.20, noise=0.01),  # above: layer 0 once
            dict(layer=1, sublayer="attn", method="ablation", importance=0.02, noise=0.05),  # within its floor
            dict(layer=2, sublayer="ffn", method="ablation", importance=-0.40, noise=0.05),  # removing it helps
            dict(layer=3, sublayer="attn", method="gxa", importance=0.90, noise=np.nan),  # not an ablation
            dict(layer=4, sublayer="ffn", method="ablation", importance=0.06, noise=0.05),
        ]
    )
    assert im.layers_above_noise(table) == [0, 4]


def test_gradient_x_activation_zero_for_a_silent_sublayer_and_first_order_close_to_ablation():
    model = nano_model(2, kda_chunk_size=16)
    ids = random_ids(24)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[1].self_attn.o_proj.weight.mul_(0.05)  # small output: the first-order estimate is good
    gxa = im.gradient_x_activation_importance(model, ids).set_index(["layer", "sublayer"])
    abl = im.ablation_importance(model, ids).set_index(["layer", "sublayer"])
    assert gxa.loc[(2, "attn"), "importance"] == 0.0 and gxa.loc[(2, "attn"), "gxa_abs"] == 0.0
    est, exact = gxa.loc[(1, "attn"), "taylor_ablation"], abl.loc[(1, "attn"), "importance"]
    assert exact != 0 and est == pytest.approx(exact, rel=0.2)


def test_importance_rejects_bad_input():
    model = nano_model(kda_chunk_size=16)
    with pytest.raises(ValueError, match="integer"):
        im.ablation_importance(model, torch.zeros(1, 5))
    with pytest.raises(ValueError, match="2 tokens"):
        im.ablation_importance(model, torch.zeros(1, 1, dtype=torch.long))
