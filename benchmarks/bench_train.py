"""Training step of the sample config vs an equal-parameter plain softmax GPT (issue 24 item 4).

One step = forward with targets (cross-entropy), backward, gradient clipping at 1.0, AdamW, and (K3) the
router-bias update of its balancing rule: what ``k3core.training.loop.Trainer.train_step`` does, without
its data loader. The sample config is ``sample_checkpoints/base_config.json`` (the k3-full sample, 1.57M
parameters) at the samples' batch of 8 x 256 tokens. The GPT is ``bench_forward.PlainTransformer`` with
the same vocabulary, width, depth and heads and its SwiGLU width chosen so its parameter count equals
K3's total (K3 routes: it touches fewer weights per token than it holds).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.training.balancing import update_router_biases

from .bench_forward import PlainTransformer
from .common import Row, side_by_side

SAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "sample_checkpoints" / "base_config.json"


def equal_parameter_gpt(config: K3Config, params: int) -> PlainTransformer:
    """PlainTransformer of the config's width, depth and heads, SwiGLU width fitted to ``params`` parameters."""
    D, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    fixed = 2 * V * D + D + L * (4 * D * D + 2 * D)  # embedding, head, final norm; attention and norms per layer
    width = max(8, round((params - fixed) / (3 * D * L)))
    return PlainTransformer(V, D, config.num_attention_heads, [width] * L)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, k3: bool) -> None:
    if k3:
        loss = model(x, targets=y).loss
    else:
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if k3:
        update_router_biases(model)


def time_steps(batch: int = 8, T: int = 256, repeat: int = 3, seed: int = 0) -> dict[str, float]:
    """Best seconds of one training step of the sample config and of the equal-parameter GPT."""
    torch.manual_seed(seed)
    config = K3Config.load(SAMPLE_CONFIG)
    k3 = K3ForCausalLM.from_config(config).train()
    gpt = equal_parameter_gpt(config, k3.num_parameters()).train()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch, T + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    opt_k3 = torch.optim.AdamW(k3.parameters(), lr=1e-4)
    opt_gpt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    times = side_by_side(
        {"k3": lambda: _step(k3, opt_k3, x, y, True), "gpt": lambda: _step(gpt, opt_gpt, x, y, False)}, repeat=repeat
    )
    times["k3_params"] = k3.num_parameters()
    times["gpt_params"] = sum(p.numel() for p in gpt.parameters())
    return times


def run(quick: bool = False) -> list[Row]:
    batch, T = (8, 256)
    t = time_steps(batch, T, repeat=2 if quick else 4)
    tok = batch * T
    ratio = t["gpt"] / t["k3"]
    return [
        Row(
            "training step tokens/s",
            f"sample config B={batch} T={T}",
            tok / t["k3"],
            "K3 (k3-full config)",
            tok / t["gpt"],
            "equal-param softmax GPT",
            "tok/s",
            ratio,
            target=">= 1",
            ok=ratio >= 1,
            note=f"fwd+bwd+clip+AdamW; {t['k3_params'] / 1e6:.2f}M vs {t['gpt_params'] / 1e6:.2f}M params",
        )
    ]
