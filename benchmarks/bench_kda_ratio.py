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
