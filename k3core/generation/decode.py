"""Cached autoregressive generation, and decode-cache sizing.

    prefill:  logits, cache = model(prompt, cache=K3Cache.for_config(cfg))     one forward, KDA chunked
    decode:   for each new token x_t:  logits, cache = model(x_t, cache)       one token per step

What the cache holds per layer (see ``k3core/modeling/layers``):

- KDA layer: the last ``kernel-1`` inputs of its q/k/v short convolutions ([B, 3*H*d, kernel-1], model
  dtype) and the recurrent state S ([B, H, d, d], fp32). Constant size, whatever the length.
- MLA layer: the latent of every past token, c and k_rope ([B, T, kv_lora + rope], model dtype).
  Grows linearly with length.

Sampling (``do_sample=True``) draws from softmax(filtered logits / temperature), where the filters are
top-k (keep the k largest logits) and top-p / nucleus (keep the smallest set of most likely tokens
whose probability reaches p). Greedy decoding (the default) takes the argmax. ``generate_text`` is
the one text-in, text-out entry point (training samples, ``k3lab generate``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..modeling.cache import K3Cache
from ..modeling.config import K3Config
from ..modeling.layers.kda import KDACache, KimiDeltaAttention
from ..modeling.layers.mla import MLACache, MultiHeadLatentAttention
from ..modeling.presets import from_preset
from ..tokenizer import ByteTokenizer, Tokenizer

__all__ = ["filter_logits", "next_token", "generate", "generate_text", "build_decode_cache", "decode_cache_bytes"]


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def _check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Logits [B, V] -> fp32 logits / temperature with filtered-out tokens set to -inf.

    top-k: keep logits >= the k-th largest (ties at the boundary are kept).
    top-p: sort by probability p_(1) >= p_(2) >= ...; keep token (i) while the mass *before* it,
    p_(1) + ... + p_(i-1), is < top_p (so the most likely token is always kept).
    """
    _check_sampling_args(temperature, top_k, top_p)
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(int(top_k), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def next_token(
    logits: torch.Tensor,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of logits [B, V] -> [B] (int64): argmax, or a draw from the filtered softmax."""
    if not do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------------


def _last_logits(model: nn.Module, ids: torch.Tensor, cache: K3Cache) -> torch.Tensor:
    """Logits [B, V] of the last position only (the LM head is not run over the whole prompt)."""
    if hasattr(model, "model") and hasattr(model, "lm_head"):
        return model.lm_head(model.model(ids, cache=cache)[:, -1])
    return model(ids, cache=cache).logits[:, -1]


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    stream: Callable[[torch.Tensor], None] | None = None,
    cache: K3Cache | None = None,
) -> torch.Tensor:
    """Autoregressive generation with a K3Cache. Returns [B, T + n] (prompt followed by new tokens).

    The prompt is run in one forward (KDA layers use the chunked kernel; MLA layers store the latent
    of every prompt token), then one token per step, each step reading and extending the cache.
    ``stream`` is called with each new token column [B] as soon as it is chosen. With ``eos_token_id``
    a row that has produced it keeps emitting it, and generation stops once every row has. Pass a
    fresh ``cache`` to inspect it afterwards (it must be empty). The model runs in eval mode under
    ``no_grad``; its training flag is restored afterwards.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, tokens] tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one prompt token")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if do_sample:
        _check_sampling_args(temperature, top_k, top_p)
    if cache is None:
        cache = K3Cache.for_config(model.config)
    elif len(cache.layers) != model.config.num_hidden_layers:
        raise ValueError(
            f"cache has {len(cache.layers)} layers, the model {model.config.num_hidden_layers}; "
            "use K3Cache.for_config(model.config)"
        )
    elif cache.seen_tokens:
        raise ValueError(f"cache must be empty, it already holds {cache.seen_tokens} tokens")
    if max_new_tokens == 0:
        return input_ids.clone()

    was_training = model.training
    model.eval()
    try:
        out = [input_ids]
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        logits = _last_logits(model, input_ids, cache)
        for step in range(max_new_tokens):
            tok = next_token(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                tok = tok.masked_fill(finished, eos_token_id)
                finished |= tok == eos_token_id
            out.append(tok.unsqueeze(1))
            if stream is not None:
                stream(tok)
            if (eos_token_id is not None and bool(finished.all())) or step + 1 == max_new_tokens:
                break
            logits = _last_logits(model, tok.unsqueeze(1), cache)
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)


def prompt_ids(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a prompt (a newline's for an empty one); ValueError over
    ``k3core.utils.input_limits.MAX_PROMPT_TOKENS`` (the CLI's and the app's one cap)."""
    from ..utils.input_limits import MAX_PROMPT_TOKENS

    ids = tokenizer.encode(prompt) or tokenizer.encode("\n")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"the prompt is {len(ids):,} tokens, over the limit of {MAX_PROMPT_TOKENS:,}: give its last part"
        )
    return ids


def generate_text(
    model: nn.Module,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> str:
    """The text ``model`` writes after ``prompt``: ``max_new_tokens`` tokens, decoded (prompt excluded).

    ``temperature > 0`` samples each token from ``softmax(logits / temperature)`` (restricted to the
    ``top_k`` largest logits when given) with a generator seeded by ``seed``, so the text is
    reproducible; ``temperature == 0`` is greedy (argmax). An empty prompt starts from a newline; one over
    MAX_PROMPT_TOKENS tokens is refused (``prompt_ids``).
    ``tokenizer`` defaults to the byte tokenizer (vocabulary 256; k3core.tokenizer has the others).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if tokenizer is None:
        tokenizer = ByteTokenizer()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
    sample = temperature > 0
    out = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature if sample else 1.0,
        top_k=top_k,
        do_sample=sample,
        generator=torch.Generator(device=device).manual_seed(seed),
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


# --------------------------------------------------------------------------------------------
# decode-cache sizing
# --------------------------------------------------------------------------------------------


def _attention_modules(
    model_or_config: nn.Module | K3Config | str, dtype: torch.dtype | None, device: str | torch.device | None
) -> tuple[K3Config, list[nn.Module], torch.dtype]:
    """(config, per-layer attention modules, activation dtype) from a model or a config / preset name."""
    if isinstance(model_or_config, (str, K3Config)):
        cfg = from_preset(model_or_config) if isinstance(model_or_config, str) else model_or_config
        dtype = dtype or torch.bfloat16
        # Attention shapes do not depend on the layer index: one module of each kind serves every layer.
        kinds = {}
        with torch.device(device or "meta"):
            for i in range(cfg.num_hidden_layers):
                cls = MultiHeadLatentAttention if cfg.is_mla_layer(i) else KimiDeltaAttention
                if cls not in kinds:
                    kinds[cls] = cls(cfg, i).to(dtype)
        return (
            cfg,
            [
                kinds[MultiHeadLatentAttention if cfg.is_mla_layer(i) else KimiDeltaAttention]
                for i in range(cfg.num_hidden_layers)
            ],
            dtype,
        )
    model = model_or_config
    if not hasattr(model, "model") or not hasattr(model, "config"):
        raise TypeError(f"expected a K3ForCausalLM, a K3Config or a preset name, got {type(model_or_config).__name__}")
    param = next(model.parameters())
    if dtype is not None and dtype != param.dtype:
        raise ValueError(f"the model holds {param.dtype} weights; its cache dtype follows them, not {dtype}")
    if device is not None and torch.device(device) != param.device:
        raise ValueError(f"the model lives on {param.device}, not {device}")
    return model.config, [layer.self_attn for layer in model.model.layers], param.dtype


@torch.no_grad()
def build_decode_cache(
    model_or_config: nn.Module | K3Config | str,
    seq_len: int,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    probe_tokens: int = 4,
) -> K3Cache:
    """The K3Cache the model holds after reading ``seq_len`` tokens, with its tensors really allocated.

    Each layer's own attention code fills its cache from a short prefill of ``probe_tokens`` random
    hidden states (the real KDA / MLA code paths, so shapes and dtypes are the ones they produce; for a
    config, one module per kind is probed and the other layers get ``empty_like`` copies of its cache).
    KDA caches are then final: their size does not depend on length. MLA latents, [B, probe, c + k_rope],
    are replaced by a freshly allocated [B, seq_len, c + k_rope] tensor of the same dtype and device
    (``torch.empty``: the values are meaningless, the bytes are real), after checking that the probe
    produced exactly ``kv_lora_rank + qk_rope_head_dim`` numbers per token.

    ``model_or_config``: a K3ForCausalLM (its own layers, device and dtype), or a K3Config / preset
    name, in which case the attention layers are built on ``device`` (default "meta": shapes and
    dtypes without storage, for configs too large for this machine; numel * element_size is still
    exact) with weights in ``dtype`` (default bf16).
    """
    if int(seq_len) != seq_len or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    cfg, mods, act_dtype = _attention_modules(model_or_config, dtype, device)
    dev = next(mods[0].parameters()).device
    probe = min(int(probe_tokens), int(seq_len))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, probe, cfg.hidden_size, generator=gen).to(device=dev, dtype=act_dtype)
    cache = K3Cache.for_config(cfg)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    probed: dict[int, KDACache | MLACache] = {}  # module id -> the cache its probe produced
    for i, (mod, layer_cache) in enumerate(zip(mods, cache.layers)):
        if id(mod) not in probed:
            probe_cache = type(layer_cache)()
            mod(x, probe_cache)
            if isinstance(probe_cache, MLACache) and tuple(probe_cache.latent.shape) != (batch, probe, width):
                raise AssertionError(
                    f"layer {i}: MLA latent {tuple(probe_cache.latent.shape)}, expected {(batch, probe, width)}"
                )
            if isinstance(probe_cache, KDACache) and tuple(probe_cache.recurrent_state.shape) != (batch, H, d, d):
                raise AssertionError(
                    f"layer {i}: KDA state {tuple(probe_cache.recurrent_state.shape)}, expected {(batch, H, d, d)}"
                )
            probed[id(mod)] = probe_cache
        src = probed[id(mod)]
        if isinstance(layer_cache, MLACache):
            # Same per-token width and dtype as the probe, seq_len tokens long.
            layer_cache.latent = torch.empty(batch, seq_len, width, dtype=src.latent.dtype, device=src.latent.device)
        else:
            layer_cache.conv_state = torch.empty_like(src.conv_state)
            layer_cache.recurrent_state = torch.empty_like(src.recurrent_state)
            layer_cache.seen_tokens = int(seq_len)
    return cache


def decode_cache_bytes(
    model_or_config: nn.Module | K3Config | str,
    seq_len: int,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> int:
    """Bytes of the decode cache after ``seq_len`` tokens: ``build_decode_cache(...).nbytes()``.

    Measured from the allocated cache tensors (sum of numel * element_size), not from a formula.
    """
    return build_decode_cache(model_or_config, seq_len, batch=batch, dtype=dtype, device=device).nbytes()
