"""KDA token mixer: the chunked algorithm (kda_chunk, torch backend) vs the token-by-token recurrence.

Inputs and the timing loop's problem shapes come from ``benchmarks/bench_kda.py`` (``make_inputs``),
the KDA engineer's stand-alone benchmark; this module only runs the two side by side for the table.
Shapes: one k3-small KDA layer (H = 6 heads, K = V = 128), chunk 64, K3 gate (lower bound -5), fp32.
"""

from __future__ import annotations

import torch

from k3core.ops.kda import kda_chunk, kda_recurrent

from .common import Row, inference, side_by_side


def _make_inputs():
    """bench_kda.make_inputs, or None when bench_kda.py is missing or has changed its API (the hook)."""
    try:
        from .bench_kda import make_inputs
    except ImportError:
        return None
    return make_inputs


def run(quick: bool = False) -> list[Row]:
    make_inputs = _make_inputs()
    if make_inputs is None:
        return [
            Row(
                "KDA chunk vs recurrent",
                "skipped",
                float("nan"),
                "kda_chunk",
                float("nan"),
                "kda_recurrent",
                "tok/s",
                float("nan"),
                note="benchmarks/bench_kda.py: make_inputs not importable",
            )
        ]
    rows = []
    for T in (512,) if quick else (512, 2048, 8192):
        x = make_inputs(1, T, 6, 128, 128, -5.0, 0)
        repeat = 2 if T >= 8192 else 3
        t = side_by_side(
            {
                "chunk": inference(lambda x=x: kda_chunk(*x, chunk_size=64, backend="torch")),
                "recurrent": inference(lambda x=x: kda_recurrent(*x)),
            },
            repeat=repeat,
        )
        with torch.inference_mode():
            o_c, _ = kda_chunk(*x, chunk_size=64, backend="torch")
            o_r, _ = kda_recurrent(*x)
        err = float((o_c - o_r).abs().max() / o_r.abs().max())
        rows.append(
            Row(
                "KDA chunk vs recurrent",
                f"T={T} H=6 d=128 C=64",
                T / t["chunk"],
                "kda_chunk",
                T / t["recurrent"],
                "kda_recurrent",
                "tok/s",
                t["recurrent"] / t["chunk"],
                target=">= 10" if T == 2048 else "",
                ok=t["recurrent"] / t["chunk"] >= 10 if T == 2048 else None,
                note=f"max rel err {err:.1e}",
            )
        )
    return rows


def _fwd_bwd(x: tuple[torch.Tensor, ...], op) -> None:
    """One forward + backward of ``op`` on fresh leaves (the gradient of sum(o))."""
    leaves = [t.detach().requires_grad_() for t in x]
    o, _ = op(*leaves)
    o.sum().backward()


def training_rows(quick: bool = False) -> list[Row]:
    """KDA forward + backward at the sample config's training shape (one layer: B = 8, T = 256, H = 4, d = 32,
    C = 64): the hand-written chunked backward against autograd over the same chunk forward and against autograd
    through the recurrence, and its achieved GFLOP/s (matmul FLOPs counted by torch's FlopCounterMode over one
    forward + backward) against the measured one-core fp32 matmul peak (``bench_forward.matmul_peak_gflops``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .bench_forward import matmul_peak_gflops
    from .bench_kda import make_inputs

    B, T, H, d, C = 8, 256, 4, 32, 64
    x = make_inputs(B, T, H, d, d, -5.0, 0)
    ops = {
        "hand": lambda *a: kda_chunk(*a, chunk_size=C, backend="torch"),
        "autograd": lambda *a: kda_chunk(*a, chunk_size=C, backend="torch", hand_backward=False),
        "recurrent": lambda *a: kda_recurrent(*a),
    }
    t = side_by_side({name: lambda op=op: _fwd_bwd(x, op) for name, op in ops.items()}, repeat=3 if quick else 6)
    with FlopCounterMode(display=False) as counter:
        _fwd_bwd(x, ops["hand"])
    flops = counter.get_total_flops()
    peak = matmul_peak_gflops(1024 if quick else 2048)
    achieved = flops / t["hand"] / 1e9
    case = f"fwd+bwd B={B} T={T} H={H} d={d} C={C}"
    tok = B * T
    return [
        Row("KDA chunk backward vs autograd", case, tok / t["hand"], "hand-written", tok / t["autograd"],
            "autograd over chunk fwd", "tok/s", t["autograd"] / t["hand"], note="kda_chunk forward + backward"),
        Row("KDA chunk backward vs recurrent", case, tok / t["hand"], "hand-written", tok / t["recurrent"],
            "autograd over kda_recurrent", "tok/s", t["recurrent"] / t["hand"]),
        Row("KDA chunk fwd+bwd matmul rate", case, achieved, "hand-written", peak, "fp32 matmul peak", "GFLOP/s",
            achieved / peak, note=f"{flops / 1e6:.0f} MFLOP counted (matmuls), {t['hand'] * 1e3:.1f} ms"),
    ]  # fmt: skip
