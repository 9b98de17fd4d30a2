"""The K3 model: every switch combination trains, and each mechanism matches its formula (K3_REFERENCE.md)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3core.data.batches import IGNORE_INDEX
from k3core.interp import recorder as trace_mod
from k3core.modeling.config import K3Config
from k3core.modeling.layers.residual import scale_bias_init
from k3core.modeling.model import K3ForCausalLM
from k3core.training.balancing import update_router_biases
from tests.conftest import nano_config, nano_model, randomize_attnres_queries
from tests.k3core.ops.test_ops_attnres import explicit_mix

# ------------------------------------------------------------------------------------ switch combinations

# (residual mode, block size): Block AttnRes with several block sizes, including one larger than the model.
RESIDUALS = [
    ("block_attnres", 1),
    ("block_attnres", 2),
    ("block_attnres", 3),
    ("block_attnres", 5),
    ("full_attnres", 2),
    ("scale_bias", 2),
    ("plain", 2),
]
MOES = {"latent": {}, "plain": {"routed_expert_hidden_size": None}, "none": {"num_experts": 0}}
BALANCING = ["sign", "quantile", "aux_loss", "none"]
# Two-valued switches, covered pairwise (with each other and with the three factors above).
BINARY = {
    "kda_gate": ["lower_bound", "softplus"],
    "kda_output_gate": ["full", "low_rank"],
    "mla_output_gate": [True, False],
    "hidden_act": ["situ", "swiglu"],
    "q_lora_rank": [24, None],
    "layer_width_multipliers": [None, [1.0, 0.5, 2.0, 0.75]],
}


def covering_rows() -> list[tuple[int, ...]]:
    """Value indices for every factor: the full product of residual x MoE x balancing (84 rows), each row
    completed greedily with the two-valued switches that cover the most not-yet-covered pairs. The result
    covers every pair of values of every two factors (checked in test_switch_rows_cover_every_pair)."""
    sizes = [len(RESIDUALS), len(MOES), len(BALANCING)] + [len(v) for v in BINARY.values()]
    uncovered = {
        ((i, a), (j, b))
        for i, j in itertools.combinations(range(len(sizes)), 2)
        for a in range(sizes[i])
        for b in range(sizes[j])
    }
    rows = []
    for head in itertools.product(*(range(n) for n in sizes[:3])):

        def gain(tail, head=head, uncovered=uncovered):
            row = head + tail
            return sum(((i, row[i]), (j, row[j])) in uncovered for i, j in itertools.combinations(range(len(row)), 2))

        best = max(itertools.product(*(range(n) for n in sizes[3:])), key=gain)
        row = head + best
        uncovered -= {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)}
        rows.append(row)
    assert not uncovered, uncovered
    return rows


def row_config(row: tuple[int, ...]) -> K3Config:
    residual, block = RESIDUALS[row[0]]
    kwargs = dict(residual=residual, attn_res_block_size=block, balancing=BALANCING[row[2]])
    kwargs.update(list(MOES.values())[row[1]])
    for (name, values), idx in zip(BINARY.items(), row[3:]):
        kwargs[name] = values[idx]
    return nano_config(**kwargs)


def test_switch_rows_cover_every_pair():
    rows = covering_rows()
    assert len(rows) == len(RESIDUALS) * len(MOES) * len(BALANCING)
    assert len(set(rows)) == len(rows)
    assert len({r[:3] for r in rows}) == len(rows)  # full product of the first three factors
    for i, j in itertools.combinations(range(len(rows[0])), 2):
        assert len({(r[i], r[j]) for r in rows}) == len({r[i] for r in rows}) * len({r[j] for r in rows})


def test_every_switch_combination_trains():
    """Forward + backward with finite loss and grads; aux loss exactly when asked for; bias update runs."""
    ids = torch.randint(0, 256, (2, 5))
    for row in covering_rows():
        cfg = row_config(row)
        torch.manual_seed(0)
        model = K3ForCausalLM.from_config(cfg).train()
        out = model(ids, labels=ids)
        label = f"{cfg.residual}/{cfg.attn_res_block_size} experts={cfg.num_experts} " + str(row)
        assert out.logits.shape == (2, 5, 256), label
        assert torch.isfinite(out.loss), label
        wants_aux = cfg.balancing == "aux_loss" and cfg.num_experts > 0
        assert (out.aux_loss is not None) == wants_aux, label
        loss = out.loss + (cfg.aux_loss_coef * out.aux_loss if wants_aux else 0.0)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert all(torch.isfinite(g).all() for g in grads.values()), label
        assert grads["model.embed_tokens.weight"].abs().sum() > 0, label
        assert grads["lm_head.weight"].abs().sum() > 0, label
        update_router_biases(model)
        for moe in model.moe_layers():
            assert torch.isfinite(moe.gate.e_score_correction_bias).all(), label


def test_switches_change_the_modules():
    lr = nano_model(kda_output_gate="low_rank", mla_output_gate=False, q_lora_rank=None, residual="scale_bias")
    attn0, attn3 = lr.model.layers[0].self_attn, lr.model.layers[3].self_attn
    assert hasattr(attn0, "g_a_proj") and hasattr(attn0, "g_b_proj") and not hasattr(attn0, "g_proj")
    assert not hasattr(attn3, "g_proj") and hasattr(attn3, "q_proj") and not hasattr(attn3, "q_a_proj")
    assert not hasattr(lr.model, "output_attn_res_proj")
    plain_moe = nano_model(routed_expert_hidden_size=None).model.layers[1].ffn
    assert not hasattr(plain_moe, "routed_expert_down_proj") and plain_moe.experts.w1.shape[-1] == 64
    dense = nano_model(num_experts=0)
    assert all(not layer.is_moe and hasattr(layer, "mlp") for layer in dense.model.layers)
    tiers = nano_model(layer_width_multipliers=[1.0, 0.5, 2.0, 1.0])
    assert tiers.model.layers[1].ffn.experts.w1.shape[1] == 16  # 32 * 0.5
    assert tiers.model.layers[2].ffn.experts.w1.shape[1] == 64  # 32 * 2


# ------------------------------------------------------------------------- AttnRes (depth mixing inside the model)


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres"])
def test_fresh_model_depth_weights_are_uniform(residual):
    model = nano_model(residual=residual)
    with torch.no_grad(), trace_mod.record(model, what="attnres") as tr:
        model(torch.randint(0, 256, (1, 5)))
    names = [n for n in tr.arrays if n.endswith("_res.weights")]
    assert len(names) >= 2 * model.config.num_hidden_layers - 1
    for name in names:
        n = tr[name].shape[-1]
        np.testing.assert_allclose(tr[name], 1.0 / n, rtol=1e-6, err_msg=name)


def _reference_hidden(model: K3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """K3_REFERENCE.md section 6, written out literally: the final hidden state (after the final RMSNorm)."""
    m, cfg = model.model, model.config
    x = m.embed_tokens(ids)

    def mix(proj, norm, sources):
        return explicit_mix(proj.weight[0], norm.weight, sources, norm.eps)[0].float()

    if cfg.residual == "block_attnres":
        bank, P = [], x
        for i, layer in enumerate(m.layers):
            h = mix(layer.self_attention_res_proj, layer.self_attention_res_norm, bank + [P]) if bank else P
            if i % cfg.attn_res_block_size == 0:
                bank.append(P)
                P = torch.zeros_like(x)
            P = P + layer.attention(h)
            h = mix(layer.mlp_res_proj, layer.mlp_res_norm, bank + [P])
            P = P + layer.feed_forward(h)
        final = mix(m.output_attn_res_proj, m.output_attn_res_norm, bank + [P])
    elif cfg.residual == "full_attnres":
        outs = [x]
        for layer in m.layers:
            outs.append(layer.attention(mix(layer.self_attention_res_proj, layer.self_attention_res_norm, outs)))
            outs.append(layer.feed_forward(mix(layer.mlp_res_proj, layer.mlp_res_norm, outs)))
        final = mix(m.output_attn_res_proj, m.output_attn_res_norm, outs)
    elif cfg.residual == "scale_bias":
        h = x
        for layer in m.layers:
            h = h + layer.self_attention_res_scale * layer.attention(h) + layer.self_attention_res_bias
            h = h + layer.mlp_res_scale * layer.feed_forward(h) + layer.mlp_res_bias
        final = h
    else:
        h = x
        for layer in m.layers:
            h = h + layer.attention(h)
            h = h + layer.feed_forward(h)
        final = h
    return m.norm(final)


@pytest.mark.parametrize(
    "residual, block",
    [
        ("block_attnres", 1),
        ("block_attnres", 2),
        ("block_attnres", 3),
        ("full_attnres", 2),
        ("scale_bias", 2),
        ("plain", 2),
    ],
)
def test_residual_modes_match_the_reference_loops(residual, block):
    model = nano_model(
        residual=residual,
        attn_res_block_size=block,
        num_hidden_layers=5,
        full_attn_layers=[4],
        layer_width_multipliers=None,
    )
    randomize_attnres_queries(model)
    if residual == "scale_bias":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_res_scale" in name or "_res_bias" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids), _reference_hidden(model, ids), rtol=1e-4, atol=1e-4)


def test_scale_bias_initialisation():
    model = nano_model(residual="scale_bias")
    layers = model.model.layers
    assert torch.all(layers[0].self_attention_res_scale == 1.0) and torch.all(layers[0].mlp_res_bias == 0.0)
    assert layers[-1].mlp_res_scale[0].item() == pytest.approx(0.9)
    assert scale_bias_init(model.config, 1) == pytest.approx(1.0 - 0.1 / 3)


def test_93_layer_block_12_bank_bookkeeping():
    """K3's layout (93 layers, Block AttnRes over 12) at a tiny width: the output mix sees 9 sources."""
    full = list(range(4, 93, 4)) + [93]
    cfg = K3Config(
        num_hidden_layers=93,
        hidden_size=8,
        vocab_size=16,
        full_attn_layers=full,
        attn_res_block_size=12,
        kda_num_heads=1,
        kda_head_dim=4,
        kda_chunk_size=2,
        num_attention_heads=1,
        q_lora_rank=None,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        num_experts=0,
        intermediate_size=8,
    )
    model = K3ForCausalLM.from_config(cfg).eval()
    with torch.no_grad(), trace_mod.record(model, what="attnres") as tr:
        model(torch.randint(0, 16, (1, 2)))
    sources = tr.meta["attnres_sources"]
    assert sources["output"] == ["embedding"] + [f"block {b}" for b in range(1, 9)]
    assert tr["output_res.weights"].shape[-1] == 9
    assert "0.attn" not in sources  # the first attention input is the embedding itself
    for i in range(1, 93):
        assert len(sources[f"{i}.attn"]) == (i + 11) // 12 + 1, i
    for i in range(93):
        assert len(sources[f"{i}.mlp"]) == i // 12 + 2, i


def test_attnres_pseudo_queries_receive_gradients():
    model = nano_model().train()
    ids = torch.randint(0, 256, (2, 6))
    model(ids, labels=ids).loss.backward()
    grads = [model.model.layers[1].self_attention_res_proj.weight.grad, model.model.output_attn_res_proj.weight.grad]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


# ------------------------------------------------------------------------------------ model level


@pytest.mark.parametrize("residual", ["block_attnres", "scale_bias"])
def test_bf16_forward_on_cpu(residual):
    model = nano_model(residual=residual).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(256)) < 1.0


def test_labels_and_targets_agree_and_ignore_minus_100():
    model = nano_model()
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        by_labels = model(ids, labels=ids)
        targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
        by_targets = model(ids, targets=targets)
        nll = F.cross_entropy(by_labels.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(by_labels.loss, by_targets.loss)
    torch.testing.assert_close(by_labels.loss, nll)
    assert model(ids).loss is None


@pytest.mark.parametrize(
    "ids, labels, words",
    [
        (torch.tensor([[1, 256]]), None, "0..255"),
        (torch.tensor([[-1, 3]]), None, "0..255"),
        (torch.tensor([1, 2, 3]), None, "batch, tokens"),
        (torch.tensor([[1.0, 2.0]]), None, "integer"),
        (torch.zeros(2, 0, dtype=torch.long), None, "no tokens"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2]]), "shape"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 300]]), "labels"),
    ],
)
def test_bad_inputs_raise_value_error(ids, labels, words):
    model = nano_model()
    with pytest.raises(ValueError, match=words):
        model(ids, labels=labels)


def test_parameter_counts():
    model = nano_model()
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == total
    per_expert = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    inactive = n_moe * (cfg.num_experts - cfg.num_experts_per_token) * per_expert
    assert model.num_parameters(active=True) == total - inactive
    tied = nano_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.num_parameters() == total - 256 * 64


@pytest.mark.parametrize("residual", ["block_attnres", "scale_bias"])
def test_meta_build_then_to_empty_and_reset_gives_a_fresh_model(residual):
    """device="meta" skips initialisation; to_empty() + reset_parameters() initialises every tensor."""
    reference = nano_model(residual=residual)
    model = K3ForCausalLM.from_config(nano_config(residual=residual), device="meta")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for b in model.buffers():
            b.fill_(float("nan"))
    model.reset_parameters()
    for (name, p), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.isfinite(p).all(), name
        if "norm" in name or "res_proj" in name or "_res_" in name or "e_score" in name:
            assert torch.equal(p, ref), name  # deterministic initial values
        elif p.numel() >= 256:  # random init: same spread as a fresh model
            assert abs(p.float().std().item() - ref.float().std().item()) <= 0.2 * ref.float().std().item(), name
    ids = torch.randint(0, 256, (1, 4))
    assert torch.isfinite(model.eval()(ids, labels=ids).loss)


def test_decoder_layer_accessors():
    model = nano_model()
    layers = model.model.layers
    assert [layer.is_mla for layer in layers] == [False, False, False, True]
    assert layers[0].ffn is layers[0].mlp and layers[1].ffn is layers[1].block_sparse_moe
    h = torch.randn(1, 4, 64)
    with torch.no_grad():
        torch.testing.assert_close(layers[1].attention(h), layers[1].self_attn(layers[1].input_layernorm(h)))
        torch.testing.assert_close(layers[1].feed_forward(h), layers[1].ffn(layers[1].post_attention_layernorm(h)))


def test_importing_the_model_leaves_the_loading_stack_unimported():
    """k3core.modeling.model builds and runs models; checkpoint reading, placement, streaming and decoding load on
    use."""
    import subprocess
    import sys

    code = "import sys, k3core.modeling.model; print(sorted(m for m in sys.modules if m.startswith('k3core.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # noqa: S307 - our own printed list
    assert "k3core.modeling.model" in loaded and "k3core.modeling.layers.residual" in loaded
    heavy = ("k3core.loading", "k3core.loading", "k3core.generation.decode", "k3core.distributed")
    assert [m for m in loaded if m.startswith(heavy)] == []


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres"])
def test_depth_sources_are_data_and_their_labels_are_made_outside_the_model(residual):
    """The stream hands hooks structured sources (kind, index, partial); the labels traces and edits use are
    k3core.interp.catalogue.source_label's, and the model's own code writes none."""
    from k3core.interp.catalogue import source_label
    from k3core.modeling.hooks import hooks
    from k3core.modeling.layers.residual import Source

    model = nano_model(residual=residual)
    seen = {}
    with torch.no_grad(), hooks(read={"final_stream": lambda v, n, info: seen.setdefault("s", info["sources"])}):
        model(torch.randint(0, 256, (1, 5)))
    sources = seen["s"]
    assert all(isinstance(s, Source) for s in sources)
    if residual == "block_attnres":  # 4 layers, blocks of 2
        assert sources == [Source("embedding"), Source("block", 1), Source("block", 2)]
        assert source_label(Source("block", 2, partial=True)) == "block 2 (partial)"
    else:
        assert sources[0] == Source("embedding") and sources[-1] == Source("ffn", 3)
        assert [source_label(s) for s in sources[1:3]] == ["L0.attn", "L0.ffn"]
    root = Path(__file__).resolve().parents[3] / "k3core" / "modeling"
    for path in [root / "model.py", *(root / "layers").glob("*.py")]:
        text = path.read_text()
        assert "(partial)" not in text and 'f"L{' not in text and 'f"block ' not in text, path
