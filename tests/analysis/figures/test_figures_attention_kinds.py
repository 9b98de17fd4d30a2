"""KDA implicit attention beside MLA's (analysis.metrics.kda_attention, analysis.figures.attention_kinds): on a real
k3-nano trace every view builds; on hand-made traces with known answers the tables give them (uniform causal
attention is its own null reference; a known set of first-token masses gives the known sink rate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.figures import attention_kinds as ak
from analysis.metrics import kda_attention as ka
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import run_from_model, trace_run
from analysis.views.view import NotApplicable
from k3core.interp.attention_stats import position_bins
from k3core.interp.kda_attention_stats import distance_bins
from k3core.interp.trace import Trace, names
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model


@pytest.fixture(scope="module")
def nano_ctx() -> AnalysisContext:
    torch.manual_seed(0)
    model = nano_model(seed=None, kda_chunk_size=16)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    return trace_run(run_from_model(model), ids, what="all", label="nano")


def test_every_view_builds_on_a_real_trace(nano_ctx):
    for view in ak.VIEWS:
        fig, df = view.build(nano_ctx)
        assert len(fig.data) > 0 and len(df) > 0 and df.attrs.get("keys"), view.key
    kinds = ka.head_statistics_table(nano_ctx.trace)
    assert set(kinds["kind"]) == {"KDA", "MLA"}
    assert kinds.loc[kinds["kind"] == "MLA", "negative"].isna().all()
    assert ((kinds["entropy_norm"] > 0) & (kinds["entropy_norm"] <= 1 + 1e-6)).all()


def test_views_say_what_is_missing_without_kda_attention(nano_ctx):
    trace = Trace()
    for name in nano_ctx.trace.arrays:
        if ".kda.attn" not in name:
            trace.add(name, nano_ctx.trace[name], nano_ctx.trace.axes[name])
    ctx = AnalysisContext(trace=trace, config=nano_ctx.config, label="no kda_attn")
    for view in ak.VIEWS:
        with pytest.raises(NotApplicable, match="kda_attn|attn_probs"):
            view.build(ctx)


def test_uniform_received_is_the_mean_over_seeing_queries():
    T = 9
    A = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    want = A.sum(0) / (T - np.arange(T))
    np.testing.assert_allclose(ka.uniform_received(T), want)


def _uniform_kda_trace(T: int, first_mass: list[float]) -> Trace:
    """A trace whose KDA layer 1 has uniform causal attention statistics on heads 0.. and given first-token
    masses (received[0] = mass * T): the answers are known."""
    H = len(first_mass)
    t = np.arange(T, dtype=np.float64)
    trace = Trace()
    ent = np.broadcast_to(np.log(t + 1), (1, H, T)).astype(np.float32)
    received = np.broadcast_to(np.cumsum((1 / (t + 1))[::-1])[::-1], (1, H, T)).astype(np.float32).copy()
    received[0, :, 0] = np.asarray(first_mass) * T
    stats = {"entropy": ent, "sink": np.zeros((1, H, T)), "received": received, "negative": np.zeros((1, H, T)),
             "row_sum": np.ones((1, H, T)), "half_distance": np.broadcast_to(t // 2, (1, H, T))}  # fmt: skip
    for kind, value in stats.items():
        trace.add(names.kda_attn_stat(1, kind), np.asarray(value, dtype=np.float32), ("batch", "head", "token"))
    pos, dist = position_bins(T), distance_bins(T)
    trace.add(names.POSITION_BINS, np.asarray(pos), ("edge",))
    trace.add(names.kda_attn_stat(1, "distance"), np.ones((1, H, len(pos) - 1, len(dist) - 1), dtype=np.float32),
              ("batch", "head", "bin", "distance"))  # fmt: skip
    trace.add(names.kda_attn_stat(1, "distance_edges"), np.asarray(dist), ("edge",))
    return trace


def test_uniform_attention_sits_on_its_null_reference_and_sink_rate_counts_heads():
    T = 64
    trace = _uniform_kda_trace(T, [0.5, 0.1, 0.35, 0.01])
    heads = ka.head_statistics_table(trace)
    np.testing.assert_allclose(heads["entropy_norm"], 1.0, atol=1e-6)  # uniform: normalised entropy exactly 1
    np.testing.assert_allclose(heads["first_token_mass"], [0.5, 0.1, 0.35, 0.01], rtol=1e-6)
    ctx = AnalysisContext(trace=trace, config=from_preset("k3-nano"), label="known")
    _, rate = ak.build_sink_rate(ctx)
    assert rate["sink_rate"].tolist() == [0.5]  # 2 of 4 heads above 0.3
    ctx.options["sink_threshold"] = 0.05
    assert ak.build_sink_rate(ctx)[1]["sink_rate"].tolist() == [0.75]
    received = ka.received_by_kind_table(trace)
    np.testing.assert_allclose(received["received"][1:], received["uniform"][1:], rtol=1e-5)
