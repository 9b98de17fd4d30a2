"""Kimi Delta Attention layer (Kimi Linear report, arXiv 2510.26692; K3 variant).

q, k, v = SiLU(ShortConv_4(W x))                   each with its own depthwise causal conv
q, k    = L2Norm(q), L2Norm(k)                     per head
beta    = sigmoid(W_b x)                           one write strength per head
z       = W_fb W_fa x                              low-rank decay input, per head-channel
g       = lb * sigmoid(exp(A_log) * (z + dt_bias))       K3 ("lower_bound") form, g in (lb, 0)
g       = -exp(A_log) * softplus(z + dt_bias)            Kimi Linear ("softplus") form
o       = KDA(q, k, v, g, beta)                    delta rule with per-channel decay exp(g)
out     = W_o (RMSNorm_head(o) * sigmoid(W_g x))   gated RMSNorm; W_g full or low rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.kda import kda_chunk, kda_recurrent
from ...ops.kda.gate import kda_decay_gate
from ..config import K3Config
from ..hooks import HookContext, HookPoint, active, point
from .norm import RMSNorm

_BTHC = ("batch", "token", "head", "channel")
_STATE = ("batch", "head", "key", "value")

# The hook points of a KDA layer, in forward order (k3core.modeling.hooks; ``blocks.i.`` prefixed).
Q = HookPoint("kda.q", _BTHC, "query after the short conv and SiLU, L2-normalised per head")
K = HookPoint("kda.k", _BTHC, "key after the short conv and SiLU, L2-normalised per head")
V = HookPoint("kda.v", _BTHC, "value after the short conv and SiLU")
G = HookPoint("kda.g", _BTHC, "log decay per channel (alpha = exp(g))")
BETA = HookPoint("kda.beta", ("batch", "token", "head"), "write strength")
OUT = HookPoint("kda.o", _BTHC, "delta-rule output, before the gated RMSNorm")
GATE = HookPoint("kda.gate", _BTHC, "sigmoid output gate")
CHUNK_STATE = HookPoint(
    "kda.chunk_state", _STATE,
    "state at each chunk end, once per chunk (info: chunk, chunks, token, length, start, chunk_size); a write "
    "is the state the next chunk starts from; a decoding step is one 1-token chunk",
    on_request=True,
)  # fmt: skip
STATE = HookPoint("kda.state", _STATE, "final recurrent state (info: initial, chunk_size)", on_request=True)
POINTS = (Q, K, V, G, BETA, OUT, GATE, CHUNK_STATE, STATE)


@dataclass
class KDACache:
    """Decoding state of one KDA layer: constant size, whatever the length."""

    conv_state: torch.Tensor | None = None  # [B, 3*H*d, kernel-1] last inputs of the q, k, v convs
    recurrent_state: torch.Tensor | None = None  # [B, H, d, d] fp32
    seen_tokens: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.recurrent_state) if t is not None)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's and transformers' form (not F.normalize's
    x / max(|x|, eps), which differs visibly for small vectors)."""
    # One fused norm reduction instead of x*x then sum (a second tensor of x's size, and a slow reduction
    # over a short last dim); the same formula.
    return x * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps)


class ShortConvolution(nn.Conv1d):
    """Causal depthwise conv over time (kernel 4, no bias) followed by SiLU."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, padding=0)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, C]; tail: the previous kernel-1 inputs [B, C, kernel-1] (zeros at the start).

        Returns SiLU(conv) [B, T, C] (contiguous) and the new tail [B, C, kernel-1]. The depthwise conv is
        computed as kernel shifted multiply-adds over time in x's own [B, T, C] layout: tap j reads the input
        kernel-1-j steps back. F.conv1d needed [B, C, T] in and gave a transposed view out, which made every
        later op on q, k, v strided (measured: benchmarks/README.md, "Timings behind the code")."""
        B, T, C = x.shape
        pad = self.kernel_size[0] - 1
        w = self.weight.view(C, pad + 1)
        head = x.new_zeros(B, pad, C) if tail is None else tail.transpose(1, 2).to(x.dtype)
        # The weights may be kept in fp32 under a bf16 model (published checkpoints store them in F32):
        # convolve in the weights' dtype, as the reference does, and return the input's dtype.
        full = torch.cat([head, x], dim=1)  # [B, pad + T, C]
        inp = full.to(w.dtype)
        grad = torch.is_grad_enabled() and (inp.requires_grad or w.requires_grad)
        y = inp[:, :T] * w[:, 0]
        for j in range(1, pad + 1):
            y = y + inp[:, j : j + T] * w[:, j] if grad else y.addcmul_(inp[:, j : j + T], w[:, j])
        return F.silu(y).to(x.dtype), full[:, T:].transpose(1, 2)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H, d = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.num_heads, self.head_dim = H, d
        self.q_proj = nn.Linear(D, H * d, bias=False)
        self.k_proj = nn.Linear(D, H * d, bias=False)
        self.v_proj = nn.Linear(D, H * d, bias=False)
        self.q_conv1d = ShortConvolution(H * d, config.kda_conv_size)
        self.k_conv1d = ShortConvolution(H * d, config.kda_conv_size)
        self.v_conv1d = ShortConvolution(H * d, config.kda_conv_size)
        self.f_a_proj = nn.Linear(D, d, bias=False)
        self.f_b_proj = nn.Linear(d, H * d, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * d))
        if config.kda_output_gate == "full":
            self.g_proj = nn.Linear(D, H * d, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, d, bias=False)
            self.g_b_proj = nn.Linear(d, H * d, bias=False)
        self.o_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * d, D, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        # Per-channel decay rates -g spread log-uniformly over [1e-3, 1e-1] at z = 0, i.e. memory
        # horizons 1/(1 - alpha) of roughly 10 to 1000 tokens.
        rate = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        if self.config.kda_gate == "softplus":
            # Mamba / GDN / Kimi Linear: A in [1, 16], dt_bias = softplus^-1(rate) (A scales it further).
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            self.dt_bias.copy_(rate + torch.log(-torch.expm1(-rate)))
        else:
            # Lower-bound form g = lb * sigmoid(A (z + dt_bias)): with A = 1, dt_bias = logit(rate / |lb|).
            # (Mamba's dt init here would put sigmoid(A * dt_bias) near 1e-40: no forgetting at all.)
            self.A_log.zero_()
            frac = rate / abs(self.config.kda_gate_lower_bound)
            self.dt_bias.copy_(torch.log(frac) - torch.log1p(-frac))
        self.o_norm.weight.fill_(1.0)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """g = log alpha, [B, T, H, d] fp32."""
        B, T, _ = x.shape
        z = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        z = z.view(B, T, self.num_heads, self.head_dim)
        return kda_decay_gate(
            z, self.A_log.float().view(1, 1, -1, 1), self.config.kda_gate, self.config.kda_gate_lower_bound
        )

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.kda_output_gate == "full":
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, cache: KDACache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        tails = (None, None, None)
        if cache is not None and cache.conv_state is not None:
            tails = cache.conv_state.chunk(3, dim=1)
        q, tq = self.q_conv1d(self.q_proj(x), tails[0])
        k, tk = self.k_conv1d(self.k_proj(x), tails[1])
        v, tv = self.v_conv1d(self.v_proj(x), tails[2])
        q = l2_norm(q.float().view(B, T, H, d))
        k = l2_norm(k.float().view(B, T, H, d))
        v = v.view(B, T, H, d)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = self.decay(x)

        ctx, i = active(), self.layer_idx
        q, k, v = point(ctx, Q.at(i), q), point(ctx, K.at(i), k), point(ctx, V.at(i), v)
        g, beta = point(ctx, G.at(i), g), point(ctx, BETA.at(i), beta)
        want_state = ctx is not None and ctx.wants(STATE.at(i))
        initial = cache.recurrent_state if cache is not None else None
        start = cache.seen_tokens if cache is not None else 0
        if T == 1 and cache is not None:  # a decoding step: one chunk of one token
            o, state = kda_recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True)
            state = point(
                ctx, CHUNK_STATE.at(i), state, chunk=0, chunks=1, token=1, length=1, start=start, chunk_size=1
            )
        else:
            want_final, C = cache is not None or want_state, self.config.kda_chunk_size
            o, state = delta_rule(ctx, CHUNK_STATE.at(i), (q, k, v, g, beta), initial, want_final, start, C)
        if want_state:
            state = point(ctx, STATE.at(i), state, initial=initial, chunk_size=self.config.kda_chunk_size)
        if cache is not None:
            cache.conv_state = torch.cat([tq, tk, tv], dim=1).detach()
            cache.recurrent_state = state.detach()
            cache.seen_tokens += T

        o = self.o_norm(point(ctx, OUT.at(i), o).view(B, T, H, d))
        gate = point(ctx, GATE.at(i), torch.sigmoid(self.output_gate(x).view(B, T, H, d).float()).to(o.dtype))
        return self.o_proj((o * gate).reshape(B, T, H * d))


def delta_rule(
    ctx: HookContext | None,
    name: str,
    qkvgb: tuple[torch.Tensor, ...],
    initial: torch.Tensor | None,
    want_final: bool,
    start: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final state) of the chunked delta rule (``kda_chunk``) on a call's tokens.

    With the hook point ``name`` (a layer's ``kda.chunk_state``) hooked, the state at each chunk end passes
    through it (info: chunk, chunks, token = the end position in this call, length, start = cached tokens
    before, chunk_size): the op returns its chunk-end states (``output_chunk_states``), and when a write
    replaces the state after chunk m, the op runs again on the tokens after chunk m from the replacement.
    Outputs before the replaced state are the first run's (a state change reaches only later chunks); later
    outputs and the final state follow the replacement."""
    C = chunk_size
    if ctx is None or not ctx.wants(name):
        return kda_chunk(*qkvgb, initial_state=initial, output_final_state=want_final, chunk_size=C)
    T = qkvgb[0].shape[1]
    info = dict(chunks=-(-T // C), length=T, start=start, chunk_size=C)
    outs, first, state = [], 0, initial  # first: the chunk this run starts at
    while True:
        part = (x[:, first * C :] for x in qkvgb)
        o, state, ends = kda_chunk(*part, initial_state=state, output_final_state=True, chunk_size=C,
                                   output_chunk_states=True)  # fmt: skip
        replaced = None
        for j in range(ends.shape[1]):
            n, end = first + j, ends[:, j]
            new = point(ctx, name, end, chunk=n, token=min((n + 1) * C, T), **info)
            if new is not end:
                if tuple(new.shape) != tuple(end.shape):
                    raise ValueError(f"{name}: a write must keep the state's shape {tuple(end.shape)}, "
                                     f"got {tuple(new.shape)}")  # fmt: skip
                replaced = n, new.to(end.dtype)
                break
        if replaced is None:
            outs.append(o)
            break
        n, state = replaced
        outs.append(o[:, : (n + 1 - first) * C])
        first = n + 1
        if first * C >= T:
            break
    return (torch.cat(outs, 1) if len(outs) > 1 else outs[0]), state
