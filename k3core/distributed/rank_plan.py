"""The plan of a resident run over several GPUs (pipeline parallel): how many ranks, which layers each one holds.

Each rank holds a contiguous range of decoder layers; the first rank also holds the embedding, the last the
output depth mix, the final norm and the LM head. The bytes per layer come from the checkpoint
headers (``tensor_sizes``: fp32-kept tensors at 4 bytes, the rest at the run's dtype, quantised weights too: a
resident run holds them decoded) or, for a preset, from a meta-device model: nothing is read or allocated.

``ranks_needed`` is the fewest ranks whose contiguous ranges fit ``capacity`` bytes each (greedy filling in
depth order is optimal for that); ``split_layers`` splits over a given number of ranks with the largest rank as
small as it can be (a binary search over the cap, each cap checked greedily); ``plan_for`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..loading.names import keep_fp32, layer_of

FIRST_NAMES = ("model.embed_tokens.",)  # on the first rank; every other non-layer tensor goes on the last


@dataclass(frozen=True)
class RankShare:
    """One rank of a plan: its decoder layers [start, stop), whether it holds the embedding / the output end,
    and the bytes of its weights."""

    rank: int
    start: int
    stop: int
    first: bool
    last: bool
    nbytes: int

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class RankPlan:
    ranks: list[RankShare]
    capacity: int | None  # usable bytes per GPU the plan was made for (None: a given number of ranks)
    total_bytes: int

    def rank_of_layer(self, layer: int) -> int:
        return next(s.rank for s in self.ranks if s.start <= layer < s.stop)

    def as_rows(self) -> list[dict]:
        return [
            {"rank": s.rank, "layers": f"{s.start}-{s.stop - 1}" if s.stop > s.start else "-", "bytes": s.nbytes}
            | {"holds": ", ".join(w for w, on in (("embedding", s.first), ("output mix, norm, LM head", s.last)) if on)}
            for s in self.ranks
        ]


def memory_bytes(name: str, numel: int, dtype: torch.dtype) -> int:
    """Bytes one tensor takes in a resident run in ``dtype``: a tensor k3lab keeps in fp32 at 4 bytes, every other
    at ``dtype``'s size, quantised weights included (they are decoded as they are read)."""
    if keep_fp32(name):
        return 4 * numel
    return numel * torch.empty((), dtype=dtype).element_size()


def tensor_sizes(files: Any, dtype: torch.dtype) -> dict[str, int]:
    """{canonical name: resident bytes} of a checkpoint's text-model tensors (``CheckpointFiles``), headers only."""
    return {n: memory_bytes(n, i.numel, dtype) for n, i in files.tensors.items()}


def model_sizes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """{name: resident bytes} of a (meta-device) model's state dict."""
    return {n: memory_bytes(n, t.numel(), dtype) for n, t in model.state_dict().items()}


def layer_bytes(sizes: dict[str, int], num_layers: int) -> tuple[list[int], int, int]:
    """(bytes per decoder layer, bytes on the first rank only, bytes on the last rank only)."""
    per_layer, first, last = [0] * num_layers, 0, 0
    for name, nbytes in sizes.items():
        layer = layer_of(name)[0]
        if layer is not None and layer < num_layers:
            per_layer[layer] += nbytes
        elif name.startswith(FIRST_NAMES):
            first += nbytes
        else:
            last += nbytes
    return per_layer, first, last


def _weights(per_layer: list[int], first: int, last: int) -> list[int]:
    """Per-layer bytes with the embedding counted on layer 0 and the output end on the last layer (they go
    on the ranks holding those layers)."""
    w = list(per_layer)
    w[0] += first
    w[-1] += last
    return w


def _fill(weights: list[int], cap: int, world_size: int | None = None) -> list[range]:
    """Ranks filled in depth order up to ``cap`` bytes each (with ``world_size``: leaving at least one layer to
    each rank still to come); [] when a layer does not fit, or more than ``world_size`` ranks would be needed."""
    n = len(weights)
    ranges, start, load = [], 0, 0
    for i, b in enumerate(weights):
        must_cut = world_size is not None and n - i == world_size - len(ranges) - 1
        if i > start and (load + b > cap or must_cut):
            ranges.append(range(start, i))
            start, load = i, 0
        load += b
        if load > cap:
            return []
    ranges.append(range(start, n))
    return [] if world_size is not None and len(ranges) != world_size else ranges


def _plan(ranges: list[range], per_layer: list[int], first: int, last: int, capacity: int | None) -> RankPlan:
    shares = []
    for r, span in enumerate(ranges):
        nbytes = (
            sum(per_layer[span.start : span.stop]) + (first if r == 0 else 0) + (last if r == len(ranges) - 1 else 0)
        )
        shares.append(RankShare(r, span.start, span.stop, r == 0, r == len(ranges) - 1, nbytes))
    return RankPlan(shares, capacity, sum(per_layer) + first + last)


def ranks_needed(per_layer: list[int], first: int, last: int, capacity: int) -> RankPlan:
    """The fewest ranks of ``capacity`` bytes each (greedy filling in depth order is optimal for that), then
    balanced over that many. Raises ValueError when one layer (with the embedding or output end) does not fit."""
    weights = _weights(per_layer, first, last)
    ranges = _fill(weights, capacity)
    if not ranges:
        raise ValueError(
            f"one GPU of {capacity / 2**30:,.1f} GiB usable cannot hold the largest layer "
            f"({max(weights) / 2**30:,.1f} GiB with its share of embedding / LM head): use larger GPUs, a smaller "
            "dtype or a quantised checkpoint"
        )
    balanced = split_layers(per_layer, first, last, len(ranges))
    return _plan([s.layers for s in balanced.ranks], per_layer, first, last, capacity)


def split_layers(per_layer: list[int], first: int, last: int, world_size: int) -> RankPlan:
    """Contiguous layer ranges over exactly ``world_size`` ranks (at least one layer each), the largest rank as
    small as it can be: a binary search over the cap, each cap checked by ``_fill``."""
    n = len(per_layer)
    if not 1 <= world_size <= n:
        raise ValueError(f"cannot split {n} decoder layers over {world_size} ranks (1 to {n} ranks, one layer each)")
    weights = _weights(per_layer, first, last)
    lo, hi = max(weights), sum(weights)
    best = _fill(weights, hi, world_size)
    while lo <= hi:
        cap = (lo + hi) // 2
        ranges = _fill(weights, cap, world_size)
        if ranges:
            best, hi = ranges, cap - 1
        else:
            lo = cap + 1
    return _plan(best, per_layer, first, last, None)


def plan_for(
    sizes: dict[str, int], num_layers: int, capacity: int | None = None, world_size: int | None = None
) -> RankPlan:
    """``ranks_needed`` for GPUs of ``capacity`` usable bytes, or ``split_layers`` over ``world_size`` ranks."""
    per_layer, first, last = layer_bytes(sizes, num_layers)
    if world_size is not None:
        return split_layers(per_layer, first, last, world_size)
    if capacity is None:
        raise ValueError("give the GPU memory or the number of ranks")
    return ranks_needed(per_layer, first, last, capacity)


def sizes_of(source: str, dtype: torch.dtype) -> tuple[dict[str, int], int]:
    """({name: resident bytes}, decoder layers) of a checkpoint folder (headers only) or a preset name (shapes)."""
    from pathlib import Path

    from ..loading.folder import CheckpointFiles

    path = Path(source)
    if path.exists():
        files = CheckpointFiles.open(path)
        return tensor_sizes(files, dtype), files.config.num_hidden_layers
    from ..modeling.model import K3ForCausalLM

    model = K3ForCausalLM.from_config(source, device="meta")
    return model_sizes(model, dtype), model.config.num_hidden_layers
