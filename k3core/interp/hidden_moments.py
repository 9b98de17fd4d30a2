"""The whole-text moments of the hidden states per position bin (``hidden_bins.*``), bounded at any width.

Per depth and position bin the recorder keeps ``n``, ``s = sum h``, ``U = sum h / ||h||`` and, with the previous
depth, ``sum cos(h_l, h_(l+1))``; the second moments that ``analysis.metrics.hidden_states`` turns into effective rank
and CKA are D x D. Up to ``EXACT_GRAM_MAX_WIDTH`` channels they are kept exactly (``gram = sum h h^T``,
``cross_gram = sum h_l h_(l+1)^T``). Above it they are sketched with a seeded Gaussian random projection
``R`` [D, k] (entries N(0, 1/k), ``k = SKETCH_DIM``, the same ``R`` at every depth):
``sketch_gram = sum (R^T h)(R^T h)^T = R^T G R``, ``sketch_cross_gram = R^T C R``, ``sketch_sum = R^T s``, plus the
exact trace ``sq_sum = sum ||h||^2`` (rank collapse needs only that and ``s``). The statistics are then those of the
projected states ``R^T h`` (Johnson-Lindenstrauss: their norms and inner products are the originals' within a few
percent at k = 256). The sketch is k x k whatever D (512 KB per depth, sequence and bin at k = 256, against 411 MB
exact at D = 7,168). The exact
matrices stay available at any width by name: ``what`` including ``GRAM_ITEM``. The sketch's error on the statistics
it feeds is measured in tests/k3core/interp/test_hidden_moments.py and stated in docs/DIAGNOSTICS.md.

``depth_moments`` is the one definition, used by the recorder for each depth and by the pipeline
(``k3core.distributed.pipeline.merge_traces``) for the pair of depths across a rank boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

EXACT_GRAM_MAX_WIDTH = 1024  # widths up to this keep the exact D x D Gram matrices (8 MB per depth and bin at 1,024)
SKETCH_DIM = 256  # k: columns of the random projection above that width
SKETCH_SEED = 20_261_205  # the projection's seed (recorded in trace.meta["hidden_sketch"])
GRAM_ITEM = "hidden_gram"  # a ``what`` item: the exact Gram matrices at any width (D^2 per depth and bin)
SKETCH_META = "hidden_sketch"

#: Axis names of every moment array (``hidden_bins.<kind>``).
MOMENT_AXES: dict[str, tuple[str, ...]] = {
    "sum": ("depth", "batch", "bin", "hidden"),
    "unit_sum": ("depth", "batch", "bin", "hidden"),
    "gram": ("depth", "batch", "bin", "hidden", "hidden2"),
    "sq_sum": ("depth", "batch", "bin"),
    "sketch_sum": ("depth", "batch", "bin", "sketch"),
    "sketch_gram": ("depth", "batch", "bin", "sketch", "sketch2"),
    "cross_gram": ("layer", "batch", "bin", "hidden", "hidden2"),
    "sketch_cross_gram": ("layer", "batch", "bin", "sketch", "sketch2"),
    "cos_sum": ("layer", "batch", "bin"),
}
#: The moments between consecutive depths (one fewer than the depths).
PAIR_KINDS = ("cross_gram", "sketch_cross_gram", "cos_sum")


def uses_sketch(width: int, what: Iterable[str]) -> bool:
    """Whether the second moments of states of ``width`` channels are sketched (not asked for exactly by name)."""
    return width > EXACT_GRAM_MAX_WIDTH and GRAM_ITEM not in set(what)


def sketch_projection(width: int, dim: int = SKETCH_DIM, seed: int = SKETCH_SEED) -> torch.Tensor:
    """The seeded Gaussian projection R [width, dim], float64, entries N(0, 1/dim) (so E[R R^T] = I)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)


def sketch_meta(dim: int = SKETCH_DIM, seed: int = SKETCH_SEED) -> dict:
    """What ``trace.meta["hidden_sketch"]`` says of a sketched trace."""
    return {"kind": "gaussian random projection", "dim": dim, "seed": seed, "exact_max_width": EXACT_GRAM_MAX_WIDTH}


Carry = tuple[torch.Tensor, torch.Tensor]  # (the depth's states in the Gram basis, its unit vectors)


def depth_moments(
    x: torch.Tensor, prev: Carry | None, bins: list[int], projection: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], Carry]:
    """The moments of one depth's states ``x`` [batch, token, D] (float64) per bin (edges ``bins``): {kind: [batch,
    bin, ...]}, with the pair moments to the previous depth when ``prev`` (its carry) is given; and this depth's carry.
    ``projection`` None: exact ``gram``/``cross_gram``; else R [D, k]: ``sq_sum``, ``sketch_sum``, ``sketch_gram``,
    ``sketch_cross_gram``."""
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    basis = x if projection is None else x @ projection
    gram, cross = ("gram", "cross_gram") if projection is None else ("sketch_gram", "sketch_cross_gram")
    parts: dict[str, list[torch.Tensor]] = {}
    for s, e in zip(bins[:-1], bins[1:]):
        xb = basis[:, s:e]
        parts.setdefault("sum", []).append(x[:, s:e].sum(1))
        parts.setdefault("unit_sum", []).append(unit[:, s:e].sum(1))
        if projection is not None:
            parts.setdefault("sq_sum", []).append(x[:, s:e].pow(2).sum((1, 2)))
            parts.setdefault("sketch_sum", []).append(xb.sum(1))
        parts.setdefault(gram, []).append(xb.transpose(1, 2) @ xb)
        if prev is not None:
            parts.setdefault(cross, []).append(prev[0][:, s:e].transpose(1, 2) @ xb)
            parts.setdefault("cos_sum", []).append((prev[1][:, s:e] * unit[:, s:e]).sum(-1).sum(1))
    return {kind: torch.stack(values, 1) for kind, values in parts.items()}, (basis, unit)
