"""AttnRes views (analysis.figures.attnres): numbers against a hand-built trace, then real k3-nano traces."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.figures import attnres as fa
from analysis.runs.context import AnalysisContext
from analysis.views.catalogue import section_views
from analysis.views.view import NotApplicable
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.analysis.metrics.test_attnres import _hand_trace
from tests.conftest import nano_model, random_ids, randomize_attnres_queries, traced

VIEW = {v.key: v for v in section_views("attnres")}  # the trace views and those drawn from the weights
CONFIG = from_preset("k3-nano")


@pytest.fixture(scope="module")
def block_run():
    model = nano_model(kda_chunk_size=16)
    randomize_attnres_queries(model)
    return model, traced(model, random_ids(24))


def _check(view, ctx):
    fig, df = view.build(ctx)
    assert fig.layout.title.text, view.key
    assert len(fig.data) > 0 and len(df) > 0, view.key


def test_attnres_views_show_the_hand_numbers():
    ctx = AnalysisContext(trace=_hand_trace(), config=CONFIG, label="hand")
    fig, _ = VIEW["attnres_depth_weights"].build(ctx)
    z = np.asarray(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(z[0, :2], [0.5, 0.5])  # site 1.attn: uniform over 2 sources
    assert np.isnan(z[0, 2])  # it has no third source
    np.testing.assert_allclose(z[1], [0.5, 0.0, 0.5])  # output: token 0 on the embedding, token 1 on block 2
    fig, _ = VIEW["attnres_site_stats"].build(ctx)
    by_name = {t.name: list(t.y) for t in fig.data}
    assert by_name["entropy of mean mix (norm.)"] == pytest.approx([1.0, np.log(2) / np.log(3)])
    assert by_name["per-token entropy (norm., mean)"] == pytest.approx([1.0, 0.0])
    assert by_name["embedding weight (depth sink)"] == pytest.approx([0.5, 0.5])


def test_hidden_rms_view_shows_the_hand_numbers():
    t = Trace()
    t.add(names.HIDDEN_RMS, np.array([[[1.0, 3.0]], [[2.0, 2.0]], [[4.0, 4.0]]]), ("depth", "batch", "token"))
    fig, _ = VIEW["attnres_hidden_rms"].build(AnalysisContext(trace=t, config=CONFIG, label="hand"))
    mean = next(tr for tr in fig.data if tr.name == "mean over tokens")
    assert list(mean.y) == [2.0, 2.0, 4.0]  # (1 + 3) / 2, (2 + 2) / 2, (4 + 4) / 2
    assert list(fig.layout.xaxis.ticktext) == ["L0 in", "L1 in", "final"]


def test_every_attnres_view_builds_or_is_not_applicable_as_it_should(block_run):
    model, trace = block_run
    views = dict(VIEW)
    # issue 40 added the measured view attnres_causal_sources (analysis.figures.papers) to the AttnRes section
    expected = {v.key for v in fa.VIEWS} | {"attnres_query_norms", "attnres_scale_bias", "attnres_causal_sources"}
    assert set(views) == expected
    block_ctx = AnalysisContext(trace=trace, config=model.config, model=model, input_ids=random_ids(24))
    no_tokens = AnalysisContext(trace=trace, config=model.config, model=model)  # a causal run needs the tokens
    with pytest.raises(NotApplicable, match="needs the tokens"):
        views["attnres_causal_sources"].build(no_tokens)
    for key, view in views.items():
        if key == "attnres_scale_bias":
            with pytest.raises(NotApplicable):
                view.build(block_ctx)
        else:
            _check(view, block_ctx)

    for mode in ("plain", "scale_bias", "full_attnres"):
        m = nano_model(kda_chunk_size=16, residual=mode)
        ctx = AnalysisContext(trace=traced(m, random_ids(24)), config=m.config, model=m, input_ids=random_ids(24))
        for key, view in views.items():
            if key in ("attnres_hidden_rms", "attnres_scale_bias"):
                applies = key == "attnres_hidden_rms" or mode == "scale_bias"
            elif key == "attnres_query_norms":  # from the weights: every AttnRes mode has pseudo-queries
                applies = mode == "full_attnres"
            else:  # the depth-weight views and the causal sources (which run the model with each source removed)
                applies = mode == "full_attnres"
            if applies:
                _check(view, ctx)
            else:
                with pytest.raises(NotApplicable):
                    view.build(ctx)
