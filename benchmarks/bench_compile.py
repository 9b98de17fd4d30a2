"""``k3lab train --compile``: what torch.compile buys a training step of the sample config, and when it pays back.

``python -m benchmarks --only compile`` (not in the default run: compiling takes minutes on a CPU).

In one process, from the same initial weights and batch (``bench_train.setup``), with the optimizer step of
``bench_train.train_step``:

* the compiled K3 step and the eager K3 step agree: five steps from one init, each step's loss within
  ``LOSS_RTOL`` (fused kernels round differently; fp32 noise, not a different model);
* compile time: the wall time of the first compiled step, less one eager step (inductor compiles in worker
  processes, so process CPU time would leave most of it out);
* steady-state step time, eager against compiled, timed side by side (process CPU time, best of N);
* payback: the compile time divided by the time a compiled step saves, in steps;
* the equal-parameter GPT compiled the same way, so the K3 / GPT ratio is also read with both compiled;
* the number of graphs Dynamo compiled for the K3 step: each graph break splits the forward (and its backward)
  into pieces that cannot be fused across.
"""

from __future__ import annotations

import copy
import time

import torch

from k3core.training.balancing import update_router_biases

from .bench_train import setup, train_step
from .common import Row, side_by_side

LOSS_RTOL = 1e-4
AGREEMENT_STEPS = 5


def _first_call_seconds(fn) -> float:  # wall time: inductor compiles in worker processes
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(batch: int = 8, T: int = 256, repeat: int = 3) -> dict[str, float]:
    """Step times (s), compile times (s) and the largest relative loss difference over AGREEMENT_STEPS steps."""
    k3, gpt, opt_k3, opt_gpt, x, y = setup(batch, T)
    k3_twin = copy.deepcopy(k3)
    opt_twin = torch.optim.AdamW(k3_twin.parameters(), lr=1e-4, fused=True)
    k3_compiled = torch.compile(k3_twin)
    gpt_compiled = torch.compile(gpt)

    def k3_step_loss(forward, model, optimizer) -> float:
        """``train_step`` for K3 through ``forward`` (the model or its compiled wrapper), returning the step's loss
        (read from the training forward itself: a no-grad forward would compile a second, gradient-free graph)."""
        loss = forward(x, targets=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        update_router_biases(model)
        return float(loss.detach())

    t0 = time.perf_counter()
    eager_loss = k3_step_loss(k3, k3, opt_k3)
    eager_step = time.perf_counter() - t0
    torch._dynamo.utils.counters.clear()
    t0 = time.perf_counter()
    losses = [(eager_loss, k3_step_loss(k3_compiled, k3_twin, opt_twin))]
    k3_compile = time.perf_counter() - t0 - eager_step
    k3_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Agreement from one init, step by step on the same batch.
    for _ in range(AGREEMENT_STEPS - 1):
        losses.append((k3_step_loss(k3, k3, opt_k3), k3_step_loss(k3_compiled, k3_twin, opt_twin)))
    worst = max(abs(a - b) / abs(a) for a, b in losses)
    gpt_eager = _first_call_seconds(lambda: train_step(gpt, opt_gpt, x, y, False))
    gpt_compile = _first_call_seconds(lambda: train_step(gpt_compiled, opt_gpt, x, y, False)) - gpt_eager
    times = side_by_side(
        {
            "k3": lambda: train_step(k3, opt_k3, x, y, True),
            "k3_compiled": lambda: train_step(k3_compiled, opt_twin, x, y, True),
            "gpt": lambda: train_step(gpt, opt_gpt, x, y, False),
            "gpt_compiled": lambda: train_step(gpt_compiled, opt_gpt, x, y, False),
        },
        repeat=repeat,
    )
    return {
        **times,
        "k3_compile_s": k3_compile,
        "k3_graphs": k3_graphs,
        "gpt_compile_s": gpt_compile,
        "loss_rel_diff": worst,
    }


def run(quick: bool = False) -> list[Row]:
    batch, T = 8, 256
    t = measure(batch, T, repeat=2 if quick else 4)
    tok = batch * T
    saved = t["k3"] - t["k3_compiled"]
    payback = t["k3_compile_s"] / saved if saved > 0 else float("inf")
    agree = t["loss_rel_diff"] <= LOSS_RTOL
    return [
        Row(
            "torch.compile training step",
            f"sample config B={batch} T={T}",
            tok / t["k3_compiled"],
            "K3 compiled",
            tok / t["k3"],
            "K3 eager",
            "tok/s",
            t["k3"] / t["k3_compiled"],
            target=f"loss within {LOSS_RTOL:g}",
            ok=agree,
            note=f"compile {t['k3_compile_s']:.0f} s wall ({t['k3_graphs']} graphs: graph breaks split the "
            f"forward), pays back after {payback:,.0f} steps; "
            f"loss rel diff {t['loss_rel_diff']:.1e} over {AGREEMENT_STEPS} steps",
        ),
        Row(
            "training step tokens/s, both compiled",
            f"sample config B={batch} T={T}",
            tok / t["k3_compiled"],
            "K3 compiled",
            tok / t["gpt_compiled"],
            "equal-param GPT compiled",
            "tok/s",
            t["gpt_compiled"] / t["k3_compiled"],
            target=">= 0.8",
            ok=t["gpt_compiled"] / t["k3_compiled"] >= 0.8,
            note=f"GPT compile {t['gpt_compile_s']:.0f} s; GPT eager {tok / t['gpt']:.3g} tok/s",
        ),
    ]


if __name__ == "__main__":
    from .run_all import table

    torch.set_num_threads(1)
    print(table(run()))
