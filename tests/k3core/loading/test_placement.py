"""device="auto" with accelerate: the plan before loading, and CPU / disk offload giving identical logits and traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3core.interp.recorder import record
from k3core.loading.folder import CheckpointFiles
from k3core.loading.placement import Plan
from k3core.modeling.model import K3ForCausalLM
from tests.conftest import nano_model, randomize_attnres_queries

RESIDUALS = ["block_attnres", "full_attnres", "scale_bias", "plain"]


def _saved(tmp_path_factory, residual: str):
    model = nano_model(residual=residual)
    randomize_attnres_queries(model) if residual.endswith("attnres") else None
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.05)
    path = tmp_path_factory.mktemp(residual)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module", params=RESIDUALS)
def saved(request, tmp_path_factory):
    return _saved(tmp_path_factory, request.param)


def _model_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _cpu_budget(path) -> int:
    """A CPU budget that holds about half of the model: the rest must go to disk."""
    return CheckpointFiles.open(path).bytes_total // 2


def test_plan_offloads_to_disk_before_loading(saved):
    model, path = saved
    plan = K3ForCausalLM.plan_placement(path, device="auto", max_memory={"cpu": _cpu_budget(path)})
    assert isinstance(plan, Plan) and plan.main_device == "cpu" and plan.offloaded
    assert set(plan.bytes_by_device) == {"cpu", "disk"}
    assert plan.total_bytes == _model_bytes(model)  # every tensor counted once, fp32 here
    assert plan.bytes_by_device["cpu"] <= _cpu_budget(path) + plan.bytes_by_device["cpu"] // 2
    # Decoder layers are never split between devices except for their small resident tensors.
    disk_layers = plan.layers_by_device["disk"]
    assert disk_layers and sorted(disk_layers + plan.layers_by_device.get("cpu", [])) == [0, 1, 2, 3]
    assert "disk" in plan.describe() and "layers" in plan.describe()


def test_plan_single_device_and_bf16():
    plan = K3ForCausalLM.plan_placement("k3-nano", device="cpu", dtype=torch.bfloat16)
    assert plan.device_map == {"": "cpu"} and list(plan.bytes_by_device) == ["cpu"]
    fp32 = K3ForCausalLM.plan_placement("k3-nano", device="cpu").total_bytes
    # bf16 halves everything except the keep-fp32 tensors (gates, convs, router biases...)
    assert fp32 / 2 < plan.total_bytes < 0.6 * fp32


def test_plan_for_a_huge_config_needs_no_memory():
    plan = K3ForCausalLM.plan_placement("kimi-k3", device="auto", dtype=torch.bfloat16, max_memory={"cpu": 10**9})
    assert plan.total_bytes > 5 * 10**12 and plan.bytes_by_device["disk"] > 5 * 10**12


def _trace_and_logits(model, ids):
    with torch.no_grad(), record(model, what="all", max_batch=2) as trace:
        logits = model(ids).logits
    return trace, logits


def test_disk_offload_gives_identical_logits_and_traces(saved, tmp_path, tokens):
    model, path = saved
    plain = K3ForCausalLM.from_pretrained(path)
    offload = tmp_path / "offload"
    placed = K3ForCausalLM.from_pretrained(
        path, device="auto", max_memory={"cpu": _cpu_budget(path)}, offload_folder=offload
    )
    assert placed.loading.placement.offloaded and any(offload.glob("*.dat"))
    # offloaded parameters hold no storage in the model itself
    assert any(p.is_meta for p in placed.parameters())
    t1, l1 = _trace_and_logits(plain, tokens)
    t2, l2 = _trace_and_logits(placed, tokens)
    assert torch.equal(l1, l2)
    assert t1.names() == t2.names() and len(t1.names()) > 10
    for name in t1.names():
        np.testing.assert_array_equal(t1[name], t2[name], err_msg=name)
    # decoding with a cache goes through the same hooks
    assert torch.equal(plain.generate(tokens, max_new_tokens=4), placed.generate(tokens, max_new_tokens=4))


def test_tied_embeddings_offload(tmp_path, tokens):
    model = nano_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "ckpt")
    placed = K3ForCausalLM.from_pretrained(tmp_path / "ckpt", max_memory={"cpu": 1}, offload_folder=tmp_path / "o")
    assert placed.loading.placement.offloaded and placed.lm_head.weight is placed.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(placed(tokens).logits, model(tokens).logits)


def test_temporary_offload_folder_goes_with_the_model(saved):
    import gc

    _, path = saved
    placed = K3ForCausalLM.from_pretrained(path, max_memory={"cpu": _cpu_budget(path)})
    folder = placed.loading.offload_folder
    assert folder is not None and any(folder.glob("*.dat"))
    del placed
    gc.collect()
    assert not folder.exists()


def test_disk_offload_streams_modules_out(tmp_path_factory, tmp_path, tokens):
    """Offloaded expert stacks are assembled from their per-expert tensors, then written to the offload folder."""
    model, path = _saved(tmp_path_factory, "block_attnres")
    placed = K3ForCausalLM.from_pretrained(path, max_memory={"cpu": 1}, offload_folder=tmp_path / "o")
    names = {p.name for p in (tmp_path / "o").glob("*.dat")}
    assert "model.layers.3.block_sparse_moe.experts.w1.dat" in names
    with torch.no_grad():
        assert torch.equal(placed(tokens).logits, model(tokens).logits)


def test_cli_generate_device_auto_prints_the_plan(saved, capsys):
    from k3lab.cli import main

    _, path = saved
    assert main(["generate", str(path), "--tokens", "5", "--temperature", "0", "--prompt", "ab"]) == 0
    plain = capsys.readouterr().out
    assert (
        main(["generate", str(path), "--tokens", "5", "--temperature", "0", "--prompt", "ab", "--device", "auto"]) == 0
    )
    out = capsys.readouterr()
    assert out.out == plain and "placement plan" in out.err and "cpu" in out.err
