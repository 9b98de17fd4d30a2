"""transformers' own Kimi Linear (``KimiLinearForCausalLM``, pure-torch CPU paths) as the reference, both ways.

transformers >= 5 ships Kimi Linear natively; its ``save_pretrained`` writes the published key layout
(per-expert ``w1/w2/w3``, separate q/k/v convolutions, the dense layer's MLP as
``block_sparse_moe.{gate,up,down}_proj``) and a config.json with its own field names. Small random
models over several configs must give the same logits (fp32, max relative difference <= 1e-5) and the
same greedy continuation in k3lab, and a k3lab ``save_pretrained`` of a Kimi-Linear-type config must
load in transformers with the same logits.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from k3core.modeling.config import K3Config
from k3core.modeling.hf_config import hf_incompatibility
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

transformers = pytest.importorskip("transformers", minversion="5.0")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

VOCAB = 96
# Several shapes: no q LoRA / q LoRA, one or several MLA layers, one or two dense layers, an all-dense model.
HF_CASES = {
    "no_q_lora": dict(layers=4, full=[2, 4], q_lora_rank=None, first_dense=1, experts=4, top_k=2),
    "q_lora": dict(layers=5, full=[1, 3, 5], q_lora_rank=12, first_dense=2, experts=6, top_k=3),
    "one_mla_two_shared": dict(layers=3, full=[3], q_lora_rank=8, first_dense=1, experts=4, top_k=1, shared=2),
}


def hf_config(layers, full, q_lora_rank, first_dense, experts, top_k, shared=1) -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=shared,
        routed_scaling_factor=2.446,
        linear_attn_config={
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "num_heads": 2,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
        },
        first_k_dense_replace=first_dense,
        initializer_range=0.1,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Non-unit norm weights and non-zero router biases (init leaves them at 1 and 0, hiding mistakes)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("layernorm.weight", "norm.weight")):
            tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def ids(batch: int = 2, tokens: int = 37, seed: int = 0) -> torch.Tensor:
    # 37 tokens: more than one KDA chunk in either implementation, not a multiple of the chunk size.
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    # An explicit all-ones mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding.
    mask = torch.ones_like(prompt)
    out = model.generate(
        prompt, attention_mask=mask, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
    )
    return out[:, prompt.shape[1] :]


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_saved(request, tmp_path_factory):
    """A random transformers Kimi Linear model saved by transformers' own save_pretrained."""
    torch.manual_seed(len(request.param))
    model = KimiLinearForCausalLM(hf_config(**HF_CASES[request.param])).eval()
    perturb(model, seed=1)
    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(folder)
    return request.param, model, folder


def test_transformers_checkpoint_loads_with_the_same_logits(hf_saved):
    name, hf_model, folder = hf_saved
    stored = json.loads((folder / "config.json").read_text())
    assert stored["model_type"] == "kimi_linear"
    ours = K3ForCausalLM.from_pretrained(folder).eval()
    case = HF_CASES[name]
    assert ours.config.full_attn_layers == case["full"] and ours.config.q_lora_rank == case["q_lora_rank"]
    assert ours.config.first_k_dense_replace == case["first_dense"] and ours.config.kda_gate == "softplus"
    x = ids()
    with torch.no_grad():
        want = hf_model(x).logits
        got = ours(x).logits
    assert relative_difference(got, want) <= 1e-5
    # The router biases took part: without them the routing (and so the logits) would differ.
    bias = ours.model.layers[-1].block_sparse_moe.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and bias.dtype == torch.float32


def test_transformers_checkpoint_same_greedy_continuation(hf_saved):
    _, hf_model, folder = hf_saved
    ours = K3ForCausalLM.from_pretrained(folder).eval()
    prompt = ids(batch=2, tokens=9, seed=3)
    with torch.no_grad():
        want = hf_greedy(hf_model, prompt, 8)
        got = ours.generate(prompt, max_new_tokens=8)[:, prompt.shape[1] :]
    assert got.tolist() == want.tolist()


def test_dense_layer_key_spellings_both_load(hf_saved, tmp_path):
    """transformers writes the dense MLP as block_sparse_moe.*_proj, the original layout as mlp.*_proj."""
    from safetensors.torch import load_file, save_file

    _, hf_model, folder = hf_saved
    tensors = load_file(folder / "model.safetensors")
    moe_spelt = [k for k in tensors if ".block_sparse_moe.gate_proj." in k]
    assert moe_spelt, "transformers no longer writes the dense layer as block_sparse_moe: update this test"
    renamed = {re.sub(r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj.", k): v for k, v in tensors.items()}
    assert any(".mlp.gate_proj." in k for k in renamed)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(renamed, tmp_path / "model.safetensors")
    x = ids(batch=1, tokens=12)
    with torch.no_grad():
        a = K3ForCausalLM.from_pretrained(folder)(x).logits
        b = K3ForCausalLM.from_pretrained(tmp_path)(x).logits
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ the reverse direction
K3_CASES = {
    "moe_no_q_lora": dict(q_lora_rank=None, full_attn_layers=[2, 4], first_k_dense_replace=1),
    "moe_q_lora": dict(q_lora_rank=12, full_attn_layers=[1, 4], first_k_dense_replace=2),
    "dense": dict(q_lora_rank=None, full_attn_layers=[3], num_experts=0),
}


def kimi_linear_type(**changes) -> K3Config:
    base = dict(
        name="tiny-kimi-linear",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        kda_num_heads=2,
        kda_head_dim=8,
        kda_gate="softplus",
        kda_output_gate="low_rank",
        num_attention_heads=2,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        mla_output_gate=False,
        hidden_act="swiglu",
        intermediate_size=48,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=16,
        routed_expert_hidden_size=None,
        routed_scaling_factor=2.446,
        residual="plain",
        initializer_range=0.1,
        kda_chunk_size=16,
    )
    return K3Config(**{**base, **changes})


@pytest.mark.parametrize("case", sorted(K3_CASES))
def test_k3lab_save_loads_in_transformers_with_the_same_logits(case, tmp_path):
    cfg = kimi_linear_type(**K3_CASES[case])
    torch.manual_seed(5)
    ours = K3ForCausalLM.from_config(cfg).eval()
    perturb(ours, seed=2)
    ours.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["model_type"] == "kimi_linear"
    theirs = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        want = ours(x).logits
        got = theirs(x).logits
    assert relative_difference(got, want) <= 1e-5
    # ... and back: the k3lab-only fields survive the Hugging Face config.json.
    again = K3ForCausalLM.from_pretrained(tmp_path)
    assert again.config == cfg
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)


def test_non_kimi_linear_configs_keep_the_k3lab_config(tmp_path):
    cfg = from_preset("k3-nano")
    assert hf_incompatibility(cfg) is not None
    K3ForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg.to_dict()


def test_l2_norm_is_the_reference_form():
    """q, k are divided by sqrt(|x|^2 + 1e-6) (fla / transformers), not max(|x|, 1e-6) (F.normalize)."""
    from k3core.modeling.layers.kda import l2_norm

    x = torch.tensor([[3e-4, 4e-4], [3.0, 4.0]])
    got = l2_norm(x)
    # |x|^2 = 2.5e-7 for the small row: 5e-4 / sqrt(1.25e-6) = 0.4472..., F.normalize would give 1.0
    torch.testing.assert_close(got[0], torch.tensor([3e-4, 4e-4]) / (1.25e-6) ** 0.5)
    torch.testing.assert_close(got[1], torch.tensor([0.6, 0.8]))


def test_transformers_bf16_shards_load_with_their_fp32_tensors(tmp_path):
    """transformers' own bf16 save, sharded with an index: k3lab reads it in bf16 keeping the F32 tensors
    in fp32, and in fp32 it gives transformers' fp32 logits from the same files."""
    from k3core.loading.folder import CheckpointFiles
    from k3core.loading.names import keep_fp32

    torch.manual_seed(3)
    model = KimiLinearForCausalLM(hf_config(**HF_CASES["q_lora"])).eval()
    perturb(model, seed=4)
    model.save_pretrained(tmp_path / "fp32")
    # transformers' own bf16 load keeps its fp32 modules (router bias, dt_bias, ...) in fp32; its save keeps them
    bf16 = KimiLinearForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    files = CheckpointFiles.open(tmp_path)
    assert len(files.files) >= 2
    stored = {name: info.dtype for name, info in files.tensors.items()}
    assert stored["model.layers.4.block_sparse_moe.gate.e_score_correction_bias"] == "F32"
    assert stored["model.layers.4.block_sparse_moe.experts.0.w1.weight"] == "BF16"
    ours = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, value in ours.state_dict().items():
        assert value.dtype == (torch.float32 if keep_fp32(name) else torch.bfloat16), name
    x = ids()
    theirs = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(x).logits
        got = K3ForCausalLM.from_pretrained(tmp_path)(x).logits
    assert relative_difference(got, want) <= 1e-5
