"""k3core.ops.attention: O(T)-memory softmax attention against the path it replaced and its naive reference.

"Today's path" is what MLA ran before: one SDPA call on the unpadded q, k, v (the math kernel when the head
dims differ) with the full [T, S] boolean mask, and rows that see no key zeroed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3core.ops.attention import attention, attention_reference

# (q/k head dim, v head dim): MLA's usual split (samples 48/32), equal dims, and v wider than q/k
DIMS = [(48, 32), (32, 32), (16, 24)]


def _todays_path(q, k, v, scale, past=0, mask=None, mask_rows=None):
    """The op as it was: SDPA, with a whole [T, S] mask (a written key mask: every query's rows at once)."""
    T, S = q.shape[-2], k.shape[-2]
    if mask_rows is not None:
        mask = mask_rows(0, T, torch.ones(T, S, dtype=torch.bool).tril(diagonal=past))
    if mask is None and past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=past)
    seen = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, scale=scale)
    return out.masked_fill(~seen, 0.0)


def _qkv(T, S, dqk, dv, B=2, H=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dqk, generator=g)
    k = torch.randn(B, H, S, dqk, generator=g)
    v = torch.randn(B, H, S, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dqk, dv", DIMS)
def test_prefill_equals_todays_path_and_reference(dqk, dv):
    q, k, v = _qkv(37, 37, dqk, dv)
    scale = dqk**-0.5
    out = attention(q, k, v, scale)
    assert out.shape == (2, 3, 37, dv)
    torch.testing.assert_close(out, _todays_path(q, k, v, scale), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v, scale), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dqk, dv", DIMS)
@pytest.mark.parametrize("T, block", [(1, 1024), (5, 2), (9, 4)])
def test_decode_with_a_past_equals_todays_path(dqk, dv, T, block):
    past = 11
    q, k, v = _qkv(T, past + T, dqk, dv, seed=1)
    scale = dqk**-0.5
    out = attention(q, k, v, scale, past=past, block=block)
    torch.testing.assert_close(out, _todays_path(q, k, v, scale, past=past), rtol=0, atol=1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v, scale, past=past), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dqk, dv", DIMS)
@pytest.mark.parametrize("per_head", [False, True])
def test_written_key_mask_equals_todays_path(dqk, dv, per_head):
    """Arbitrary masks (keys hidden, some queries seeing no key at all), blocked over queries."""
    T = S = 13
    q, k, v = _qkv(T, S, dqk, dv, seed=2)
    g = torch.Generator().manual_seed(3)
    shape = (3, T, S) if per_head else (T, S)
    mask = (torch.rand(shape, generator=g) > 0.4) & torch.ones(T, S, dtype=torch.bool).tril()
    mask[..., 0, :] = False  # query 0 sees nothing: zero output, not NaN
    mask[..., 5, :] = False
    scale = dqk**-0.5
    out = attention(q, k, v, scale, mask=mask, block=4)
    want = _todays_path(q, k, v, scale, mask=mask)
    assert torch.isfinite(out).all() and (out[:, :, 0] == 0).all() and (out[..., 5, :] == 0).all()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v, scale, mask=mask), rtol=0, atol=1e-6)


def test_blocking_does_not_change_the_result():
    q, k, v = _qkv(50, 50, 48, 32, seed=4)
    mask = torch.ones(50, 50, dtype=torch.bool).tril()
    one = attention(q, k, v, 0.2, mask=mask, block=1024)
    torch.testing.assert_close(attention(q, k, v, 0.2, mask=mask, block=7), one, rtol=0, atol=1e-6)
    torch.testing.assert_close(attention(q, k, v, 0.2), one, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dqk, dv", DIMS)
def test_bf16_within_stated_tolerance(dqk, dv):
    """bf16 inputs: within 2e-2 absolute of the fp32 reference (bf16 has 8 mantissa bits; outputs are O(1))."""
    q, k, v = _qkv(64, 64, dqk, dv, seed=5)
    want = attention_reference(q, k, v, dqk**-0.5)
    got = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), dqk**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)
    got = attention(q[..., :9, :].bfloat16(), k.bfloat16(), v.bfloat16(), dqk**-0.5, past=55, block=4)
    torch.testing.assert_close(
        got.float(), attention_reference(q[..., :9, :], k, v, dqk**-0.5, past=55), rtol=0, atol=2e-2
    )


def test_gradients_match_the_reference():
    q, k, v = _qkv(20, 20, 48, 32, seed=6)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*ours, 0.3).square().sum().backward()
    attention_reference(*ref, 0.3).square().sum().backward()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise_clear_errors():
    q, k, v = _qkv(5, 7, 48, 32)
    with pytest.raises(ValueError, match="past \\+ T == S"):
        attention(q, k, v, 0.1)
    with pytest.raises(ValueError, match="block"):
        attention(q, k, v, 0.1, past=2, block=0)


def test_fused_cpu_kernel_runs_for_unequal_head_dims():
    """The reason for the padding: SDPA's math path (quadratic memory) must not run."""
    q, k, v = _qkv(64, 64, 48, 32)
    with torch.profiler.profile() as prof:
        attention(q, k, v, 0.1)
        attention(q[..., :3, :], k, v, 0.1, past=61)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert any("flash_attention" in n for n in names), names


def _mla_layer_outputs(model, ids, per_head_mask):
    """The last MLA layer's output for a prefill, a cached two-step decode and a written key mask."""
    from k3core.modeling.cache import K3Cache
    from k3core.modeling.hooks import HookNames, hooks

    layer = max(i for i in range(model.config.num_hidden_layers) if model.config.is_mla_layer(i))
    seen: dict[str, torch.Tensor] = {}

    def keep(tag):
        return lambda v, name, info: seen.__setitem__(tag, v.clone())

    name = HookNames.block(layer, "mixer_out")
    with torch.no_grad():
        with hooks(read={name: keep("prefill")}):
            model(ids)
        cache = K3Cache.for_config(model.config)
        model.model(ids[:, :-3], cache=cache)
        with hooks(read={name: keep("decode")}):
            model.model(ids[:, -3:], cache=cache)  # three new tokens after nine cached ones

        def hide(mask, name, info):
            mask = mask.clone()
            mask[..., 2:5] = False  # keys 2..4 hidden from every query; queries 2..4 then see keys 0..1 only
            mask[..., 0, :] = False  # query 0 sees nothing
            return mask.expand(model.config.num_attention_heads, *mask.shape).clone() if per_head_mask else mask

        with hooks(read={name: keep("masked")}, write={HookNames.block(layer, "mla.key_mask"): hide}):
            model(ids)
    return seen


@pytest.mark.parametrize("v_head_dim", [8, 24])  # nano: q/k head dim 16 + 8 = 24; v narrower, then equal
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_mla_layer_equals_todays_path(monkeypatch, v_head_dim, per_head_mask):
    """The model's MLA layer on the new op vs the same layer on today's path: prefill, cached decode, key mask."""
    import k3core.modeling.layers.mla as mla
    from tests.conftest import nano_model, random_ids

    model = nano_model(v_head_dim=v_head_dim)
    ids = random_ids(12, 2)
    new = _mla_layer_outputs(model, ids, per_head_mask)
    monkeypatch.setattr(mla, "attention", _todays_path)
    old = _mla_layer_outputs(model, ids, per_head_mask)
    assert new["decode"].shape[1] == 3
    assert (new["masked"][:, 5:] - new["prefill"][:, 5:]).abs().max() > 1e-3  # the written mask took effect
    torch.testing.assert_close(new["decode"], new["prefill"][:, -3:], rtol=0, atol=1e-5)  # cache = full forward
    for tag in ("prefill", "decode", "masked"):
        torch.testing.assert_close(new[tag], old[tag], rtol=0, atol=1e-6, msg=tag)


@pytest.mark.parametrize("past", [0, 5])
def test_mask_rows_per_query_block_equal_the_whole_mask_bitwise(past):
    """A written key mask given block by block (``mask_rows``, what the MLA layer's key-mask point produces) is
    exactly attention with the [T, S] mask those rows stack to (the path a whole mask took before), and the rows
    function sees only one block of queries at a time."""
    from k3core.interp.edit_kinds import MLAEdit
    from k3core.modeling.presets import from_preset

    gen = torch.Generator().manual_seed(4)
    B, H, T, S = 2, 4, 21, 21 + past
    q, k = torch.randn(B, H, T, 24, generator=gen), torch.randn(B, H, S, 24, generator=gen)
    v = torch.randn(B, H, S, 16, generator=gen)
    config = from_preset("k3-nano", num_attention_heads=H)
    for edit in (MLAEdit(keys=(0, 3)), MLAEdit(keys=(2, 9), queries=(6, 17), heads=[1, 3])):
        (_, hook), *_ = edit.hooks(config)
        causal = torch.ones(T, S, dtype=torch.bool).tril(diagonal=past)
        whole = hook(causal, "key_mask", {"start": 0, "stop": T, "past": past})  # the old form: every row at once
        calls = []

        def rows(start, stop, causal_rows, hook=hook, calls=calls):
            calls.append((start, stop))
            return hook(causal_rows, "key_mask", {"start": start, "stop": stop, "past": past})

        got = attention(q, k, v, 0.3, past=past, mask_rows=rows, block=8)
        assert calls == [(0, 8), (8, 16), (16, 21)]
        assert torch.equal(got, attention(q, k, v, 0.3, past=past, mask=whole, block=8))
        torch.testing.assert_close(got, attention_reference(q, k, v, 0.3, mask=whole), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        attention(q, k, v, 0.3, past=past, mask=whole, mask_rows=rows)


def test_a_written_key_mask_is_never_handed_over_whole():
    """At T > QUERY_BLOCK the layer's key-mask point sees one query block of rows at a time."""
    from k3core.modeling.hooks import HookNames, hooks
    from k3core.ops.attention import QUERY_BLOCK
    from tests.conftest import nano_model, random_ids

    model = nano_model()
    layer = next(i for i in range(model.config.num_hidden_layers) if model.config.is_mla_layer(i))
    T = QUERY_BLOCK + 40
    shapes = []
    with torch.no_grad(), hooks(write={HookNames.block(layer, "mla.key_mask"): lambda v, n, info: shapes.append(
        (info["start"], info["stop"], tuple(v.shape)))}):  # fmt: skip
        model(random_ids(T, 1))
    assert shapes == [(0, QUERY_BLOCK, (QUERY_BLOCK, T)), (QUERY_BLOCK, T, (40, T))]
