"""The hidden-state moments above ``EXACT_GRAM_MAX_WIDTH`` (k3core.interp.hidden_moments): no D x D item unless asked
for by name, the sketch is R^T G R of the seeded projection, and its error on the statistics it feeds, measured
against the exact Gram on a model where that fits (the numbers docs/DIAGNOSTICS.md quotes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.metrics import hidden_states as hs
from k3core.interp.hidden_moments import (
    EXACT_GRAM_MAX_WIDTH,
    GRAM_ITEM,
    SKETCH_DIM,
    depth_moments,
    sketch_projection,
)
from k3core.interp.recorder import record
from k3core.interp.trace import names
from k3core.interp.trace_size import WHAT_DEFAULT, record_bytes
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

WIDE = EXACT_GRAM_MAX_WIDTH + 16
T = 600


@pytest.fixture(scope="module")
def traces():
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config(from_preset("k3-nano", hidden_size=WIDE)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    out = {}
    for label, what in (("sketch", None), ("exact", (*WHAT_DEFAULT, GRAM_ITEM))):
        with torch.no_grad(), record(model, what=what, window=64) as trace:
            model(ids)
        out[label] = trace
    out["config"] = model.config
    return out


def test_no_item_grows_as_the_width_squared_unless_named(traces):
    sketched, exact = traces["sketch"], traces["exact"]
    for kind in ("gram", "cross_gram"):
        assert names.hidden_bins(kind) not in sketched and names.hidden_bins(kind) in exact
    for kind in ("sq_sum", "sketch_sum", "sketch_gram", "sketch_cross_gram"):
        assert names.hidden_bins(kind) in sketched
    assert sketched[names.hidden_bins("sketch_gram")].shape[-2:] == (SKETCH_DIM, SKETCH_DIM)
    assert sketched.meta["hidden_sketch"]["dim"] == SKETCH_DIM
    for name, array in sketched.arrays.items():
        assert sum(n == WIDE for n in array.shape) <= 1, name
    cfg = traces["config"]
    for label, what in (("sketch", None), ("exact", (*WHAT_DEFAULT, GRAM_ITEM))):
        held = sum(a.nbytes for a in traces[label].arrays.values())
        estimate = record_bytes(cfg, T, what, window=64).arrays
        assert held <= estimate <= 1.05 * held, (label, held, estimate)
    assert record_bytes(cfg, T).arrays < record_bytes(cfg, T, (*WHAT_DEFAULT, GRAM_ITEM)).arrays / 3


def test_the_sketch_is_the_projected_gram():
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, 40, WIDE, generator=gen, dtype=torch.float64) for _ in range(2))
    bins = [0, 16, 40]
    R = sketch_projection(WIDE)
    assert torch.equal(R, sketch_projection(WIDE))  # seeded: the same R in every process
    exact, carry = depth_moments(x, None, bins, None)
    exact_y, _ = depth_moments(y, carry, bins, None)
    sketch, carry = depth_moments(x, None, bins, R)
    sketch_y, _ = depth_moments(y, carry, bins, R)
    torch.testing.assert_close(sketch["sketch_gram"], R.T @ exact["gram"] @ R, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(sketch_y["sketch_cross_gram"], R.T @ exact_y["cross_gram"] @ R, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(sketch["sketch_sum"], exact["sum"] @ R, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(sketch["sq_sum"], exact["gram"].diagonal(dim1=-2, dim2=-1).sum(-1))
    for kind in ("sum", "unit_sum"):
        assert torch.equal(sketch[kind], exact[kind])
    assert torch.equal(sketch_y["cos_sum"], exact_y["cos_sum"])


def test_the_sketch_error_on_the_statistics_it_feeds(traces):
    """Rank collapse, token cosine and layer cosine are exact from the sketched trace; CKA (unbiased Frobenius norms
    of the sketch) within 0.02; the effective rank is that of the k-dimensional projected states: close while the
    states' effective rank is far below k, lower otherwise (what DIAGNOSTICS.md states)."""
    sketched, exact = traces["sketch"], traces["exact"]
    rank_s, rank_e = hs.rank_collapse_table(sketched), hs.rank_collapse_table(exact)
    for col in ("ratio", "token_cosine"):
        np.testing.assert_allclose(rank_s[col], rank_e[col], rtol=1e-9)
    red_s, red_e = hs.layer_redundancy_table(sketched), hs.layer_redundancy_table(exact)
    np.testing.assert_allclose(red_s["cosine"], red_e["cosine"], rtol=1e-12)
    cka_err = float(np.abs(red_s["cka"] - red_e["cka"]).max())
    by_s, by_e = hs.rank_collapse_by_position_table(sketched), hs.rank_collapse_by_position_table(exact)
    rel = (by_e["effective_rank"] - by_s["effective_rank"]) / by_e["effective_rank"]
    first = by_e["bin"] == 0  # 16 tokens: effective rank < 16, far below k = 256
    whole = (rank_e["effective_rank"] - rank_s["effective_rank"]) / rank_e["effective_rank"]
    print(
        f"\nsketch k={SKETCH_DIM}, width {WIDE}, {T} tokens: CKA max abs error {cka_err:.4f}; effective rank "
        f"(exact {rank_e['effective_rank'].min():.0f}-{rank_e['effective_rank'].max():.0f}) relative error: 16-token "
        f"bins {rel[first].abs().max():.3f}, every bin {rel.abs().max():.3f}, whole text {whole.abs().max():.3f}"
    )
    assert cka_err <= 0.02
    assert rel[first].abs().max() <= 0.05
    assert (whole >= 0).all() and whole.max() <= 0.5  # an underestimate, at most by half here


def test_a_second_forward_in_one_block_keeps_the_sketch_and_its_meta():
    torch.manual_seed(2)
    model = K3ForCausalLM.from_config(from_preset("k3-nano", hidden_size=WIDE)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    with torch.no_grad(), record(model) as once:
        model(ids)
    with torch.no_grad(), record(model) as twice:
        model(ids)
        model(ids)
    assert twice.meta["hidden_sketch"] == once.meta["hidden_sketch"]
    name = names.hidden_bins("sketch_gram")
    np.testing.assert_array_equal(twice[name], once[name])
