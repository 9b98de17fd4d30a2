"""analysis.metrics.attnres: hand-computed cases and real k3-nano traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.metrics import attnres as ar
from analysis.metrics.entropy import normalised_entropy
from k3core.interp.trace import Trace
from k3core.modeling.layers.residual import scale_bias_init
from tests.conftest import nano_model, random_ids, randomize_attnres_queries, traced, traced_nano


@pytest.fixture(scope="module")
def block_run():
    model = nano_model(kda_chunk_size=16)
    randomize_attnres_queries(model)
    return model, traced(model, random_ids(24))


# ----------------------------------------------------------------------------- metrics by hand


def test_normalised_entropy_hand_cases():
    assert normalised_entropy(np.full(4, 0.25)) == pytest.approx(1.0)
    assert normalised_entropy(np.array([0.0, 1.0, 0.0])) == 0.0
    assert normalised_entropy(np.array([1.0])) == 0.0  # a single source: defined as 0
    assert normalised_entropy(np.array([0.5, 0.5, 0.0, 0.0])) == pytest.approx(0.5)  # log 2 / log 4
    rows = normalised_entropy(np.array([[0.5, 0.5], [1.0, 0.0]]))
    assert rows == pytest.approx([1.0, 0.0])
    with pytest.raises(ValueError):
        normalised_entropy(np.array([-0.1, 1.1]))


def _hand_trace() -> Trace:
    t = Trace(
        meta={
            "config": {"num_hidden_layers": 2},
            "attnres_sources": {
                "1.attn": ["embedding", "block 1 (partial)"],
                "output": ["embedding", "block 1", "block 2"],
            },
        }
    )
    t.add("blocks.1.attn_res.weights", np.tile([0.5, 0.5], (1, 3, 1)), ("batch", "token", "source"))  # uniform
    out = np.zeros((1, 2, 3))
    out[0, 0] = [1.0, 0.0, 0.0]  # token 0 all on the embedding, token 1 all on the last block
    out[0, 1] = [0.0, 0.0, 1.0]
    t.add("output_res.weights", out, ("batch", "token", "source"))
    t.add("blocks.1.attn_res.query_norm", np.array(0.0), ())
    t.add("output_res.query_norm", np.array(2.5), ())
    return t


def test_depth_weights_and_site_stats_by_hand():
    t = _hand_trace()
    assert ar.sites(t) == ["1.attn", "output"]
    w = ar.depth_weights(t)
    out = w[w["site"] == "output"].set_index("source")["weight"]
    assert list(out) == pytest.approx([0.5, 0.0, 0.5])
    assert list(w[w["site"] == "1.attn"]["source_label"]) == ["embedding", "block 1"]
    mat, site_names, labels = ar.weight_matrix(w)
    assert site_names == ["1.attn", "output"] and labels == ["embedding", "block 1", "block 2"]
    assert np.isnan(mat[0, 2]) and mat[0, :2] == pytest.approx([0.5, 0.5])

    stats = ar.site_stats(t).set_index("site")
    assert stats.loc["1.attn", "entropy"] == pytest.approx(1.0)  # uniform mix
    assert stats.loc["1.attn", "token_entropy"] == pytest.approx(1.0)
    assert stats.loc["output", "token_entropy"] == 0.0  # every token one-hot
    assert stats.loc["output", "entropy"] == pytest.approx(np.log(2) / np.log(3))  # mean mix is [.5, 0, .5]
    assert stats.loc["output", "embedding_weight"] == 0.5 and stats.loc["output", "max_weight"] == 0.5
    assert stats.loc["output", "layer"] == 2 and stats.loc["output", "side"] == "output"
    assert stats.loc["output", "query_norm"] == 2.5


def test_hidden_rms_by_depth_by_hand():
    t = Trace()
    rms = np.array([[[1.0, 3.0]], [[2.0, 2.0]], [[4.0, 4.0]]])  # depth 3 (2 layers + final), 1 seq, 2 tokens
    t.add("hidden_rms", rms, ("depth", "batch", "token"))
    table = ar.hidden_rms_by_depth(t)
    assert list(table["label"]) == ["L0 in", "L1 in", "final"]
    assert list(table["mean"]) == [2.0, 2.0, 4.0]
    assert list(table["max"]) == [3.0, 2.0, 4.0]


# ----------------------------------------------------------------------------- real traces


def test_zero_queries_give_uniform_mixes_on_a_real_model():
    model, _, trace = traced_nano(T=24)  # fresh model: every pseudo-query is zero
    stats = ar.site_stats(trace)
    assert (stats["query_norm"] == 0).all()
    assert np.allclose(stats["entropy"], 1.0) and np.allclose(stats["token_entropy"], 1.0)
    assert np.allclose(stats["embedding_weight"], 1.0 / stats["n_sources"])


def test_block_sites_and_sources_on_a_real_trace(block_run):
    model, trace = block_run
    stats = ar.site_stats(trace)
    # k3-nano: 4 layers, blocks of 2; layer 0 has no attention-site mix (the bank is empty)
    assert list(stats["site"]) == ["0.mlp", "1.attn", "1.mlp", "2.attn", "2.mlp", "3.attn", "3.mlp", "output"]
    assert list(stats["n_sources"]) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert ((stats["entropy"] > 0) & (stats["entropy"] < 1)).all()
    w = ar.depth_weights(trace)
    assert np.allclose(w.groupby("site")["weight"].sum(), 1.0)
    assert set(w[w["source"] == 0]["source_name"]) == {"embedding"}


def test_scale_bias_of_a_real_model_from_its_weights():
    from analysis.weights import summary_of_model

    model = nano_model(kda_chunk_size=16, residual="scale_bias")
    with torch.no_grad():
        model.model.layers[1].mlp_res_bias.fill_(0.25)
    table = summary_of_model(model).scale_bias.set_index(["layer", "site"])
    assert len(table) == 2 * 4
    for i in range(4):
        assert table.loc[(i, "attn"), "scale_mean"] == pytest.approx(scale_bias_init(model.config, i))
    assert table.loc[(1, "mlp"), "bias_mean"] == pytest.approx(0.25) and table.loc[(1, "mlp"), "bias_std"] == 0
    assert table.loc[(0, "mlp"), "bias_mean"] == 0.0


# ----------------------------------------------------------------------------- views
