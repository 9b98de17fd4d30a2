"""Cached generation (k3core.generation.decode) on a real k3-nano: cache == full forward, sampling, cache sizes."""

from __future__ import annotations

import pytest
import torch

from k3core.generation.decode import (
    build_decode_cache,
    decode_cache_bytes,
    filter_logits,
    generate,
    generate_text,
    next_token,
)
from k3core.modeling.cache import K3Cache
from k3core.modeling.layers.kda import KDACache
from k3core.modeling.layers.mla import MLACache
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from tests.conftest import nano_model

MODES = ("block_attnres", "full_attnres", "scale_bias", "plain")
# fp32. Cached decoding and the full forward take different code paths (recurrent vs chunked KDA, conv tails,
# one-token matmuls); their round-off is amplified by the depth softmaxes. Measured max |diff| <= 3e-6 on logits
# of magnitude ~1.5 with this init; it grows smoothly with the init scale (it is round-off, not a bug).
TOL = 1e-5


def make_model(residual: str = "block_attnres", seed: int = 0, **overrides) -> K3ForCausalLM:
    """k3-nano (KDA layers 1-3, MLA layer 4), chunk 8 so that short prompts span several KDA chunks,
    with a larger init and random residual parameters so that every path carries signal."""
    model = nano_model(seed, residual=residual, kda_chunk_size=8, initializer_range=0.05, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("res_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def ids(B: int, T: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
def test_step_by_step_decoding_equals_full_forward(mode):
    model = make_model(mode)
    assert model.config.layer_types() == ["KDA", "KDA", "KDA", "MLA"]
    x = ids(2, 21)
    with torch.no_grad():
        full = model(x).logits
        cache = K3Cache.for_config(model.config)
        steps = torch.cat([model(x[:, t : t + 1], cache=cache).logits for t in range(x.shape[1])], dim=1)
    assert full.abs().max() > 1.0  # the comparison is not between near-zero numbers
    torch.testing.assert_close(steps, full, atol=TOL, rtol=TOL)
    assert cache.seen_tokens == 21


@pytest.mark.parametrize("mode", MODES)
def test_prefill_then_decode_equals_full_forward(mode):
    model = make_model(mode)
    x = ids(2, 30)
    with torch.no_grad():
        full = model(x).logits
        cache = K3Cache.for_config(model.config)
        parts = [model(x[:, :19], cache=cache).logits]  # 19 tokens: 2 full KDA chunks of 8 and a tail
        parts += [model(x[:, t : t + 1], cache=cache).logits for t in range(19, 27)]
        parts.append(model(x[:, 27:], cache=cache).logits)  # a second multi-token chunk on a warm cache
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=TOL, rtol=TOL)


def test_greedy_generate_is_deterministic_and_matches_full_forward_argmax():
    model = make_model()
    prompt = ids(2, 9)
    out = generate(model, prompt, max_new_tokens=12)
    assert out.shape == (2, 21)
    assert torch.equal(out[:, :9], prompt)
    assert torch.equal(generate(model, prompt, max_new_tokens=12), out)
    with torch.no_grad():
        logits = model(out).logits
    # Each new token is the argmax of the full forward's logits at the previous position.
    assert torch.equal(logits[:, 8:-1].argmax(-1), out[:, 9:])
    assert torch.equal(model.generate(prompt, max_new_tokens=12), out)  # the model method delegates


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = make_model()
    prompt = ids(1, 5)

    def run(seed):
        return generate(
            model,
            prompt,
            16,
            do_sample=True,
            temperature=1.5,
            top_k=50,
            top_p=0.95,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # top_k=1 sampling is greedy decoding
    greedy = generate(model, prompt, 16)
    assert torch.equal(generate(model, prompt, 16, do_sample=True, top_k=1, generator=torch.Generator()), greedy)


def test_generate_text_greedy_is_the_full_forward_argmax_decoded_as_bytes():
    """Text in, text out: each new byte is the argmax of an uncached full forward over everything so far."""
    model = make_model()
    prompt = "ROMEO:\n"
    ids = list(prompt.encode())
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = bytes(ids[len(prompt) :]).decode("utf-8", errors="replace")
    assert generate_text(model, prompt, 10, temperature=0) == expected
    # an empty prompt starts from a newline; no tokens asked, no text
    assert generate_text(model, "", 6, temperature=0) == generate_text(model, "\n", 6, temperature=0)
    assert generate_text(model, prompt, 0) == ""
    with pytest.raises(ValueError, match="temperature"):
        generate_text(model, prompt, 4, temperature=-1.0)


def test_generate_text_sampling_is_seeded_and_is_generate_with_a_seeded_generator():
    model = make_model()
    a = generate_text(model, "to be", 24, temperature=1.5, top_k=40, seed=3)
    assert a == generate_text(model, "to be", 24, temperature=1.5, top_k=40, seed=3)
    assert a != generate_text(model, "to be", 24, temperature=1.5, top_k=40, seed=4)
    prompt = torch.tensor([list(b"to be")])
    out = generate(
        model, prompt, 24, do_sample=True, temperature=1.5, top_k=40, generator=torch.Generator().manual_seed(3)
    )
    assert a == bytes(out[0, 5:].tolist()).decode("utf-8", errors="replace")


def test_filter_logits_top_k_and_top_p_by_hand():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    kept = filter_logits(x, top_k=2).isfinite()
    assert kept.tolist() == [[False, True, True, False]]
    assert torch.equal(filter_logits(x, temperature=2.0), x / 2)
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    assert filter_logits(p, top_p=0.7).isfinite().tolist() == [[False, True, False, True]]
    assert filter_logits(p, top_p=0.5).isfinite().tolist() == [[False, True, False, False]]
    assert filter_logits(p, top_p=0.81).isfinite().tolist() == [[False, True, True, True]]
    assert filter_logits(p, top_p=1.0).isfinite().all()
    assert next_token(p).tolist() == [1]
    draws = torch.stack(
        [next_token(p, do_sample=True, top_p=0.7, generator=torch.Generator().manual_seed(s)) for s in range(40)]
    )
    assert set(draws.flatten().tolist()) == {1, 3}


def test_eos_stops_rows_and_pads_them():
    model = make_model()
    prompt = ids(2, 6)
    free = generate(model, prompt, 10)
    eos = int(free[0, 8])  # row 0's third new token
    out = generate(model, prompt, 10, eos_token_id=eos)
    first = (free[0, 6:] == eos).nonzero()[0].item()
    assert torch.equal(out[0, : 6 + first + 1], free[0, : 6 + first + 1])
    assert (out[0, 6 + first :] == eos).all()  # once finished, a row repeats eos
    # Generation stops as soon as every row has finished.
    one = generate(model, prompt[:1], 10, eos_token_id=eos)
    assert one.shape[1] == 6 + first + 1


def test_stream_callback_sees_every_new_token_in_order():
    model = make_model()
    prompt = ids(2, 4)
    seen = []
    out = generate(model, prompt, 5, stream=lambda tok: seen.append(tok.clone()))
    assert torch.equal(torch.stack(seen, dim=1), out[:, 4:])


def test_generate_restores_training_mode_and_rejects_bad_input():
    model = make_model()
    model.train()
    generate(model, ids(1, 3), 2)
    assert model.training
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids(1, 3), 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids(1, 3), 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, ids(1, 3), 2, do_sample=True, top_k=0)
    with pytest.raises(ValueError, match="batch, tokens"):
        generate(model, torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="at least one"):
        generate(model, ids(1, 0), 2)
    cache = K3Cache.for_config(model.config)
    generate(model, ids(1, 3), 2, cache=cache)
    assert cache.seen_tokens == 4  # prompt + the one fed-back token (the last token is never fed)
    with pytest.raises(ValueError, match="empty"):
        generate(model, ids(1, 3), 2, cache=cache)
    assert torch.equal(generate(model, ids(1, 3), 0), ids(1, 3))


def test_kda_cache_is_constant_and_mla_cache_grows_linearly():
    model = make_model()
    cfg = model.config
    cache = K3Cache.for_config(cfg)
    B, per_token = 2, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    sizes = []
    with torch.no_grad():
        model(ids(B, 5), cache=cache)
        sizes.append([c.nbytes() for c in cache.layers])
        for t in range(6):
            model(ids(B, 1, seed=t), cache=cache)
            sizes.append([c.nbytes() for c in cache.layers])
        model(ids(B, 20), cache=cache)
        sizes.append([c.nbytes() for c in cache.layers])
    lengths = [5, 6, 7, 8, 9, 10, 11, 31]
    H, d, k = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    kda_bytes = B * H * d * d * 4 + B * 3 * H * d * (k - 1) * 4  # fp32 state + fp32 conv tails
    for T, row in zip(lengths, sizes):
        for layer, size in enumerate(row):
            if cfg.is_mla_layer(layer):
                assert size == B * T * per_token * 4
            else:
                assert size == kda_bytes
    assert isinstance(cache.layers[0], KDACache) and isinstance(cache.layers[3], MLACache)


def test_build_decode_cache_matches_a_real_run():
    model = make_model()
    x = ids(2, 40)
    real = K3Cache.for_config(model.config)
    with torch.no_grad():
        model(x, cache=real)
    built = build_decode_cache(model, 40, batch=2)
    for a, b in zip(real.layers, built.layers):
        for name in ("latent", "conv_state", "recurrent_state"):
            if hasattr(a, name):
                ta, tb = getattr(a, name), getattr(b, name)
                assert ta.shape == tb.shape and ta.dtype == tb.dtype and ta.device == tb.device
    assert built.nbytes() == real.nbytes() == decode_cache_bytes(model, 40, batch=2)
    assert built.seen_tokens == 40


def test_decode_cache_bytes_of_a_config_on_meta():
    cfg = from_preset("k3-small")
    all_mla = cfg.replace(full_attn_layers=list(range(1, cfg.num_hidden_layers + 1)))
    a, b = decode_cache_bytes(cfg, 4096), decode_cache_bytes(cfg, 8192)
    n_mla = len(cfg.full_attn_layers)
    # Only the MLA latents grow: bf16, (kv_lora + rope) numbers per token per MLA layer.
    assert b - a == n_mla * 4096 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert decode_cache_bytes(all_mla, 8192) - decode_cache_bytes(all_mla, 4096) == 12 * 4096 * 288 * 2
    assert decode_cache_bytes(cfg, 131072) < 0.3 * decode_cache_bytes(all_mla, 131072)
    with pytest.raises(ValueError, match="seq_len"):
        decode_cache_bytes(cfg, 0)
