"""Running from the checkpoint files under a memory budget (k3core.loading.expert_store, k3core.loading.streamed_run):
the streamed forward is the resident forward (logits and every trace array), experts are read once each and only when
chosen, hits and misses are counted, and a budget too small for one layer is a clear error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3core.interp.trace import TraceNames
from k3core.interp.trace_size import trace_estimate
from k3core.loading.expert_store import StreamStopped, budget_for
from k3core.loading.folder import CheckpointFiles
from k3core.loading.streamed_run import load_streamed, plan_for_path
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.model import K3ForCausalLM
from k3core.utils.units import parse_bytes
from tests.conftest import nano_model, random_ids, traced

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "sample_checkpoints" / "k3-mxfp4"


def _tight_budget(path: Path, dense: str, experts: int) -> int:
    """A budget that holds the working set and ``experts`` cached experts, no more."""
    plan = plan_for_path(path, K3ForCausalLM, max_memory=10**12, dense=dense, trace_estimate=trace_estimate)
    return plan.resident_bytes + plan.working_bytes + experts * plan.expert_stored_bytes


KDA_SHARES = re.compile(r"blocks\.(\d+)\.kda\.attn\.(entropy|sink|negative)$")


def _share_tolerance(b, name: str, tol: float) -> np.ndarray | None:
    """The tolerance of a KDA implicit-attention share at each query, from the map ``blocks.i.kda.attn`` (the whole
    text here: its window starts at 0). A share p_ts = |A[t, s]| / z_t, z_t = sum_s |A[t, s]|, moves by about
    dA / z_t when A moves by dA: its tolerance is the map's own (tol x its scale) over z_t. Rows whose weights
    nearly vanish (z_t ~ 0.01 at query 1 of this text) make their shares ill-conditioned, not wrong."""
    found = KDA_SHARES.match(name)
    if not found:
        return None
    attn = np.abs(np.asarray(b[f"blocks.{found.group(1)}.kda.attn"], dtype=np.float64))  # [B, H, Q, K]
    z = attn.sum(-1)
    keys = attn.shape[-1]
    bound = tol * max(1.0, float(attn.max())) / np.maximum(z, 1e-30)
    if name.endswith("entropy"):
        bound *= max(1.0, np.log(keys))  # dH = -sum (log p + 1) dp
    return bound


def _same_traces(a, b, tol: float = 1e-6) -> None:
    """Every array within ``tol`` of its scale; the KDA shares within their conditioned tolerance
    (``_share_tolerance``)."""
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = np.asarray(a[name], dtype=np.float64), np.asarray(b[name], dtype=np.float64)
        assert x.shape == y.shape, name
        scale = max(1.0, float(np.nanmax(np.abs(y)))) if y.size else 1.0
        atol = tol * scale
        share = _share_tolerance(b, name, tol)
        if share is not None and share.shape == y.shape:
            atol = np.maximum(atol, share)
        assert np.allclose(x, y, rtol=0, atol=atol, equal_nan=True), name


@pytest.mark.parametrize("dense", ["stream", "resident"])
def test_streamed_forward_is_the_resident_forward(dense):
    """The MXFP4 sample (K3-shaped, experts stored back to back): every trace array within 1e-6 of its scale (KDA's
    implicit-attention shares within that over their row's total weight: ``_share_tolerance``)."""
    budget = _tight_budget(SAMPLE, dense, experts=3)
    resident = K3ForCausalLM.from_pretrained(SAMPLE).eval()
    streamed = load_streamed(
        SAMPLE, K3ForCausalLM, max_memory={"cpu": budget}, dense=dense, trace_estimate=trace_estimate
    )
    session = streamed.loading.streaming
    assert session.plan.dense_resident == (dense == "resident")
    total_experts = 7 * 8
    assert session.plan.cache_experts == 3 < total_experts
    # nothing of the experts (or, streaming, of the dense parts) is in memory before the forward
    assert streamed.model.layers[1].block_sparse_moe.experts.w1.is_meta
    assert streamed.model.layers[1].self_attn.q_proj.weight.is_meta == (dense == "stream")
    ids = torch.tensor([list(b"To be, or not to be, that is the question:")])
    want, got = traced(resident, ids), traced(streamed, ids)
    _same_traces(got, want)
    stats = session.stats()
    chosen = {(i, int(e)) for i in range(1, 8) for e in np.unique(want[TraceNames.moe_experts(i)])}
    # one forward uses each chosen expert once per layer: every use is a miss, and nothing else is read
    assert stats["expert_misses"] == len(chosen) and stats["expert_hits"] == 0
    assert stats["expert_bytes_read"] == len(chosen) * session.plan.expert_stored_bytes
    # each chosen expert is one read of its six back-to-back tensors
    assert stats["expert_reads"] == stats["expert_misses"]
    # streaming: the weights were dropped again after the forward
    if dense == "stream":
        assert streamed.model.layers[1].self_attn.q_proj.weight.is_meta
    session.close()


def test_streamed_unquantised_model_matches(tmp_path):
    model = nano_model(seed=2)
    model.save_pretrained(tmp_path / "nano")
    budget = _tight_budget(tmp_path / "nano", "stream", experts=2)
    streamed = K3ForCausalLM.from_pretrained(
        tmp_path / "nano", max_memory={"cpu": budget}, stream=True, trace_estimate=trace_estimate
    )
    ids = random_ids(T=24, B=2, seed=3)
    _same_traces(traced(streamed, ids), traced(model, ids))
    stats = streamed.loading.streaming.stats()
    assert stats["expert_hits"] == 0 and stats["expert_misses"] > 0
    # a second forward: with 2 experts cached per store, a layer-by-layer sweep finds none of its own (LRU) ...
    with torch.no_grad():
        streamed(ids)
    assert streamed.loading.streaming.stats()["expert_misses"] == 2 * stats["expert_misses"]
    # ... with room for every expert, the second forward reads no expert at all
    roomy = _tight_budget(tmp_path / "nano", "stream", experts=10**4)
    cached = K3ForCausalLM.from_pretrained(
        tmp_path / "nano", max_memory={"cpu": roomy}, stream=True, trace_estimate=trace_estimate
    )
    with torch.no_grad():
        first = cached(ids).logits
        read = cached.loading.streaming.stats()["expert_bytes_read"]
        assert torch.equal(cached(ids).logits, first)
    again = cached.loading.streaming.stats()
    assert again["expert_hits"] == stats["expert_misses"] and again["expert_bytes_read"] == read


def test_plan_reads_what_it_says(tmp_path):
    plan = plan_for_path(SAMPLE, K3ForCausalLM, max_memory="2GB", dense="stream", trace_estimate=trace_estimate)
    text = plan.describe(tokens=8)
    assert "routed experts" in text and "reads up to" in text and "MXFP4" in text
    files = CheckpointFiles.open(SAMPLE)
    dense = sum(i.nbytes for n, i in files.tensors.items() if ".experts." not in n and "embed_tokens" not in n)
    small = sum(
        i.nbytes
        for n, i in files.tensors.items()
        if ".experts." not in n
        and not any(k in n for k in (".self_attn.", ".mlp.", ".block_sparse_moe.", "lm_head."))
        and "embed_tokens" not in n
    )
    assert plan.stored_dense_stream_bytes == dense - small
    assert (
        plan.prompt_bytes(1) == plan.stored_dense_stream_bytes + plan.embed_row_bytes + 7 * 2 * plan.expert_stored_bytes
    )
    assert plan.expected_seconds(8) == pytest.approx(plan.prompt_bytes(8) / plan.read_speed)


def test_budget_too_small_for_one_layer_is_named():
    with pytest.raises(CheckpointError, match=r"budget of 0\.10 GB is too small for one layer.*needs at least"):
        load_streamed(SAMPLE, K3ForCausalLM, max_memory={"cpu": "100MB"}, trace_estimate=trace_estimate)
    with pytest.raises(ValueError, match="cannot read the memory budget"):
        budget_for({"cpu": "lots"}, "cpu")
    assert parse_bytes("6GB") == 6 * 10**9 and parse_bytes("1.5GiB") == 3 * 2**29


def test_progress_reports_layers_and_stop():
    seen = []

    def progress(info):
        seen.append(info)
        return info["layer"] == 3

    model = load_streamed(
        SAMPLE, K3ForCausalLM, max_memory="2GB", dense="stream", progress=progress, trace_estimate=trace_estimate
    )
    with pytest.raises(StreamStopped, match="layer 3 of 8"):
        model(torch.tensor([list(b"abc")]))
    assert [i["layer"] for i in seen] == [0, 1, 2, 3]
    assert seen[-1]["bytes_read"] > seen[0]["bytes_read"] and seen[-1]["expert_misses"] > 0


def test_cli_generate_with_max_memory_prints_the_plan_and_matches(capsys):
    from k3lab.cli import main

    args = ["generate", str(SAMPLE), "--tokens", "6", "--temperature", "0", "--prompt", "ROMEO:"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--max-memory", "1GB"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert (
        "streaming plan" in out.err
        and "reads up to" in out.err
        and "expected" not in out.err.lower()
        or "s at" in out.err
    )
    assert main([*args, "--max-memory", "50MB"]) == 2
    assert "too small for one layer" in capsys.readouterr().err
    assert main([*args, "--max-memory", "plenty"]) == 2
    assert "cannot read the memory budget" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the app
def test_app_runs_a_checkpoint_streamed_within_a_memory_budget(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from app.library import run_list as uploads
    from app.server.settings import HOME_ENV

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(uploads.RUNS_ENV, str(SAMPLE))
    empty = tmp_path / "no-samples"
    empty.mkdir()
    monkeypatch.setattr(uploads, "SAMPLES_DIR", empty)
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=180)
    at.session_state["k3lab_max_tokens"] = 48
    at.session_state["k3lab_max_memory"] = "50MB"
    at.run()
    assert not at.exception, at.exception
    # a budget too small for one layer: the figures are named, the app keeps running
    assert any("too small for one layer" in e.value for e in at.error)
    # a workable budget: the plan and the expected time first, nothing runs until asked
    at.sidebar.text_input(key="k3lab_max_memory").set_value("1GB").run()
    assert not at.exception, at.exception
    plan = " ".join(i.value for i in at.info)
    assert "runs from its files within 1GB" in plan and "reads up to" in plan and "routed experts" in plan
    run_button = at.button(key="k3lab_stream_run")
    assert "Run streamed" in run_button.label
    # only what config.json gives (the layer map) is drawn; no forward has run, so no headline numbers
    assert [chart.key for chart in at.get("plotly_chart")] == ["fig-density_allocation"]
    assert "loss (nats/token)" not in {m.label for m in at.metric}
    run_button.click().run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == []
    assert "loss (nats/token)" in {m.label for m in at.metric}
    from app.render import caching

    run = caching._cached_run(caching.run_fingerprint(str(SAMPLE)), "cpu", "float32", str(SAMPLE), "", "1GB")
    stats = run.model.loading.streaming.stats()
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0
    # Stop: the next rerun asks again before it runs anything
    at.button(key="k3lab_stream_stop").click().run()
    assert not at.exception and any("Stopped" in w.value for w in at.warning)
    at.run()
    assert "Run streamed" in at.button(key="k3lab_stream_run").label
    # an unreadable budget is said so in the sidebar; the page runs resident (the same trace, already made)
    at.sidebar.text_input(key="k3lab_max_memory").set_value("plenty").run()
    assert not at.exception and any("cannot read the memory budget" in e.value for e in at.sidebar.error)
    assert len(at.get("plotly_chart")) > 0


CHURN = """
import collections, random, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from k3core.loading.expert_store import return_freed_memory
assert return_freed_memory()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
base, peak, size, cap = rss(), 0, 8_000_000, 60
cache, rng, pool = collections.OrderedDict(), random.Random(0), ThreadPoolExecutor(4)
def read(_):
    return torch.ones(size, dtype=torch.uint8)
for layer in range(30):
    keys = [(layer, rng.randrange(896)) for _ in range(24)]
    for key, future in zip(keys, [pool.submit(read, k) for k in keys]):
        cache[key] = future.result()
        while len(cache) > cap:
            cache.popitem(last=False)
    peak = max(peak, rss())
print((peak - base) / (cap * size))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="glibc and /proc")
def test_evicted_expert_buffers_leave_the_resident_set():
    """An LRU of 8 MB buffers read in threads, as the expert cache turns over: the resident set grows by the
    live buffers only. Without ``return_freed_memory`` glibc serves such buffers from its arenas after the first
    frees and the evicted ones stay resident (2.24x the live bytes measured with this churn)."""
    out = subprocess.run([sys.executable, "-c", CHURN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1.15
