"""Benchmark KDA on CPU: token-by-token recurrence vs the chunked (WY / UT-transform) algorithm.

For each sequence length T, times ``kda_recurrent`` and ``kda_chunk`` (pure-PyTorch backend) in
the same process on identical fp32 inputs (best of N runs taken in turns, under
``torch.inference_mode``) and prints a table with the speedup and the agreement of the two
outputs.  On a machine shared with other jobs, ``--threads 1 --clock cpu`` gives the steadiest
numbers: with more threads than free cores every small op waits for a descheduled thread.

Example::

    python benchmarks/bench_kda.py --lengths 512 2048 8192 --repeat 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from k3core.ops.kda import kda_chunk, kda_recurrent  # noqa: E402


def make_inputs(B: int, T: int, H: int, K: int, V: int, lower_bound: float, seed: int):
    """Random KDA inputs shaped like a K3 layer: L2-normalised q/k, K3-form gate in (lower_bound, 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, g, beta


def best_of(fn, repeat: int, clock=time.perf_counter) -> tuple[float, object]:
    """Best time in ms over ``repeat`` runs (after one warm-up run), and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        out = fn()
        best = min(best, clock() - t0)
    return best * 1e3, out


def best_of_interleaved(fns: dict, repeat: int, clock=time.perf_counter) -> tuple[dict, dict]:
    """Best time in ms of each function, timed in turns (a, b, c, a, b, c, ...) after one warm-up
    run each, so that a change in machine load affects all of them alike; and each one's result."""
    outs = {name: fn() for name, fn in fns.items()}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = clock()
            outs[name] = fn()
            best[name] = min(best[name], clock() - t0)
    return {name: t * 1e3 for name, t in best.items()}, outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="sequence lengths T")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best is reported)")
    ap.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    ap.add_argument("--heads", type=int, default=4, help="heads H (default 4)")
    ap.add_argument("--head-dim", type=int, default=64, help="K = V (default 64)")
    ap.add_argument("--chunk-size", type=int, nargs="+", default=[32, 64], help="chunk size(s) C for kda_chunk")
    ap.add_argument("--lower-bound", type=float, default=-5.0, help="K3 gate lower bound (default -5)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: time.perf_counter (default); cpu: process CPU time, steadier on a busy machine "
        "(use with --threads 1, where CPU time is the single thread's time)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    B, H, D = args.batch, args.heads, args.head_dim
    print(
        f"KDA fp32 CPU  B={B} H={H} K=V={D}  threads={torch.get_num_threads()}  "
        f"best of {args.repeat} ({args.clock} clock)  torch {torch.__version__}"
    )
    header = (
        f"{'T':>7} {'C':>4} {'recurrent ms':>13} {'chunk ms':>10} {'speedup':>8} "
        f"{'max rel err':>12} {'rel RMS err':>12}"
    )
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for T in args.lengths:
            x = make_inputs(B, T, H, D, D, args.lower_bound, args.seed)
            fns = {"recurrent": lambda x=x: kda_recurrent(*x)}
            for C in args.chunk_size:
                fns[C] = lambda x=x, C=C: kda_chunk(*x, chunk_size=C, backend="torch")
            times, outs = best_of_interleaved(fns, args.repeat, clock)
            t_rec, o_rec = times["recurrent"], outs["recurrent"][0]
            for C in args.chunk_size:
                t_chk, o_chk = times[C], outs[C][0]
                diff = o_chk - o_rec
                max_rel = (diff.abs().max() / o_rec.abs().max()).item()
                rms_rel = (diff.pow(2).mean().sqrt() / o_rec.pow(2).mean().sqrt()).item()
                print(
                    f"{T:>7} {C:>4} {t_rec:>13.1f} {t_chk:>10.1f} {t_rec / t_chk:>7.1f}x "
                    f"{max_rel:>12.2e} {rms_rel:>12.2e}"
                )


if __name__ == "__main__":
    main()
