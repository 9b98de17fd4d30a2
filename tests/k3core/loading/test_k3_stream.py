"""Kimi K3 at full width (hidden 7168, 896 MXFP4 experts per layer), depth-truncated to its dense first layer
and one MoE layer (benchmarks/k3_replica.py, planted by benchmarks/bench_k3_stream.build): `weights --experts`
reports the planted MXFP4 expert norms exactly, and a traced forward of 8 tokens (bf16, as a real run would
compute; the replica's holes are not read, which changes no byte count) runs under a 6 GB budget with peak
RSS <= 7 GB, reading no more than 1.05 x what it must (dense bytes of the layers, the LM head, the prompt's
embedding rows, the distinct experts chosen). About 15 s of CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from benchmarks.k3_replica import mxfp4_decode

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    from benchmarks.bench_k3_stream import build

    folder = tmp_path_factory.mktemp("k3-stream") / "Kimi-K3-2"
    info = build(folder, layers=2)
    return folder, info


def _planted_experts(folder: Path) -> dict[tuple[int, int], dict[str, tuple[np.ndarray, np.ndarray]]]:
    from benchmarks.bench_k3_stream import TOKENS
    from benchmarks.k3_replica import forward_plants, k3_config_json, model_shapes

    config = k3_config_json(num_layers=2)
    return forward_plants(config, model_shapes(config), TOKENS)[1]


@pytest.mark.slow
def test_weights_experts_reports_planted_mxfp4_norms_exactly(replica, tmp_path):
    folder, _ = replica
    out = tmp_path / "weights"
    proc = subprocess.run(
        [sys.executable, "-m", "k3lab.cli", "weights", str(folder), "--experts", "--out", str(out), "--no-static"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pd.read_csv(out / "figures" / "weights_expert_norms.csv").set_index(["layer", "expert"])
    assert len(table) == 896  # one MoE layer
    planted = _planted_experts(folder)
    assert len(planted) == 4
    for key, parts in planted.items():
        row = table.loc[key]
        squares = {w: float(np.sum(mxfp4_decode(*parts[w]) ** 2)) for w in ("w1", "w2", "w3")}
        for w, sq in squares.items():
            assert row[f"{w}_norm"] == math.sqrt(sq), (key, w)
        assert row["norm"] == math.sqrt(sum(squares.values()))
    others = table.drop(list(planted))
    assert (others["norm"] == 0).all()  # the holes are zero experts


@pytest.mark.slow
def test_traced_forward_of_8_tokens_within_6gb(replica):
    folder, _ = replica
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_k3_stream", "--child", str(folder), "--tokens", "8",
         "--budget", "6GB", "--dtype", "bfloat16", "--skip-holes", "--what", "all"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shown = {k: v for k, v in result.items() if k != "plan"}
    print(f"\nfull-width K3, 2 layers, 8 tokens under 6 GB: {json.dumps(shown)}")
    assert result["logits_finite"] and result["trace_arrays"] > 20
    assert not result["dense_resident"]  # 2 layers of dense parts + embedding + LM head do not fit in 6 GB
    assert result["peak_rss"] <= 7 * 10**9
    assert result["read_over_floor"] <= 1.05
    # tokens chose different experts among the 24 their router favours; each was read once, in one read
    assert 16 < result["distinct_experts"] <= 24
    assert result["expert_misses"] == result["expert_reads"] == result["distinct_experts"]
    assert result["bytes_read"] <= result["planned_prompt_bytes"]


@pytest.fixture(scope="module")
def replica4(tmp_path_factory):
    from benchmarks.bench_k3_stream import build

    folder = tmp_path_factory.mktemp("k3-stream-4") / "Kimi-K3-4"
    build(folder, layers=4)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(900)  # two fresh processes, each 8 tokens through 4 full-width layers: ~2-3 min each here
def test_default_record_of_4_full_width_layers_stays_under_7gb(replica4):
    """4 decoder layers at width 7,168 (896 MXFP4 experts each), bf16 under 6 GiB: the default ``record(model)``
    forward of 8 tokens peaks under 7 GB RSS, within 0.5 GB of the same forward without a recorder (each in its own
    process; the hidden-state Gram matrices are sketched at this width: 8.05 GB before), and holds what
    ``record_bytes`` estimated before the forward."""
    from benchmarks.bench_k3_stream import child

    traced = child(replica4, 8, "6GiB", "bfloat16", skip_holes=True, what="default")
    plain = child(replica4, 8, "6GiB", "bfloat16", skip_holes=True, what="none")
    print(
        f"\nK3 replica, 4 layers, 8 tokens, 6 GiB: record() forward peak {traced['peak_rss'] / 1e9:.2f} GB, plain "
        f"forward peak {plain['peak_rss'] / 1e9:.2f} GB; trace {traced['trace_bytes'] / 1e6:.1f} MB (estimated "
        f"{traced['estimated_trace_bytes'] / 1e6:.1f} MB)"
    )
    assert traced["logits_finite"] and traced["trace_arrays"] > 20 and plain["trace_arrays"] == 0
    assert traced["peak_rss"] < 7 * 10**9
    assert traced["peak_rss"] - plain["peak_rss"] < 0.5 * 10**9
    assert traced["trace_bytes"] <= traced["estimated_trace_bytes"] <= 1.1 * traced["trace_bytes"]


def test_the_streamed_plan_counts_a_default_trace(replica):
    """The plan keeps room for a default trace of 8 tokens (``record_bytes``, counted in the working set against the
    budget) and says, before a run, what a trace of the prompt holds against it."""
    import torch

    from k3core.interp.trace_size import record_bytes, trace_estimate
    from k3core.loading.pretrained import load_config
    from k3core.loading.streamed_run import plan_for_path
    from k3core.modeling.model import K3ForCausalLM

    folder, _ = replica
    plan = plan_for_path(
        folder, K3ForCausalLM, dtype=torch.bfloat16, max_memory={"cpu": "6GiB"}, trace_estimate=trace_estimate
    )
    config = load_config(folder)
    assert plan.trace_tokens == 8 and plan.trace_bytes == record_bytes(config, 8).total
    assert plan.trace_bytes <= plan.working_bytes
    text = plan.describe(tokens=8)
    assert "a default trace of 8 tokens holds" in text and "within the working set" in text
    long = plan.trace_line(200_000)
    assert f"holds {record_bytes(config, 200_000).total / 1e9:.2f} GB" in long and "OVER the budget" in long
