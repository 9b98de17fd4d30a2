"""Diagnostics over every position (issue 24): blocked attention statistics, whole-text moments, linear memory.

Tolerances: the blocked statistics and the full-matrix reference are both fp32 on the same scores, so they agree
to fp32 rounding of a softmax over <= 70 keys: rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from analysis.metrics import attention as at
from analysis.metrics import hidden_states as hs
from analysis.metrics import kda_memory as km
from k3core.interp.attention_stats import attention_probabilities, blocked_attention_stats, position_bins
from k3core.interp.recorder import record
from tests.conftest import nano_model

RTOL, ATOL = 1e-5, 1e-6


def _reference(q, k, scale, visible):
    probs = attention_probabilities(q, k, visible, scale).double().numpy()  # [B, H, T, T], the full matrix
    T = probs.shape[-1]
    return probs, {
        "entropy": at.causal_row_entropy(probs) if visible is None else None,
        "sink": probs[..., 0],
        "received": np.where(np.tril(np.ones((T, T), bool)), probs, 0).sum(-2),
    }


@pytest.mark.parametrize("block", [1, 7, 128])
def test_blocked_statistics_equal_the_full_probability_matrix(block):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 37, 8, generator=g) * 2, torch.randn(2, 3, 37, 8, generator=g) * 2
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    probs, ref = _reference(q, k, 0.35, causal)
    got = blocked_attention_stats(q, k, 0.35, block=block, window=(5, 20))
    ent = -(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0)).sum(-1)
    np.testing.assert_allclose(got["entropy"].numpy(), ent, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["sink"].numpy(), ref["sink"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["received"].numpy(), ref["received"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["map"].numpy(), probs[:, :, 5:20, 5:20], rtol=RTOL, atol=ATOL)
    # the same through analysis.metrics.attention's functions on the full matrix
    np.testing.assert_allclose(got["entropy"].numpy(), at.causal_row_entropy(probs), rtol=RTOL, atol=ATOL)
    received = at.attention_received(probs)
    np.testing.assert_allclose(at.mean_received(got["received"].numpy()), received, rtol=RTOL, atol=ATOL)


def test_blocked_statistics_follow_a_written_key_mask():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    visible = torch.ones(20, 20, dtype=torch.bool).tril()
    visible[:, 3] = False  # an edit hides key 3 from everyone ...
    visible[0, 0] = False  # ... and query 0 sees nothing: its statistics are 0, not NaN
    probs, ref = _reference(q, k, 0.5, visible)
    got = blocked_attention_stats(q, k, 0.5, visible=visible, block=6)
    ent = -(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0)).sum(-1)
    np.testing.assert_allclose(got["entropy"].numpy(), ent, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["received"].numpy(), ref["received"], rtol=RTOL, atol=ATOL)
    assert got["received"][..., 3].abs().max() == 0 and got["entropy"][..., 0].abs().max() == 0


def test_position_bins_double_and_end_at_the_text_length():
    assert position_bins(1) == [0, 1] and position_bins(16) == [0, 16] and position_bins(17) == [0, 16, 17]
    assert position_bins(100) == [0, 16, 32, 64, 100]
    assert position_bins(65536)[-2:] == [32768, 65536]
    with pytest.raises(ValueError):
        position_bins(0)


@pytest.fixture(scope="module")
def traces():
    """One forward recorded twice: the whole text in every array, and with a 20-token window and a map window."""
    model = nano_model()
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record(model, what="all", max_batch=2, window=None, max_attn_len=70) as full:
        model(ids, labels=ids)
    with torch.no_grad(), record(model, what="all", max_batch=2, window=20, attn_window=(30, 50)) as part:
        model(ids, labels=ids)
    return model, full, part


def test_recorded_statistics_equal_the_recorded_map_and_cover_every_position(traces):
    _, full, part = traces
    for layer in at.statistic_layers(full):
        attn = full[f"blocks.{layer}.mla.attn"].astype(np.float64)  # the whole map (70 <= max_attn_len)
        np.testing.assert_allclose(
            full[f"blocks.{layer}.mla.attn.entropy"], at.causal_row_entropy(attn), rtol=RTOL, atol=ATOL
        )
        np.testing.assert_allclose(full[f"blocks.{layer}.mla.attn.sink"], attn[..., 0], rtol=RTOL, atol=ATOL)
        received = full[f"blocks.{layer}.mla.attn.received"]
        np.testing.assert_allclose(at.mean_received(received), at.attention_received(attn), rtol=RTOL, atol=ATOL)
        # the windowed trace: statistics over all 70 positions, the map only for queries 30..49 (keys 30..49)
        assert part[f"blocks.{layer}.mla.attn.entropy"].shape[-1] == 70
        np.testing.assert_allclose(
            part[f"blocks.{layer}.mla.attn.entropy"], full[f"blocks.{layer}.mla.attn.entropy"], rtol=RTOL, atol=ATOL
        )
        np.testing.assert_allclose(part[f"blocks.{layer}.mla.attn"], attn[:, :, 30:50, 30:50], rtol=RTOL, atol=ATOL)
        assert part.meta["coverage"][f"blocks.{layer}.mla.attn"] == [30, 50]
        assert part.meta["coverage"][f"blocks.{layer}.mla.attn.entropy"] == [0, 70]
    assert part.meta["attn_window"] == [30, 50]
    assert part["hidden"].shape[2] == 20 and part.meta["coverage"]["hidden"] == [0, 20]
    assert part.meta["coverage"]["hidden_rms"] == [0, 70] and part.meta["coverage"]["blocks.0.kda.g"] == [0, 20]
    np.testing.assert_array_equal(part["position_bins"], [0, 16, 32, 64, 70])
    # the tables read the statistics: same values from either trace
    for table in (at.attention_entropy_table, at.attention_sink_table, at.entropy_by_position_table):
        a, b = table(full), table(part)
        np.testing.assert_allclose(a.select_dtypes("number"), b.select_dtypes("number"), rtol=RTOL, atol=ATOL)


def test_whole_text_hidden_state_tables_from_moments_equal_the_direct_ones(traces):
    """rank_collapse_table / layer_redundancy_table on a 20-token window use the moments of all 70 positions and
    give the values computed directly from the 70 states (float64 moments: 1e-9; effective rank via the
    eigenvalues of the centred Gram: 1e-6)."""
    _, full, part = traces
    assert hs.hidden_covered_positions(part) == 70
    for table, tol in ((hs.rank_collapse_table, 1e-6), (hs.layer_redundancy_table, 1e-9)):
        a, b = table(full), table(part)
        np.testing.assert_allclose(a.select_dtypes("number"), b.select_dtypes("number"), rtol=tol, atol=tol)
    by_bin = hs.rank_collapse_by_position_table(part)
    h = full["hidden"].astype(np.float64)
    one = by_bin[(by_bin["depth"] == 2) & (by_bin["bin"] == 2)].iloc[0]  # positions 32..63 at depth 2
    direct = np.mean([hs.rank_collapse_ratio(h[2, b, 32:64]) for b in range(2)])
    assert (one["start"], one["stop"]) == (32, 64)
    np.testing.assert_allclose(one["ratio"], direct, rtol=1e-9)
    np.testing.assert_allclose(
        one["effective_rank"], np.mean([hs.effective_rank(h[2, b, 32:64]) for b in range(2)]), rtol=1e-6
    )


def test_kda_state_rank_and_binned_decay(traces):
    _, full, part = traces
    for i in full.layer_indices("kda"):
        final = full[f"blocks.{i}.kda.state"].astype(np.float64)  # the state after all 70 tokens
        last = full[f"blocks.{i}.kda.chunk_state.rank"][:, -1]  # [batch, head] at the last step (token 70)
        assert full[f"blocks.{i}.kda.chunk_state.token"][-1] == 70
        want = [[hs.effective_rank(final[b, h], center=False) for h in range(final.shape[1])] for b in range(2)]
        np.testing.assert_allclose(last, want, rtol=1e-4)
        g = full[f"blocks.{i}.kda.g"].astype(np.float64)
        np.testing.assert_allclose(part[f"blocks.{i}.kda.g.bins"][:, 3], g[:, 64:70].mean(1), rtol=1e-5, atol=1e-6)
    ranks = km.kda_state_rank(full)
    assert len(ranks) > 0


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time, torch
    from tests.conftest import nano_model
    from k3core.interp.recorder import record

    torch.set_num_threads(1)
    T = int(sys.argv[1])
    model = nano_model()
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record(model, what="all"):
        model(ids[:, :64], labels=ids[:, :64])  # warm up: allocator pools and lazy imports
    # the process's current RSS sampled every millisecond during the forward (ru_maxrss would be the peak of
    # the imports and model build, above which a short text does not climb)
    page = os.sysconf("SC_PAGE_SIZE") // 1024
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page  # noqa: E731
    before, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with torch.no_grad(), record(model, what=sys.argv[2]) as trace:
        model(ids, labels=ids)
    peak[0] = max(peak[0], rss())
    done.set()
    sampler.join()
    peak = peak[0]
    covered = trace.meta["coverage"].get("blocks.3.mla.attn.entropy", [0, 0])[1]
    print(json.dumps({"growth_kb": peak - before, "covered": covered}))
    """
)


def _peak(T: int, what: str = "all") -> dict:
    # A fixed mmap threshold: every large buffer is its own mapping, returned when freed, so the peak RSS is the
    # peak of live memory and not of glibc's reuse pattern (with the dynamic threshold the same run varied 3x).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(T), what], capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_record_memory_grows_linearly_with_length():
    """Peak RSS growth (sampled each millisecond in a fresh subprocess per length) of a forward inside
    record(what="all") on the nano model, covering every position: at 8,192 tokens at most 2.5x that at 4,096
    (quadratic would be 4x). The model runs as it is (its MLA attention in O(T) memory, k3core.ops.attention), so
    this is the memory of the recorder and the engine together."""
    short, long = _peak(4096), _peak(8192)
    assert short["covered"] == 4096 and long["covered"] == 8192  # the entropy covers every position
    ratio = long["growth_kb"] / max(short["growth_kb"], 1)
    assert ratio <= 2.5, (short, long, ratio)
