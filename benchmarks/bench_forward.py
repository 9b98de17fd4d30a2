"""Forward throughput of K3 models vs an equal-width plain softmax Transformer, and its FLOP rate.

The baseline (``PlainTransformer``) is built from stock torch modules:

    embed (V x D) -> L x [ x + Attn(RMSNorm(x)),  x + MLP(RMSNorm(x)) ] -> RMSNorm -> LM head (D x V, untied)
    Attn: fused qkv Linear D -> 3D, H heads of D/H, causal F.scaled_dot_product_attention, out Linear D -> D
    MLP:  SwiGLU, W_down (SiLU(W_gate x) * W_up x), width F_l

Same vocabulary, number of layers L, width D and head count H (the K3 config's MLA head count) as
the K3 model. The MLP width F_l of layer l is chosen so that its 3 D F_l weights equal the matmul
weights a token touches in the K3 layer's FFN (dense FFN: the same width; LatentMoE: router +
latent down/up projections + k routed experts + shared experts), rounded to a multiple of 64. So the
baseline has the same per-token FFN cost as K3 and full softmax attention in every layer.

FLOPs per token of the K3 forward (``forward_flops_per_token``), counted analytically from the config:

    matmuls     2 * (active matmul weights): every nn.Linear (LM head included, embedding lookup not),
                the router, k of E routed experts per MoE layer, the depthwise short convs (kernel x channels)
    MLA         per layer H (d_qk + d_v) (T + 1): QK^T and AV, causal, i.e. (T+1)/2 keys on average
    KDA         per layer H (8 C d + 6 d^2 + 2 C^2 / 3), d = head dim, C = chunk size: the matmuls of the
                chunked algorithm in k3core/ops/kda/chunk.py (intra-chunk scores 2Cd, UT inverse ~2C^2/3,
                U and W 4Cd, state passing 4d^2, outputs 2d^2 + 2Cd)
    not counted norms, gates, activations, AttnRes depth mixes, softmax (elementwise work)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3core.modeling.config import K3Config
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

from .common import Row, inference, side_by_side


class _Block(nn.Module):
    def __init__(self, D: int, H: int, ffn: int):
        super().__init__()
        self.heads = H
        self.attn_norm = nn.RMSNorm(D, eps=1e-5)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.mlp_norm = nn.RMSNorm(D, eps=1e-5)
        self.gate = nn.Linear(D, ffn, bias=False)
        self.up = nn.Linear(D, ffn, bias=False)
        self.down = nn.Linear(ffn, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainTransformer(nn.Module):
    """Pre-norm softmax Transformer from torch modules (see the module docstring)."""

    def __init__(self, vocab: int, D: int, heads: int, ffn_widths: list[int]):
        super().__init__()
        if D % heads:
            raise ValueError(f"width {D} is not divisible by {heads} heads")
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(_Block(D, heads, f) for f in ffn_widths)
        self.norm = nn.RMSNorm(D, eps=1e-5)
        self.head = nn.Linear(D, vocab, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def ffn_active_weights(model: K3ForCausalLM, layer_idx: int) -> int:
    """Matmul weights a token touches in one layer's FFN (dense, or router + latent projections +
    k routed experts + shared experts)."""
    layer = model.model.layers[layer_idx]
    if not layer.is_moe:
        return sum(m.weight.numel() for m in layer.mlp.modules() if isinstance(m, nn.Linear))
    moe = layer.block_sparse_moe
    k = model.config.num_experts_per_token
    linear = sum(m.weight.numel() for m in moe.modules() if isinstance(m, nn.Linear))
    per_expert = sum(getattr(moe.experts, w)[0].numel() for w in moe.experts.WEIGHTS)
    return linear + moe.gate.weight.numel() + k * per_expert


def baseline_for(config: K3Config | str) -> PlainTransformer:
    """The equal-width baseline of a K3 config, FFN widths matched to K3's active FFN weights."""
    cfg = from_preset(config) if isinstance(config, str) else config
    meta = K3ForCausalLM.from_config(cfg, device="meta")
    D = cfg.hidden_size
    widths = [max(64, round(ffn_active_weights(meta, i) / (3 * D) / 64) * 64) for i in range(cfg.num_hidden_layers)]
    return PlainTransformer(cfg.vocab_size, D, cfg.num_attention_heads, widths)


def matmul_weights_per_token(config: K3Config | str) -> int:
    """Active matmul weights per token: all nn.Linear (LM head included), routers, k of E experts, convs."""
    cfg = from_preset(config) if isinstance(config, str) else config
    model = K3ForCausalLM.from_config(cfg, device="meta")
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
    for moe in model.moe_layers():
        per_expert = sum(getattr(moe.experts, w)[0].numel() for w in moe.experts.WEIGHTS)
        total += moe.gate.weight.numel() + cfg.num_experts_per_token * per_expert
    return total


def forward_flops_per_token(config: K3Config | str, T: int) -> dict[str, float]:
    """Forward FLOPs per token at sequence length T, by part (see the module docstring), and the total."""
    cfg = from_preset(config) if isinstance(config, str) else config
    n_mla = sum(cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    H, d, C = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_chunk_size
    parts = {
        "matmul": 2.0 * matmul_weights_per_token(cfg),
        "mla_attention": n_mla * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * (T + 1),
        "kda_chunked": n_kda * H * (8 * C * d + 6 * d * d + 2 * C * C / 3),
    }
    parts["total"] = sum(parts.values())
    return parts


def plain_flops_per_token(model: PlainTransformer, T: int) -> float:
    """Baseline forward FLOPs per token: 2 * matmul weights + causal attention 4 D (T+1)/2 per layer."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    D = model.embed.embedding_dim
    return 2.0 * weights + len(model.blocks) * 2 * D * (T + 1)


def time_forwards(preset: str, T: int, batch: int, repeat: int, seed: int = 0, warmup: int = 1) -> dict[str, float]:
    """Best forward seconds of the K3 preset and its baseline on the same random tokens (fp32, CPU)."""
    torch.manual_seed(seed)
    k3 = K3ForCausalLM.from_config(preset).eval()
    base = baseline_for(k3.config).eval()
    ids = torch.randint(0, k3.config.vocab_size, (batch, T), generator=torch.Generator().manual_seed(seed))
    return side_by_side(
        {"k3": inference(lambda: k3(ids)), "plain": inference(lambda: base(ids))}, repeat=repeat, warmup=warmup
    )


def matmul_peak_gflops(n: int = 2048, repeat: int = 5) -> float:
    """Measured fp32 matmul rate: best of ``repeat`` n x n @ n x n products, 2 n^3 FLOPs each."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    t = side_by_side({"mm": lambda: torch.matmul(a, b)}, repeat=repeat)["mm"]
    return 2 * n**3 / t / 1e9


def run(quick: bool = False) -> list[Row]:
    """Forward tokens/s of k3-mini and k3-small vs the baseline; achieved GFLOP/s of k3-small vs matmul peak."""
    rows = []
    cases = [("k3-mini", 512, 2, 3), ("k3-small", 512, 1, 2)]
    if not quick:
        cases = [
            ("k3-mini", 512, 4, 5),
            ("k3-mini", 4096, 1, 3),
            ("k3-mini", 8192, 1, 2),
            ("k3-mini", 16384, 1, 1),
            ("k3-small", 512, 2, 3),
            ("k3-small", 4096, 1, 2),
            ("k3-small", 8192, 1, 1),
        ]
    small, previous = {}, {}
    for preset, T, batch, repeat in cases:
        t = time_forwards(preset, T, batch, repeat, warmup=0 if T * batch >= 4096 and preset == "k3-small" else 1)
        tok = batch * T
        ratio = t["plain"] / t["k3"]
        # issue 24: at least as fast as the baseline from T = 4096, and a higher ratio with every doubling
        target, ok = "", None
        if T >= 4096 and batch == 1:
            before = previous.get(preset)
            target = ">= 1" + (f", > {before:.3g} (T/2)" if before is not None else "")
            ok = ratio >= 1 and (before is None or ratio > before)
            previous[preset] = ratio
        rows.append(
            Row(
                "forward tokens/s",
                f"{preset} T={T} B={batch}",
                tok / t["k3"],
                "K3",
                tok / t["plain"],
                "plain Transformer",
                "tok/s",
                ratio,
                target=target,
                ok=ok,
                note=f"best of {repeat}; baseline = equal-width pre-norm softmax + SwiGLU (active-FFN-matched)",
            )
        )
        if preset == "k3-small":
            small[T] = (tok, t["k3"])
    peak = matmul_peak_gflops(1024 if quick else 2048)
    for T, (tok, sec) in small.items():
        flops = forward_flops_per_token("k3-small", T)["total"] * tok
        achieved = flops / sec / 1e9
        rows.append(
            Row(
                "achieved GFLOP/s",
                f"k3-small T={T}",
                achieved,
                "K3 forward",
                peak,
                "fp32 matmul peak",
                "GFLOP/s",
                achieved / peak,
                note=f"{forward_flops_per_token('k3-small', T)['total'] / 1e6:.0f} MFLOP/token (analytic)",
            )
        )
    return rows
