"""Gated Multi-head Latent Attention with no positional encoding (DeepSeek-V2 MLA; K3 gate).

    q        = W_qb RMSNorm(W_qa x)                    (or W_q x without a q LoRA)
    c, k_r   = split(W_kva x)                          latent (kv_lora) + shared rope-part key
    k_n, v   = split(W_kvb RMSNorm(c))                 per head
    A        = softmax([q_n, q_r] [k_n, k_r]^T / sqrt(d_nope + d_rope) + causal) v
    out      = W_o (A * sigmoid(W_g x))                the K3 output gate (optional)

No rotary embedding is applied anywhere (NoPE); the "rope" part is just extra key/query width.
The decode cache stores only c and k_r per token (kv_lora + rope numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...ops.attention import attention
from ..config import K3Config
from ..hooks import HookPoint, active, point
from .norm import RMSNorm

_BHKC = ("batch", "head", "key", "channel")
_BTHC = ("batch", "token", "head", "channel")

# The hook points of an MLA layer, in forward order (k3core.modeling.hooks; ``blocks.i.`` prefixed).
Q = HookPoint("mla.q", ("batch", "head", "token", "channel"), "query (nope + rope parts)")
K = HookPoint("mla.k", _BHKC, "key (nope part per head, rope part shared), every cached key included")
V = HookPoint("mla.v", _BHKC, "value, every cached key included")
KEY_MASK = HookPoint(
    "mla.key_mask", ("query", "key"),
    "bool, True = visible: the rows of one query block at a time (info: start, stop, past; offered to writers only)",
    on_request=True,
)  # fmt: skip
OUT = HookPoint("mla.o", _BTHC, "attention output, before the gate")
GATE = HookPoint("mla.gate", _BTHC, "sigmoid output gate (gated MLA)")
POINTS = (Q, K, V, KEY_MASK, OUT, GATE)


@dataclass
class MLACache:
    """Decoding state of one MLA layer: the compressed latent of every past token."""

    latent: torch.Tensor | None = None  # [B, T, kv_lora + rope]

    @property
    def seen_tokens(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def nbytes(self) -> int:
        return 0 if self.latent is None else self.latent.numel() * self.latent.element_size()


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        qk = self.nope + self.rope
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.mla_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, config.mla_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, H * (self.nope + self.vdim), bias=False)
        if config.mla_output_gate:
            self.g_proj = nn.Linear(D, H * self.vdim, bias=False)
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)
        self.scale = qk**-0.5

    def forward(self, x: torch.Tensor, cache: MLACache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        if self.config.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, self.nope + self.rope).transpose(1, 2)  # [B, H, T, qk]

        latent = self.kv_a_proj_with_mqa(x)  # [B, T, kv_lora + rope]
        past = 0
        if cache is not None:
            past = cache.seen_tokens
            latent = latent if cache.latent is None else torch.cat([cache.latent, latent], dim=1)
            cache.latent = latent.detach()
        S = latent.shape[1]
        c, k_rope = latent.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, S, H, self.nope + self.vdim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(B, H, S, self.rope)], dim=-1)

        ctx, i = active(), self.layer_idx
        q, k, v = point(ctx, Q.at(i), q), point(ctx, K.at(i), k), point(ctx, V.at(i), v)
        rows = None
        if ctx is not None and ctx.writes(KEY_MASK.at(i)):  # a written key mask: visible keys per query block

            def rows(start: int, stop: int, causal: torch.Tensor) -> torch.Tensor:
                return point(ctx, KEY_MASK.at(i), causal, start=start, stop=stop, past=past)

        attn_out = attention(q, k, v, self.scale, past=past, mask_rows=rows)
        attn_out = point(ctx, OUT.at(i), attn_out.transpose(1, 2))  # [B, T, H, v]
        if self.config.mla_output_gate:
            gate = torch.sigmoid(self.g_proj(x).view(B, T, H, self.vdim).float()).to(attn_out.dtype)
            attn_out = attn_out * point(ctx, GATE.at(i), gate)
        return self.o_proj(attn_out.reshape(B, T, H * self.vdim))
