"""The pipeline-parallel traced forward (k3core.distributed.pipeline, `k3lab trace` under torchrun) on CPU with gloo,
launched by torchrun's own entry point (``python -m torch.distributed.run``) with 2 and 3 processes: the gathered trace
equals the single-process trace (every array, fp32, <= 1e-6), the logits equal; a rank that dies or hangs makes
the others exit naming it and its layers, within the timeout, with nothing written."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.runs import loading as runs_mod
from analysis.runs.trace_writer import read_inputs
from k3core.distributed.pipeline import stage_plan
from k3core.interp.trace_folder import read_trace_dir
from k3core.loading.folder import CheckpointFiles
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from tests.k3core.test_hf_kimi_linear import kimi_linear_type

REPO = Path(__file__).resolve().parents[3]
TEXTS = ("ROMEO:\nBut soft, what light through yonder window breaks?", "To be, or not to be: that is the question.")
MAX_TOKENS = 24
LAUNCH_TIMEOUT = 240
KIMI_MXFP4 = "kimi-linear-5-mxfp4"
# With issue 18's quantised checkpoints (and compressed-tensors to write one) the Kimi-Linear-shaped case has MXFP4
# routed experts; without them it is dense, and every other case still runs.
QUANTISED = all(importlib.util.find_spec(m) is not None for m in ("k3core.loading.quantized", "compressed_tensors"))
KIMI = KIMI_MXFP4 if QUANTISED else "kimi-linear-5"
pytestmark = pytest.mark.slow  # torchrun launches 2-3 processes per test
GRACE = 10  # seconds for torchrun to notice the exits and stop the hung rank, on a loaded 2-core machine


def _configs():
    # k3-nano with blocks of 3 layers: blocks [0-2] [3] straddle the 2-rank (0-1 | 2-3) and 3-rank boundaries
    nano = from_preset("k3-nano", attn_res_block_size=3)
    # 5 Kimi-Linear-shaped layers: KDA + MLA at layers 1 and 4, dense first layer then MoE, plain residual
    kimi = kimi_linear_type(name="kimi-linear-5", vocab_size=256, num_hidden_layers=5, full_attn_layers=[2, 5],
                            first_k_dense_replace=1)  # fmt: skip
    return {"k3-nano": nano, "kimi-linear-5": kimi}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(3)
        # the Kimi-Linear-shaped one in many shards: each rank opens only the shards of its own layers
        shard = 40_000 if name == "kimi-linear-5" else 2 * 1024**3
        out[name] = K3ForCausalLM.from_config(cfg).save_pretrained(root / name, max_shard_bytes=shard)
    for i, text in enumerate(TEXTS):
        (root / f"text{i}.txt").write_text(text)
    if QUANTISED:  # the Kimi-Linear-shaped layers with MXFP4 routed experts (compressed-tensors' own compressor)
        from tests.k3core.loading.test_quantized import quantise_folder

        widths = dict(hidden_size=64, moe_intermediate_size=32, q_lora_rank=None)  # MXFP4 groups of 32
        cfg = kimi_linear_type(name="kimi-linear-5", vocab_size=256, num_hidden_layers=5, full_attn_layers=[2, 5],
                               first_k_dense_replace=1, **widths)  # fmt: skip
        torch.manual_seed(4)
        dense = K3ForCausalLM.from_config(cfg).save_pretrained(root / "kimi-dense")
        quantise_folder(dense, root / KIMI_MXFP4, "mxfp4-pack-quantized", ".experts.")
        out[KIMI_MXFP4] = root / KIMI_MXFP4
    out["root"] = root
    return out


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: float = LAUNCH_TIMEOUT, fault: str = ""):
    """``torchrun --standalone --nproc-per-node N -m k3lab trace ...`` on gloo; (completed process, seconds).
    ``fault`` "RANK:LAYER:die|hang" runs it through tests/pipeline_fault.py instead."""
    entry = ["tests.pipeline_fault", fault] if fault else ["k3lab", "trace"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", *entry, *args]  # fmt: skip
    full_env = {**os.environ, "K3LAB_BACKEND": "gloo", "PYTHONPATH": str(REPO), **(env or {})}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def _texts(checkpoints) -> list[str]:
    return [a for i in range(len(TEXTS)) for a in ("--text", str(checkpoints["root"] / f"text{i}.txt"))]


@pytest.mark.parametrize("name,nproc", [("k3-nano", 2), ("k3-nano", 3), (KIMI, 2), (KIMI, 3)])
def test_gathered_trace_equals_the_single_process_trace(checkpoints, tmp_path, name, nproc):
    path = checkpoints[name]
    out = tmp_path / "trace"
    args = [str(path), *_texts(checkpoints), "--max-tokens", str(MAX_TOKENS), "--out", str(out), "--logits"]
    proc, _ = torchrun(nproc, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = CheckpointFiles.open(path)
    plan = stage_plan(files.config, torch.float32, nproc)
    if name == "k3-nano":  # an AttnRes block is split over two ranks: the partial block sum travels
        bounds = [s.start for s in plan.ranks[1:]]
        assert any(b % files.config.attn_res_block_size for b in bounds), bounds
    folder = read_trace_dir(out)
    made = folder.card["made"]
    assert made["world_size"] == nproc and made["backend"] == "gloo"
    assert [r["layers"] for r in made["ranks"]] == [[s.start, s.stop] for s in plan.ranks]
    for r, share in zip(made["ranks"], plan.ranks):  # each rank read its own tensors only
        own = sum(i.nbytes for n, i in files.tensors.items() if _on_rank(n, share, plan, files.config))
        assert r["bytes_read"] == own

    run = runs_mod.load_run(path)
    torch.set_num_threads(1)  # as torchrun runs each rank: the same summation order in the matmuls
    for i, chosen in enumerate(read_inputs(run, [checkpoints["root"] / f"text{k}.txt" for k in range(2)], None,
                                           MAX_TOKENS)):  # fmt: skip
        want = runs_mod.trace_run(run, chosen, what="all").trace
        got = folder.trace(i)
        wanted = want.arrays  # every item, the whole-text hidden-state moments included (rank 0 adds boundary pairs)
        assert sorted(set(got.arrays) - {"logits"}) == sorted(wanted)
        for key, array in wanted.items():
            assert got.axes[key] == want.axes[key], key
            assert got[key].dtype == array.dtype, key
            if array.dtype.kind == "f":
                np.testing.assert_allclose(got[key], array, rtol=0, atol=1e-6, err_msg=key)
            else:
                np.testing.assert_array_equal(got[key], array, err_msg=key)
        assert got.meta["attnres_sources" if "attnres_sources" in want.meta else "config"] == want.meta.get(
            "attnres_sources", want.meta["config"]
        )
        assert got.meta["run"]["loss"] == pytest.approx(want.meta["run"]["loss"], abs=1e-6)
        with torch.no_grad():
            logits = run.model(chosen.input_ids).logits
        np.testing.assert_allclose(got["logits"], logits.numpy(), rtol=0, atol=1e-6)


def _on_rank(name: str, share, plan, config) -> bool:
    from k3core.distributed.pipeline import owned_prefixes

    return name.startswith(
        owned_prefixes(config, share.start, share.stop, share.rank == 0, share.rank == len(plan.ranks) - 1)
    )


@pytest.mark.parametrize("kind", ["die", "hang"])
def test_a_rank_that_dies_or_hangs_stops_the_others_with_its_name(checkpoints, tmp_path, kind):
    path = checkpoints["k3-nano"]
    out = tmp_path / "trace"
    timeout = 6
    args = [
        str(path),
        *_texts(checkpoints),
        "--max-tokens",
        str(MAX_TOKENS),
        "--out",
        str(out),
        "--timeout",
        str(timeout),
    ]
    proc, seconds = torchrun(3, args, fault=f"1:1:{kind}")
    ended = time.time()
    text = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert "injected fault" in text
    # rank 2 waits for rank 1's residual state; rank 0 for rank 1's trace: both name rank 1 and its layers
    assert "rank 1 (layers 1-1)" in text or "rank 1 (layers 1-" in text, text[-3000:]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".trace")]
    fault_at = float(re.search(r"injected fault \(\w+\) at layer \d+ at t=([0-9.]+)", text).group(1))
    after = ended - fault_at
    print(f"\n{kind}: every rank gone {after:.1f} s after the fault (timeout {timeout} s; {seconds:.1f} s in all)")
    assert after < timeout + GRACE, text[-3000:]


def test_a_node_needs_only_its_own_shards(checkpoints, tmp_path):
    """Shards of layers no rank of this node holds may be absent; a missing own shard is named."""
    import json
    import shutil

    src = checkpoints["kimi-linear-5"]
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3
    plan = stage_plan(CheckpointFiles.open(src).config, torch.float32, 2)
    rank1_only = {f for raw, f in index.items() if raw.startswith(f"model.layers.{plan.ranks[1].stop - 1}.")}
    rank1_only -= {f for raw, f in index.items() if raw.startswith(("model.embed_tokens.", "model.layers.0."))}
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    for f in rank1_only:
        (folder / f).unlink()
    out = tmp_path / "trace"
    proc, _ = torchrun(2, [str(folder), "--text", str(checkpoints["root"] / "text0.txt"), "--out", str(out),
                           "--timeout", "20"])  # fmt: skip
    text = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "this node needs the shards holding its layers; missing" in text, text[-3000:]
    assert "rank 1 (layers" in text and not out.exists(), text[-3000:]
