"""Interventions (k3core.interp.interventions): identity edits change nothing, each edit kind against an independent
computation, clear errors, JSON round trip."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from analysis.metrics import importance as im
from k3core.interp.edit_kinds import AttnResEdit, EditError, KDAEdit, MLAEdit, MoEEdit, ValueEdit
from k3core.interp.interventions import edit_from_dict, edits_from_json, edits_to_json, intervene
from k3core.interp.recorder import record
from k3core.modeling.hooks import HookNames, hooks
from k3core.ops.kda import kda_recurrent
from tests.conftest import nano_model, random_ids, randomize_attnres_queries


def _logits(model, ids, edits=()):
    with torch.no_grad(), intervene(model, edits):
        return model(ids).logits


def _read(model, ids, names, edits=()):
    got = {}
    table = {n: (lambda v, name, info: got.__setitem__(name, v.clone())) for n in names}
    with torch.no_grad(), intervene(model, edits), hooks(read=table):
        out = model(ids)
    return got, out.logits


def test_identity_edits_give_bitwise_equal_logits():
    model = nano_model()  # AttnRes queries are zero at init: every site is already uniform
    ids = random_ids(19, 2)
    base = _logits(model, ids)
    identities = [
        ValueEdit("mixer_out", "scale", 1.0),
        ValueEdit("kda.g", "scale", 1.0, tokens=(2, 9), heads=[1]),
        ValueEdit("moe.weights", "scale", 1.0),
        ValueEdit("embed", "add", 0.0),
        KDAEdit("scale_beta", value=1.0),
        AttnResEdit("2.attn", "uniform"),
        AttnResEdit("output", "uniform"),
    ]
    for edit in identities:
        assert torch.equal(_logits(model, ids, [edit]), base), edit
    assert not torch.equal(_logits(model, ids, [ValueEdit("mixer_out", "scale", 1.001, layers=[1])]), base)


def test_zeroing_a_sublayer_equals_the_ablation_importance_numbers():
    model = nano_model(1, kda_chunk_size=16)
    ids = random_ids(24)
    table = im.ablation_importance(model, ids).set_index(["layer", "sublayer"])
    for (layer, sub), row in table.iterrows():
        point = "mixer_out" if sub == "attn" else "ffn_out"
        with torch.no_grad(), intervene(model, [ValueEdit(point, "zero", layers=[layer])]):
            loss = float(im.token_nll(model, ids).mean())
        assert loss == row["ablated_loss"], (layer, sub)


def test_uniform_attnres_is_the_mean_of_the_sites_sources():
    model = nano_model(residual="full_attnres")
    randomize_attnres_queries(model)
    ids = random_ids(10, 2)
    sources = ["embed", HookNames.block(0, "mixer_out"), HookNames.block(0, "ffn_out")]
    mix = HookNames.attnres_point("1.attn", "mix")
    got, _ = _read(model, ids, [*sources, mix], [AttnResEdit("1.attn", "uniform")])
    want = torch.stack([got[s] for s in sources]).mean(0)
    torch.testing.assert_close(got[mix], want, rtol=1e-6, atol=1e-6)
    base, _ = _read(model, ids, [mix])
    assert not torch.allclose(base[mix], want, atol=1e-3)  # the randomised site is not uniform by itself


def test_one_hot_and_masked_sources_by_name_and_index():
    model = nano_model()
    randomize_attnres_queries(model)
    ids = random_ids(10, 1)
    site = "3.mlp"
    w = HookNames.attnres_point(site, "weights")
    base, _ = _read(model, ids, [w])
    got, _ = _read(model, ids, [w], [AttnResEdit(site, "mask", sources=["embedding"])])
    kept = base[w].clone()
    kept[..., 0] = 0
    torch.testing.assert_close(got[w], kept / kept.sum(-1, keepdim=True))
    got, _ = _read(model, ids, [w], [AttnResEdit(site, "one_hot", sources=[-1])])
    assert torch.equal(got[w][..., -1], torch.ones_like(got[w][..., -1])) and got[w][..., :-1].sum() == 0
    with pytest.raises(EditError, match="sources: \\['embedding'"):
        _read(model, ids, [w], [AttnResEdit(site, "one_hot", sources=["block 9"])])


def test_a_banned_expert_gets_no_token_and_equals_a_router_that_never_offers_it():
    model = nano_model()
    ids = random_ids(30, 2)
    with torch.no_grad(), record(model, what="moe", max_batch=2) as tr:
        model(ids)
    layer, busiest = 2, int(np.argmax(tr["blocks.2.moe.experts.load"]))
    assert tr["blocks.2.moe.experts.load"][busiest] > 0
    edit = MoEEdit("ban", layer=layer, experts=[busiest])
    with torch.no_grad(), intervene(model, [edit]), record(model, what="moe", max_batch=2) as tr2:
        edited = model(ids).logits
    assert (
        tr2["blocks.2.moe.experts.load"][busiest] == 0
        and tr2["blocks.2.moe.experts.load"].sum() == tr["blocks.2.moe.experts.load"].sum()
    )
    assert (tr2["blocks.2.moe.experts"] != busiest).all()
    never = copy.deepcopy(model)
    never.model.layers[layer].block_sparse_moe.gate.e_score_correction_bias[busiest] = float("-inf")
    with torch.no_grad():
        torch.testing.assert_close(edited, never(ids).logits, rtol=0, atol=0)


def test_force_uniform_bias_off_and_shared_off():
    model = nano_model()
    ids = random_ids(12, 1)
    cfg = model.config
    with torch.no_grad():
        model.moe_layers()[0].gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, cfg.num_experts))
    names = [HookNames.block(1, p) for p in ("moe.experts", "moe.weights", "moe.selection_bias", "moe.shared_out")]
    got, _ = _read(model, ids, names, [MoEEdit("force", layer=1, experts=[3], tokens=(0, 5))])
    assert (got[names[0]][:, :5] == 3).any(-1).all() and not (got[names[0]][:, 5:] == 3).any(-1).all()
    got, _ = _read(model, ids, names, [MoEEdit("uniform", layer=1)])
    assert torch.all(got[names[1]] == cfg.routed_scaling_factor / cfg.num_experts_per_token)
    got, _ = _read(model, ids, names, [MoEEdit("bias_off"), MoEEdit("shared_off", layer=1)])
    assert torch.count_nonzero(got[names[2]]) == 0 and torch.count_nonzero(got[names[3]]) == 0


def test_kda_g_pinned_to_zero_equals_kda_recurrent_with_g_zero():
    model = nano_model()
    ids = random_ids(20, 2)
    parts = {p: HookNames.block(1, f"kda.{p}") for p in ("q", "k", "v", "g", "beta", "o")}
    got, _ = _read(model, ids, list(parts.values()), [KDAEdit("pin_g", layer=1, value=0.0)])
    assert torch.count_nonzero(got[parts["g"]]) == 0
    q, k, v, beta = (got[parts[p]] for p in ("q", "k", "v", "beta"))
    want, _ = kda_recurrent(q, k, v, torch.zeros_like(got[parts["g"]]), beta)
    torch.testing.assert_close(got[parts["o"]], want, rtol=1e-5, atol=1e-5)


def test_kda_reset_state_forgets_everything_before_the_position():
    model = nano_model()
    ids = random_ids(20, 1)
    parts = {p: HookNames.block(0, f"kda.{p}") for p in ("q", "k", "v", "g", "beta", "o")}
    got, _ = _read(model, ids, list(parts.values()), [KDAEdit("reset_state", layer=0, tokens=11)])
    q, k, v, g, beta = (got[parts[p]] for p in ("q", "k", "v", "g", "beta"))
    head, _ = kda_recurrent(q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11])
    tail, _ = kda_recurrent(q[:, 11:], k[:, 11:], v[:, 11:], torch.zeros_like(g[:, 11:]) + g[:, 11:], beta[:, 11:])
    torch.testing.assert_close(got[parts["o"]], torch.cat([head, tail], 1), rtol=1e-5, atol=1e-5)


def test_kda_gate_off_sets_the_gate_to_one():
    model = nano_model()
    ids = random_ids(9, 1)
    gate = HookNames.block(2, "kda.gate")
    got, logits = _read(model, ids, [gate], [KDAEdit("gate_off", layer=2)])
    assert torch.all(got[gate] == 1) and not torch.equal(logits, _logits(model, ids))


def test_masking_mla_key_0_equals_a_hand_softmax():
    model = nano_model()
    ids = random_ids(9, 2)
    parts = {p: HookNames.block(3, f"mla.{p}") for p in ("q", "k", "v", "o")}
    got, _ = _read(model, ids, list(parts.values()), [MLAEdit(layer=3, keys=(0, 1))])
    q, k, v = got[parts["q"]], got[parts["k"]], got[parts["v"]]
    scale = (model.config.qk_nope_head_dim + model.config.qk_rope_head_dim) ** -0.5
    T = q.shape[2]
    want = torch.zeros(q.shape[0], q.shape[1], T, v.shape[-1])
    for t in range(1, T):  # query 0 sees only key 0: masked, so its output is zero
        scores = (q[:, :, t : t + 1] @ k[:, :, 1 : t + 1].transpose(-1, -2)) * scale
        want[:, :, t] = (scores.softmax(-1) @ v[:, :, 1 : t + 1])[:, :, 0]
    torch.testing.assert_close(got[parts["o"]], want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    with torch.no_grad(), intervene(model, [MLAEdit(layer=3, keys=(0, 1))]), record(model, what="attn_probs") as tr:
        model(ids)
    probs = tr["blocks.3.mla.attn"]
    assert np.all(probs[..., 0] == 0) and np.allclose(probs[:, :, 1:].sum(-1), 1.0)


def test_edits_round_trip_through_json():
    edits = [
        ValueEdit("kda.g", "scale", 2.0, layers=[0, 1], tokens=(1, 4), heads=[0], channels=[3]),
        AttnResEdit("3.mlp", "mask", sources=["embedding", 2]),
        KDAEdit("reset_state", layer=0, tokens=5),
        MoEEdit("ban", layer=2, experts=[1, 4]),
        MLAEdit(layer=3, keys=(0, 2), heads=[1]),
    ]
    back = edits_from_json(edits_to_json(edits))
    assert back == edits
    assert [e.to_dict() for e in back] == [e.to_dict() for e in edits]
    assert "moe ban layer=2 experts=[1, 4]" in [e.describe() for e in edits]


def test_edits_naming_what_does_not_exist_say_what_does():
    model = nano_model()
    ids = random_ids(5, 1)
    cases = [
        (ValueEdit("kda.gg", "zero"), "unknown hook point 'kda.gg'.*kda.g"),
        (ValueEdit("kda.g", "zero", layers=[3]), r"layers \[3\] have no hook point 'kda.g'.*\[0, 1, 2\]"),
        (MoEEdit("ban", layer=0, experts=[1]), r"layer 0 has no MoE.*\[1, 2, 3\]"),
        (MoEEdit("ban", experts=[8]), "experts 0..7"),
        (MLAEdit(layer=1), r"layer 1 has no MLA.*\[3\]"),
        (AttnResEdit("0.attn", "uniform"), "no AttnRes site '0.attn'; sites:.*0.mlp"),
        (KDAEdit("scale_g", value=2.0, heads=[5]), "heads are 0..1"),
    ]
    for edit, message in cases:
        with pytest.raises(EditError, match=message):
            _logits(model, ids, [edit])
    with pytest.raises(EditError, match="kinds: value, attnres, kda, moe, mla"):
        edit_from_dict({"kind": "nope"})
    with pytest.raises(EditError, match="no field"):
        edit_from_dict({"kind": "moe", "op": "ban", "experts": [1], "expert": 2})
    with pytest.raises(EditError, match="op must be one of"):
        ValueEdit("embed", "double")
    with pytest.raises(EditError, match="residual is 'plain'"):
        _logits(nano_model(residual="plain"), ids, [AttnResEdit("output", "uniform")])


def test_the_short_form_reads_like_the_json_form():
    from k3core.interp.interventions import parse_edit

    assert parse_edit("moe.ban layer=2 experts=1,5") == MoEEdit("ban", layer=2, experts=[1, 5])
    assert parse_edit("value.zero point=mixer_out layers=2") == ValueEdit("mixer_out", "zero", layers=[2])
    assert parse_edit("attnres.one_hot site=3.attn sources=embedding") == AttnResEdit(
        "3.attn", "one_hot", ["embedding"]
    )
    assert parse_edit("kda.pin_g layer=1 value=0 tokens=4:9") == KDAEdit("pin_g", layer=1, value=0, tokens=(4, 9))
    assert parse_edit("mla.mask_keys layer=3 keys=0:1") == MLAEdit(layer=3, keys=(0, 1))
    edit = KDAEdit("scale_g", layer=0, value=2.0)
    assert parse_edit(edits_to_json([edit])[1:-1]) == edit
    with pytest.raises(EditError, match="kinds: value"):
        parse_edit("moo.ban")
    with pytest.raises(EditError, match="key=value"):
        parse_edit("moe.ban layer")
