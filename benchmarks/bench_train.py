"""Training step of the sample config vs an equal-parameter plain softmax GPT (issue 24 item 4).

``python -m benchmarks.bench_train --profile`` prints where each model's step goes, part by part
(``benchmarks/train_profile.py``).

One step = forward with targets (cross-entropy), backward, gradient clipping at 1.0, AdamW, and (K3) the
router-bias update of its balancing rule: what ``k3core.training.loop.Trainer.train_step`` does, without
its data loader, and with the fused AdamW for both models (see ``setup``). The sample config is
``sample_checkpoints/base_config.json`` (the k3-full sample, 1.57M parameters) at the samples' batch of
8 x 256 tokens. The GPT is ``bench_forward.PlainTransformer`` with
the same vocabulary, width, depth and heads and its SwiGLU width chosen so its parameter count equals
K3's total (K3 routes: it touches fewer weights per token than it holds).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from k3core.modeling.config import K3Config
from k3core.modeling.model import K3ForCausalLM
from k3core.training.balancing import update_router_biases

from . import bench_kda_ratio, train_profile
from .bench_forward import PlainTransformer
from .common import Row, clock_name, side_by_side, use_clock

SAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "sample_checkpoints" / "base_config.json"


def equal_parameter_gpt(config: K3Config, params: int) -> PlainTransformer:
    """PlainTransformer of the config's width, depth and heads, SwiGLU width fitted to ``params`` parameters."""
    D, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    fixed = 2 * V * D + D + L * (4 * D * D + 2 * D)  # embedding, head, final norm; attention and norms per layer
    width = max(8, round((params - fixed) / (3 * D * L)))
    return PlainTransformer(V, D, config.num_attention_heads, [width] * L)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y, k3: bool) -> None:
    """One training step; its phases are profiler scopes (``step:...``, read by ``train_profile``)."""
    with record_function("step:forward"):
        if k3:
            loss = model(x, targets=y).loss
        else:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    with record_function("step:zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    with record_function("step:backward"):
        loss.backward()
    with record_function("step:clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with record_function("step:optimizer"):
        optimizer.step()
    if k3:
        with record_function("step:router bias"):
            update_router_biases(model)


def setup(batch: int = 8, T: int = 256, seed: int = 0):
    """(k3, gpt, their optimizers, x, y): the sample config, its equal-parameter GPT and one batch."""
    torch.manual_seed(seed)
    config = K3Config.load(SAMPLE_CONFIG)
    k3 = K3ForCausalLM.from_config(config).train()
    gpt = equal_parameter_gpt(config, k3.num_parameters()).train()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch, T + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    # fused=True for both (one kernel over all parameters instead of a loop of small ops per tensor: the
    # K3 step's AdamW 10.8 -> 3.0 ms for its 226 tensors, the GPT's 5.4 -> 1.7 ms for 59; parameters within
    # 1.1e-8 of the loop after 3 steps). k3core.training.loop.Trainer still uses the default (loop) form.
    opt_k3 = torch.optim.AdamW(k3.parameters(), lr=1e-4, fused=True)
    opt_gpt = torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=True)
    return k3, gpt, opt_k3, opt_gpt, x, y


def time_steps(batch: int = 8, T: int = 256, repeat: int = 3, seed: int = 0) -> dict[str, float]:
    """Best seconds of one training step of the sample config and of the equal-parameter GPT."""
    k3, gpt, opt_k3, opt_gpt, x, y = setup(batch, T, seed)
    times = side_by_side(
        {"k3": lambda: train_step(k3, opt_k3, x, y, True), "gpt": lambda: train_step(gpt, opt_gpt, x, y, False)},
        repeat=repeat,
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
            target=">= 0.8",
            ok=ratio >= 0.8,
            note=f"fwd+bwd+clip+AdamW; {t['k3_params'] / 1e6:.2f}M vs {t['gpt_params'] / 1e6:.2f}M params",
        ),
        *bench_kda_ratio.training_rows(quick),
    ]


def shape_table(shapes: list[tuple[int, int]], threads: list[int], repeat: int = 2, log=print) -> None:
    """Tokens/s of one training step of K3 (sample config) and the GPT at each (batch, seq len) and torch thread
    count, one line each as it is measured (the fixed cost per step amortises over the tokens of a step). One
    thread is timed in process CPU time; more threads in wall time (CPU time would add the threads' times up)."""
    log(f"{'threads':>7} {'batch':>5} {'T':>5} {'tokens':>6} | {'K3 tok/s':>9} {'GPT tok/s':>9} {'K3/GPT':>6}")
    before, clock = torch.get_num_threads(), clock_name()
    try:
        for n in threads:
            torch.set_num_threads(n)
            use_clock("cpu" if n == 1 else "wall")
            for batch, T in shapes:
                t = time_steps(batch, T, repeat=repeat)
                tok = batch * T
                log(
                    f"{n:>7} {batch:>5} {T:>5} {tok:>6} | {tok / t['k3']:>9.0f} {tok / t['gpt']:>9.0f} "
                    f"{t['gpt'] / t['k3']:>6.2f}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(before)
        use_clock(clock)


def profile(batch: int = 8, T: int = 256, repeat: int = 3, seed: int = 0) -> str:
    """The whole-step profile of both models, part by part (``train_profile``), and their unprofiled step times."""
    k3, gpt, opt_k3, opt_gpt, x, y = setup(batch, T, seed)
    steps = {"k3": lambda: train_step(k3, opt_k3, x, y, True), "gpt": lambda: train_step(gpt, opt_gpt, x, y, False)}
    plain = side_by_side(steps, repeat=repeat)
    k3_table, k3_total = train_profile.profile_step(
        steps["k3"], train_profile.k3_parts(k3), train_profile.k3_functions()
    )
    gpt_table, gpt_total = train_profile.profile_step(steps["gpt"], train_profile.gpt_parts(gpt))
    return train_profile.format_side_by_side(
        {"K3": k3_table, "GPT": gpt_table}, {"K3": k3_total, "GPT": gpt_total}, {"K3": plain["k3"], "GPT": plain["gpt"]}
    )


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_train", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print where each model's step goes, part by part (benchmarks/train_profile.py)",
    )
    ap.add_argument(
        "--shapes",
        action="store_true",
        help="tokens/s against batch size and sequence length (4-16 x 128-512) at 1 and 2 threads",
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.shapes:
        shape_table([(4, 256), (8, 128), (8, 256), (16, 256), (8, 512), (16, 512)], [1, 2])
    elif args.profile:
        print(profile())
    else:
        from .run_all import table

        print(table(run()))


if __name__ == "__main__":
    main()
