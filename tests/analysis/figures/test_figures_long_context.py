"""Long-context views (issue 24): each table checked against values computed by hand on a short text, every view
built, and the Compare of one run on two lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from analysis.compare import two_runs as cmp
from analysis.experiments import long_runs as lr
from analysis.figures import long_context as fl
from analysis.metrics import hidden_states as hs
from analysis.metrics import long_context as lc
from analysis.metrics.allocation import layer_cache_bytes
from analysis.metrics.intervals import wilson_interval
from analysis.runs.loading import run_from_model, trace_run
from analysis.views.catalogue import all_views, section_views
from tests.conftest import nano_model

OPTIONS = {"recall_distances": (8, 16), "recall_examples": 6, "cost_lengths": (32, 64)}


@pytest.fixture(scope="module")
def ctx():
    """The nano model on 70 random bytes (bins 0-16-32-64-70), bulky arrays windowed at 20, maps whole."""
    model = nano_model()
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))
    return trace_run(run_from_model(model), ids, what="all", label="nano70", window=20, options=OPTIONS)


@pytest.fixture(scope="module")
def whole(ctx):
    """The same forward with every array whole (the hand computations read hidden / g / maps from it)."""
    return trace_run(run_from_model(ctx.model), ctx.input_ids, what="all", label="whole", window=None)


def test_loss_by_position_by_hand(ctx):
    nll = ctx.trace["token_nll"].astype(np.float64)[0]
    table = lc.loss_by_position_table(ctx.trace, short=32)
    assert list(table["start"]) == [0, 16, 32, 64] and list(table["stop"]) == [16, 32, 64, 70]
    for row in table.itertuples():
        part = nll[row.start : row.stop]
        part = part[np.isfinite(part)]
        assert row.tokens == len(part)
        assert row.loss == pytest.approx(part.mean(), rel=1e-12)
        assert row.sem == pytest.approx(part.std() / math.sqrt(len(part)), rel=1e-9)
        assert row.position == pytest.approx(math.sqrt(max(row.start, 1) * row.stop))
    assert table.attrs["short_context_loss"] == pytest.approx(np.nanmean(nll[:32]), rel=1e-12)


def test_kda_state_over_position_by_hand(ctx):
    table = lc.kda_state_by_position_table(ctx.trace)
    for i in ctx.trace.layer_indices("kda"):
        final = ctx.trace[f"blocks.{i}.kda.state"][0].astype(np.float64)  # [head, d, d] after all 70 tokens
        last = table[(table["layer"] == i) & (table["token"] == 70)].sort_values("head")
        assert len(last) == final.shape[0]
        np.testing.assert_allclose(last["state_norm"], np.linalg.norm(final, axis=(-2, -1)), rtol=1e-5)
        want = [hs.effective_rank(final[h], center=False) for h in range(final.shape[0])]
        np.testing.assert_allclose(last["state_rank"], want, rtol=1e-4)


def test_decay_horizon_by_hand(ctx, whole):
    table = lc.decay_horizon_table(ctx.trace)
    g = whole.trace["blocks.0.kda.g"][0].astype(np.float64)  # [token, head, channel], every position
    for start, stop in ((0, 16), (64, 70)):
        gbar = g[start:stop, 1].mean(0)  # head 1
        want = np.median(np.where(gbar < 0, math.log(2) / -np.minimum(gbar, -1e-300), np.inf))
        got = table[(table["layer"] == 0) & (table["head"] == 1) & (table["start"] == start)]["horizon"].item()
        assert got == pytest.approx(want, rel=1e-5)


def test_mla_over_position_by_hand(ctx, whole):
    table = lc.mla_by_position_table(ctx.trace)
    layer = ctx.trace.layer_indices("mla")[0]
    attn = whole.trace[f"blocks.{layer}.mla.attn"][0].astype(np.float64)  # [head, query, key], all 70 queries
    h = 1
    ent = -(np.where(attn[h] > 0, attn[h] * np.log(np.where(attn[h] > 0, attn[h], 1)), 0)).sum(-1)
    norm = ent[1:] / np.log(np.arange(2, 71))  # queries 1..69 (query 0 has one key)
    for start, stop in ((0, 16), (32, 64)):
        row = table[(table["layer"] == layer) & (table["head"] == h) & (table["start"] == start)].iloc[0]
        lo = max(start, 1)
        assert row["entropy_norm"] == pytest.approx(norm[lo - 1 : stop - 1].mean(), rel=1e-5)
        assert row["sink_mass"] == pytest.approx(attn[h, start:stop, 0].mean(), rel=1e-5)


def test_recall_inputs_and_accuracy_by_hand(ctx):
    batch = lr.recall_inputs(10, 3, 256, pairs=2, seed=1)
    ids = batch["inputs"]
    assert ids.shape == (3, 12) and batch["query"] == 11
    assert (ids[:, 11] == ids[:, 0]).all() and (ids[:, 1] == batch["value"]).all()
    assert (ids[:, 4:11] == 0).all() and ((ids[:, [0, 2]] >= 128) & (ids[:, [0, 2]] < 192)).all()
    assert batch["query"] - 1 == 10  # the value sits 10 tokens before the query
    table = fl.recall_table(ctx)
    with torch.no_grad():
        for d in (8, 16):
            b = lr.recall_inputs(d, 6, 256, pairs=4, seed=0)
            hits = int((ctx.model(b["inputs"]).logits[:, b["query"]].argmax(-1) == b["value"]).sum())
            row = table[table["distance"] == d].iloc[0]
            assert row["correct"] == hits and row["accuracy"] == pytest.approx(hits / 6)
    assert table["chance"].iloc[0] == pytest.approx(1 / 64)
    low, high = wilson_interval(5, 10)
    assert (round(float(low), 4), round(float(high), 4)) == (0.2366, 0.7634)
    with pytest.raises(ValueError, match="at least"):
        lr.recall_inputs(3, 1, 256, pairs=4)


def test_cost_by_length_beside_the_cache_model(ctx):
    table = fl.cost_table(ctx)
    cfg = ctx.config
    assert list(table["seq_len"]) == [32, 64] and (table["seconds"] > 0).all()
    types = cfg.layer_types()
    kda = types.index("KDA")
    for row in table.itertuples():
        want_kda = types.count("KDA") * layer_cache_bytes(cfg, kda, row.seq_len, 4)
        want_mla = types.count("MLA") * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * row.seq_len * 4
        assert row.cache_bytes_kda == want_kda and row.cache_bytes_mla == want_mla
        assert row.cache_bytes == want_kda + want_mla
        assert row.seconds_per_token == pytest.approx(row.seconds / row.seq_len)
    stopped = lr.cost_by_length(ctx.model, (16, 32), should_stop=lambda: True)
    assert stopped.empty and stopped.attrs["stopped"]


def test_every_long_context_view_builds_and_is_in_the_catalogue(ctx):
    keys = {v.key for v in section_views("long_context")}
    assert keys == {v.key for v in fl.VIEWS} and keys <= {v.key for v in all_views()}
    for view in fl.VIEWS:
        fig, df = view.build(ctx)
        assert len(fig.data) > 0 and len(df) > 0, view.key
        assert df.attrs.get("keys"), view.key
    picked = ctx.with_options(layer=ctx.trace.layer_indices("mla")[0], head=1)
    _, df = fl.build_mla_over_position(picked)
    assert set(df["head"]) == {1}


def test_compare_one_run_on_two_lengths_and_two_runs_on_one_text(ctx):
    view = next(v for v in fl.VIEWS if v.key == "long_loss_by_position")
    short = trace_run(run_from_model(ctx.model), ctx.input_ids[:, :40], what="all", label="nano40")
    fig, table = cmp.side_by_side(view, ctx, short)  # two lengths: side by side on shared axes
    assert set(table["run"]) == {"nano70", "nano40"}
    assert table[table["run"] == "nano40"]["stop"].max() == 40 and table[table["run"] == "nano70"]["stop"].max() == 70
    assert len(fig.data) >= 2
    other = trace_run(run_from_model(nano_model(seed=1)), ctx.input_ids, what="all", label="seed1")
    _, diff = cmp.difference_view(view, ctx, other)  # two runs on one text: A - B per bin
    a = lc.loss_by_position_table(ctx.trace).set_index("start")["loss"]
    b = lc.loss_by_position_table(other.trace).set_index("start")["loss"]
    for start in (0, 64):
        assert diff[diff["start"] == start]["loss_diff"].item() == pytest.approx(a[start] - b[start], abs=1e-12)


def test_k3lab_long_writes_the_long_context_report(tmp_path, capsys):
    from k3lab.cli import main

    out = tmp_path / "long"
    code = main(["long", "sample_checkpoints/k3-full", "--tokens", "160", "--distances", "16", "--lengths", "64",
                 "--no-static", "--quiet", "--out", str(out)])  # fmt: skip
    said = capsys.readouterr()
    err = said.err + said.out
    assert code == 0, err
    assert "estimate for 160 tokens of k3-full" in err and "8 figures, 0 not applicable, 0 failed" in err
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Long context" in html and "Loss by position" in html and "Recall by distance" in html
    assert "KDA distance profile over position" in html and "MQAR accuracy vs length" in html
    with pytest.raises(SystemExit, match="2"):  # the parser's range, stated in --help
        main(["long", "sample_checkpoints/k3-full", "--tokens", "1", "--out", str(tmp_path / "x")])


def test_an_older_trace_without_the_whole_text_arrays_still_draws(whole, tmp_path):
    """A trace saved before issue 24 (maps from position 0, no blocked statistics, no bins, no state rank) opens
    and gives the same long-context and degradation numbers from its maps and whole arrays."""
    from analysis.metrics import attention as at
    from k3core.interp.trace import Trace

    old = Trace(meta={k: v for k, v in whole.trace.meta.items() if k != "coverage"})
    for name, array in whole.trace.arrays.items():
        new = name == "position_bins" or name.startswith("hidden_bins.") or name.split(".")[-1] in (
            "entropy", "sink", "received", "rank", "bins")  # fmt: skip
        if not new:
            old.add(name, array, whole.trace.axes[name])
    loaded = Trace.load(old.save(tmp_path / "old.trace.npz"))
    assert "blocks.3.mla.attn.entropy" not in loaded and "position_bins" not in loaded
    for table in (lc.mla_by_position_table, lc.decay_horizon_table, lc.loss_by_position_table):
        a, b = table(whole.trace), table(loaded)
        np.testing.assert_allclose(a.select_dtypes("number"), b.select_dtypes("number"), rtol=1e-5, atol=1e-6)
    assert lc.kda_state_by_position_table(loaded)["state_rank"].isna().all()
    np.testing.assert_allclose(
        at.attention_sink_table(loaded)["first_token_mass"],
        at.attention_sink_table(whole.trace)["first_token_mass"],
        rtol=1e-5,
    )
