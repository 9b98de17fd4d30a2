"""The KDA state at chunk ends as a hook point: ``kda_chunk(output_chunk_states=True)`` returns the states of the
forward's own state loop, the layer's ``delta_rule`` passes them through ``blocks.i.kda.chunk_state`` (a write: the
op runs on from the replaced state), ``record()`` takes its state norms from
it and ``KDAEdit`` reset_chunk_state / scale_chunk_state edit it. Each checked against an independent
computation (``kda_recurrent`` step by step, ``kda_chunk_end_states``' batched affine maps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from k3core.interp.catalogue import point_axes
from k3core.interp.edit_kinds import EditError, KDAEdit, ValueEdit
from k3core.interp.interventions import edits_from_json, edits_to_json, intervene, parse_edit
from k3core.interp.recorder import record
from k3core.interp.trace import names
from k3core.modeling.cache import K3Cache
from k3core.modeling.hooks import HookNames, hooks
from k3core.modeling.layers.kda import delta_rule
from k3core.modeling.model import K3ForCausalLM
from k3core.ops.kda import chunk as kda_ops
from k3core.ops.kda import kda_chunk, kda_chunk_end_states, kda_recurrent
from tests.conftest import nano_model, random_ids

SAMPLES = Path(__file__).resolve().parents[3] / "sample_checkpoints"
C = 8


def _inputs(dtype=torch.float64, B=2, T=37, H=2, HV=4, K=8, V=6, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    g = -torch.rand(B, T, HV, K, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    out = [q, k, v, g, beta]
    return [x.requires_grad_() for x in out] if requires_grad else out


@pytest.fixture
def small_groups(monkeypatch):
    """Two chunks per group for the shapes above, so chunk ends fall inside and at the end of groups."""
    monkeypatch.setattr(kda_ops, "_GROUP_ELEMENTS", 2 * 2 * 4 * C * 8)


def _recurrent_states(q, k, v, g, beta, initial=None):
    """The state after every token, [B, T, HV, K, V], by kda_recurrent one token at a time."""
    states, state = [], initial
    for t in range(q.shape[1]):
        s = slice(t, t + 1)
        _, state = kda_recurrent(
            q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=state, output_final_state=True
        )
        states.append(state)
    return torch.stack(states, 1)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_chunk_states_equal_the_recurrence_at_chunk_ends(small_groups, dtype, tol):
    q, k, v, g, beta = _inputs(dtype)
    initial = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
    o, final, states = kda_chunk(
        q, k, v, g, beta, initial_state=initial, output_final_state=True, chunk_size=C, output_chunk_states=True
    )
    assert states.shape == (2, 5, 4, 8, 6) and states.dtype == dtype
    per_token = _recurrent_states(*(x.double() for x in (q, k, v, g, beta)), initial.double())
    batched, steps = kda_chunk_end_states(q, k, v, g, beta, initial, chunk_size=C)
    assert steps == [8, 16, 24, 32, 37]
    for j, end in enumerate(steps):
        torch.testing.assert_close(states[:, j].double(), per_token[:, end - 1], rtol=tol, atol=tol)
        torch.testing.assert_close(states[:, j].float(), batched[:, j], rtol=2e-5, atol=2e-5)
    assert torch.equal(states[:, -1], final)
    plain_o, plain_final = kda_chunk(q, k, v, g, beta, initial_state=initial, output_final_state=True, chunk_size=C)
    assert torch.equal(o, plain_o) and torch.equal(final, plain_final)  # returning the states changes nothing


def _hooked_delta_rule(qkvgb, hook, initial=None):
    """The KDA layer's delta rule with a write hook on its chunk-state point
    (``k3core.modeling.layers.kda.delta_rule``)."""
    with hooks(write={"chunk_state": hook}) as ctx:
        return delta_rule(ctx, "chunk_state", qkvgb, initial, True, 0, C)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("n", [0, 1, 2, 4])  # inside a group, a group's last chunk, the next group, the last chunk
def test_a_replaced_state_is_what_the_following_chunks_start_from(small_groups, dtype, tol, n):
    q, k, v, g, beta = _inputs(dtype)
    replacement = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(2), dtype=dtype)
    plain_o, _ = kda_chunk(q, k, v, g, beta, chunk_size=C)
    o, final = _hooked_delta_rule(
        (q, k, v, g, beta), lambda state, name, info: replacement if info["chunk"] == n else None
    )
    end = min((n + 1) * C, q.shape[1])
    assert torch.equal(o[:, :end], plain_o[:, :end])  # tokens up to the chunk end read their own chunk's state
    if n == 4:
        assert torch.equal(final, replacement)
        return
    after = slice(end, None)
    want_o, want_final = kda_recurrent(
        q[:, after], k[:, after], v[:, after], g[:, after], beta[:, after], initial_state=replacement,
        output_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(o[:, after], want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(final, want_final, rtol=tol, atol=tol)


def test_identity_write_is_bitwise_and_gradients_follow_a_scaled_state(small_groups):
    q, k, v, g, beta = _inputs(torch.float64, T=29, requires_grad=True)
    plain_o, plain_s = kda_chunk(q, k, v, g, beta, output_final_state=True, chunk_size=C)
    same_o, same_s = _hooked_delta_rule((q, k, v, g, beta), lambda s, name, info: s)
    assert torch.equal(plain_o, same_o) and torch.equal(plain_s, same_s)

    weights = torch.randn(plain_o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    o, _ = _hooked_delta_rule((q, k, v, g, beta), lambda s, name, info: s * 0.5 if info["chunk"] == 1 else s)
    got = torch.autograd.grad((o * weights).sum(), (q, k, v, g, beta))
    # independent: the recurrence up to token 16, the state halved, the recurrence on from it
    head = [x[:, :16] for x in (q, k, v, g, beta)]
    tail = [x[:, 16:] for x in (q, k, v, g, beta)]
    o_head, s_head = kda_recurrent(*head, output_final_state=True)
    o_tail, _ = kda_recurrent(*tail, initial_state=s_head * 0.5)
    want = torch.autograd.grad((torch.cat([o_head, o_tail], 1) * weights).sum(), (q, k, v, g, beta))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_write_of_the_wrong_shape_gets_a_clear_error_and_no_token_has_no_chunk_end():
    q, k, v, g, beta = _inputs(torch.float32, T=9)
    with pytest.raises(ValueError, match=r"chunk_state: a write must keep the state's shape \(2, 4, 8, 6\)"):
        _hooked_delta_rule((q, k, v, g, beta), lambda s, name, info: s[0])
    calls = []
    empty = [x[:, :0] for x in (q, k, v, g, beta)]
    _, _, states = kda_chunk(*empty, output_chunk_states=True)
    assert states.shape == (2, 0, 4, 8, 6)
    _hooked_delta_rule(empty, lambda *a: calls.append(a))
    assert calls == []  # no token, no chunk end


def _layer_reads(model, ids, layer, points, **kw):
    got: dict[str, list] = {}
    table = {
        HookNames.block(layer, f"kda.{p}"): (lambda v, name, info: got.setdefault(name, []).append((v.clone(), info)))
        for p in points
    }
    with torch.no_grad(), hooks(read=table):
        out = model(ids, **kw)
    return {HookNames.point_of(n).split(".")[1]: vals for n, vals in got.items()}, out


def test_the_hook_point_offers_the_forward_states_with_positions_and_axes():
    model = nano_model()
    ids = random_ids(21, 2)
    got, _ = _layer_reads(model, ids, 1, ("q", "k", "v", "g", "beta", "chunk_state", "state"))
    infos = [info for _, info in got["chunk_state"]]
    assert [i["chunk"] for i in infos] == [0, 1, 2] and [i["token"] for i in infos] == [8, 16, 21]
    assert all(i["chunks"] == 3 and i["length"] == 21 and i["start"] == 0 and i["chunk_size"] == 8 for i in infos)
    assert point_axes("blocks.1.kda.chunk_state") == ("batch", "head", "key", "value")
    q, k, v, g, beta = (got[p][0][0] for p in ("q", "k", "v", "g", "beta"))
    want, steps = kda_chunk_end_states(q, k, v, g, beta, chunk_size=8)
    assert steps == [8, 16, 21]
    for j, (state, _) in enumerate(got["chunk_state"]):
        torch.testing.assert_close(state, want[:, j], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["chunk_state"][-1][0], got["state"][0][0])


def test_a_decoding_step_is_one_chunk_of_one_token():
    model = nano_model()
    ids = random_ids(11, 1)
    cache = K3Cache.for_config(model.config)
    with torch.no_grad():
        model(ids[:, :10], cache=cache)
    got, _ = _layer_reads(model, ids[:, 10:], 0, ("chunk_state", "state"), cache=cache)
    (state, info), = got["chunk_state"]  # fmt: skip
    assert (info["chunk"], info["chunks"], info["token"], info["start"], info["chunk_size"]) == (0, 1, 1, 10, 1)
    assert torch.equal(state, got["state"][0][0])
    # zeroing it in a decoding step empties the cache's memory for the next step
    with torch.no_grad(), intervene(model, [KDAEdit("reset_chunk_state", layer=0, chunks=[0])]):
        model(ids[:, :1], cache=cache)
    assert torch.count_nonzero(cache.layers[0].recurrent_state) == 0


def test_reset_chunk_state_on_a_head_equals_an_independent_computation():
    model = nano_model()
    ids = random_ids(22, 1)
    edit = KDAEdit("reset_chunk_state", layer=2, chunks=[1], heads=[0])
    parts = ("q", "k", "v", "g", "beta", "o")
    table = {}
    got = {}
    for p in parts:
        table[HookNames.block(2, f"kda.{p}")] = lambda v, name, info: got.__setitem__(name.split(".")[-1], v.clone())
    with torch.no_grad(), intervene(model, [edit]), hooks(read=table):
        edited = model(ids).logits
    q, k, v, g, beta = (got[p].double() for p in parts[:5])
    o_head, state = kda_recurrent(*(x[:, :16] for x in (q, k, v, g, beta)), output_final_state=True)
    state[:, 0] = 0
    o_tail, _ = kda_recurrent(*(x[:, 16:] for x in (q, k, v, g, beta)), initial_state=state)
    torch.testing.assert_close(got["o"].double(), torch.cat([o_head, o_tail], 1), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.equal(edited, model(ids).logits)
        plain = model(ids).logits
        for identity in (
            KDAEdit("scale_chunk_state", layer=2, chunks=[0, 1], value=1.0),
            ValueEdit("kda.chunk_state", "scale", 1.0, heads=[1]),
        ):
            with intervene(model, [identity]):
                assert torch.equal(model(ids).logits, plain), identity
        with intervene(model, [ValueEdit("kda.chunk_state", "zero", layers=[2])]):
            assert not torch.equal(model(ids).logits, plain)
    with pytest.raises(EditError, match="tokens cannot be picked"):
        ValueEdit("kda.chunk_state", "zero", tokens=(0, 4)).hooks(model.config)


def test_chunk_edits_name_what_exists_and_round_trip():
    model = nano_model()
    with pytest.raises(
        EditError, match=r"no chunk \[5\] in this forward; chunks: 0 \(ends at token 8\), 1 \(ends at token 10\)"
    ):
        with torch.no_grad(), intervene(model, [KDAEdit("reset_chunk_state", chunks=[1, 5])]):
            model(random_ids(10, 1))
    with pytest.raises(EditError, match="needs chunks"):
        KDAEdit("reset_chunk_state")
    with pytest.raises(EditError, match="needs a value"):
        KDAEdit("scale_chunk_state", chunks=[0])
    with pytest.raises(EditError, match="takes no chunks"):
        KDAEdit("gate_off", chunks=[0])
    with pytest.raises(EditError, match="layers with it"):
        with intervene(model, [KDAEdit("reset_chunk_state", layer=3, chunks=[0])]):  # layer 3 is MLA
            pass
    edits = [KDAEdit("scale_chunk_state", layer=1, chunks=[0, 2], value=0.5, heads=[1])]
    assert edits_from_json(edits_to_json(edits)) == edits
    assert parse_edit("kda.reset_chunk_state layer=1 chunks=2") == KDAEdit("reset_chunk_state", layer=1, chunks=[2])


def _main_state_norms(model, ids, max_tokens, max_batch):
    """state_norm / state_steps as record() computed them before this hook point: kda_chunk_end_states on
    the recorded prefix of the layer's q, k, v, g, beta."""
    want = {}
    for i in [i for i in range(model.config.num_hidden_layers) if not model.config.is_mla_layer(i)]:
        got, _ = _layer_reads(model, ids, i, ("q", "k", "v", "g", "beta"))
        parts = [got[p][0][0][:max_batch, :max_tokens] for p in ("q", "k", "v", "g", "beta")]
        states, steps = kda_chunk_end_states(*parts, chunk_size=model.config.kda_chunk_size)
        want[i] = (states.flatten(-2).norm(dim=-1), steps)
    return want


@pytest.mark.parametrize("sample", ["k3-full", "plain-moe"])
def test_recorded_state_norms_equal_the_batched_recomputation_on_the_samples(sample):
    model = K3ForCausalLM.from_pretrained(SAMPLES / sample).eval()
    ids = torch.tensor([list(b"Friends, Romans, countrymen, lend me your ears; " * 4)] * 2)[:, :190]
    for max_tokens, max_batch in [(1024, 2), (150, 1)]:  # 150: the recorded prefix ends inside a chunk
        with torch.no_grad(), record(model, max_tokens=max_tokens, max_batch=max_batch) as trace:
            model(ids)
        want = _main_state_norms(model, ids, max_tokens, max_batch)
        assert trace.layer_indices("kda") == sorted(want)
        for i, (norms, steps) in want.items():
            assert trace[names.kda_state_steps(i)].tolist() == steps
            assert trace.axes[names.kda_state_norm(i)] == ("batch", "step", "head")
            np.testing.assert_allclose(trace[names.kda_state_norm(i)], norms.numpy(), rtol=1e-5, atol=1e-6)


def test_chunk_states_keep_the_fla_kernel(monkeypatch):
    """Where fla's Triton kernel runs (CUDA), asking for the chunk states (record(), or a layer whose chunk-state
    point is hooked) does not force the torch path: the states come from kda_chunk_end_states after the kernel. fla
    is stood in for by the torch path here (no GPU in CI), counted, with fla's signature."""
    calls = []

    def fake_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        calls.append(1)
        return kda_ops._kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, C)

    monkeypatch.setattr(kda_ops, "_fla_chunk_kda", lambda: fake_fla)
    q, k, v, g, beta = _inputs(torch.float64)
    initial = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    o_torch, _, looped = kda_chunk(
        q, k, v, g, beta, initial_state=initial, chunk_size=C, backend="torch", output_chunk_states=True
    )
    o_fla, _, read = kda_chunk(
        q, k, v, g, beta, initial_state=initial, chunk_size=C, backend="fla", output_chunk_states=True
    )
    assert calls == [1]
    assert torch.equal(o_fla, o_torch)
    torch.testing.assert_close(read.double(), looped, rtol=0, atol=2e-5)  # kda_chunk_end_states computes in fp32
