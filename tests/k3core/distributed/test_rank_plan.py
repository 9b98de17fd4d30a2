"""The multi-GPU plan (k3core.distributed.rank_plan, `k3lab inspect --plan`): contiguous layer ranges, the fewest GPUs,
the most balanced split, bytes from headers equal to a loaded model's, the sparse Kimi K3 replica answered from
headers."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from k3core.distributed.rank_plan import layer_bytes, plan_for, ranks_needed, sizes_of, split_layers
from k3core.modeling.model import K3ForCausalLM
from k3lab.cli import main as k3lab

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"


def _splits(n: int, parts: int):
    """Every way to cut n layers into ``parts`` contiguous non-empty ranges."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _load(span: range, r: int, parts: int, w: list[int], first: int, last: int) -> int:
    return sum(w[span.start : span.stop]) + (first if r == 0 else 0) + (last if r == parts - 1 else 0)


def test_split_is_the_most_balanced_and_ranks_needed_the_fewest():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        w = [rng.randint(1, 50) for _ in range(n)]
        first, last = rng.randint(0, 40), rng.randint(0, 40)
        for parts in range(1, n + 1):
            best = min(
                max(_load(s, r, parts, w, first, last) for r, s in enumerate(split)) for split in _splits(n, parts)
            )
            plan = split_layers(w, first, last, parts)
            assert [s.layers for s in plan.ranks] and plan.ranks[0].start == 0 and plan.ranks[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(plan.ranks, plan.ranks[1:]))
            assert max(s.nbytes for s in plan.ranks) == best, (w, first, last, parts)
            assert sum(s.nbytes for s in plan.ranks) == sum(w) + first + last
        cap = rng.randint(max(w) + max(first, last), sum(w) + first + last)
        try:
            plan = ranks_needed(w, first, last, cap)
        except ValueError:
            continue
        k = len(plan.ranks)
        assert max(s.nbytes for s in plan.ranks) <= cap
        if k > 1:  # one rank fewer never fits
            assert all(
                max(_load(s, r, k - 1, w, first, last) for r, s in enumerate(sp)) > cap for sp in _splits(n, k - 1)
            )


def test_a_layer_larger_than_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold the largest layer"):
        ranks_needed([10, 200, 10], 0, 0, 100)
    with pytest.raises(ValueError, match="cannot split 3 decoder layers over 4 ranks"):
        split_layers([1, 2, 3], 0, 0, 4)


def test_plan_bytes_from_headers_equal_the_loaded_model(tmp_path):
    """Headers only, in bf16: equal to what the loaded model holds per layer (fp32-kept tensors included)."""
    model = K3ForCausalLM.from_pretrained(SAMPLE, dtype=torch.bfloat16)
    held = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    sizes, layers = sizes_of(str(SAMPLE), torch.bfloat16)
    assert layer_bytes(sizes, layers) == layer_bytes(held, layers)
    assert any(t.dtype == torch.float32 for t in model.state_dict().values())  # the keep-fp32 rule is exercised


def test_inspect_plan_json(capsys):
    assert k3lab(["inspect", str(SAMPLE), "--plan", "--gpu-memory", "2MiB", "--reserve", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == len(out["ranks"]) >= 2
    assert out["ranks"][0]["holds"] == "embedding" and "LM head" in out["ranks"][-1]["holds"]
    assert all(r["bytes"] <= 2 * 2**20 for r in out["ranks"])
    assert k3lab(["inspect", str(SAMPLE), "--plan", "--gpu-memory", "1KB"]) == 2
    assert "cannot hold the largest layer" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_of_the_sparse_kimi_k3_replica_from_headers(sparse_k3):
    sizes, layers = sizes_of(str(sparse_k3.folder), torch.bfloat16)
    with torch.device("meta"):
        meta = K3ForCausalLM(sparse_k3.cfg)
    want = sizes_of("kimi-k3", torch.bfloat16)[0]
    assert layers == 93
    plan = plan_for(sizes, layers, capacity=141 * 10**9 * 9 // 10)
    per_layer = layer_bytes(sizes, layers)[0]
    assert sum(per_layer) > 5e12 and len(plan.ranks) >= 40
    assert plan.total_bytes >= sum(want.values()) - 1e9  # the A_log padding only adds bytes
    assert meta.config.num_hidden_layers == layers
