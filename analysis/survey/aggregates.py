"""Bounded aggregates that merge associatively: what a corpus survey keeps instead of the tokens it read.

Every aggregate is a few numpy arrays whose size does not grow with the tokens seen, and two aggregates of
disjoint parts of a corpus merge into the aggregate of their union, in any grouping (resume, torchrun reduction):

- sums and counts: ``a + b``;
- fixed-bin histograms (``bin_index``, ``grouped_histogram``): counts per bin, ``a + b``;
- top-k tables (``TopK``): per group the ``k`` items with the largest score, ties broken by the smaller item
  id (a total order, so the kept set is unique whatever the order items arrive in);
- reservoirs: a top-k table whose score is a seeded hash of the item id (``uniform_hash``): the ``k`` items with
  the largest hash are a uniform sample without replacement, the same one however the stream is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

EMPTY_ID = -1

_MASK64 = (1 << 64) - 1


def bin_index(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of each value for fixed ``edges`` (ascending, n of them): bin 0 is ``v < edges[0]`` (underflow),
    bin i is ``edges[i-1] <= v < edges[i]``, bin n is ``v >= edges[-1]`` (overflow); n + 1 bins in all."""
    return np.searchsorted(np.asarray(edges, dtype=np.float64), np.asarray(values, dtype=np.float64), side="right")


def grouped_histogram(values: np.ndarray, groups: np.ndarray, num_groups: int, edges: np.ndarray) -> np.ndarray:
    """Counts [num_groups, len(edges) + 1]: ``h[g, b] = #{i : groups_i = g, bin_index(values_i) = b}``;
    NaN values are not counted."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.broadcast_to(np.asarray(groups, dtype=np.int64), values.shape).reshape(-1)
    values = values.reshape(-1)
    keep = ~np.isnan(values)
    bins = len(edges) + 1
    flat = groups[keep] * bins + bin_index(values[keep], edges)
    return np.bincount(flat, minlength=num_groups * bins).reshape(num_groups, bins).astype(np.int64)


def uniform_hash(seed: int, ids: np.ndarray) -> np.ndarray:
    """A seeded hash of each integer id to [0, 1) (splitmix64 of ``id + seed * golden``, top 53 bits): the
    reservoir's random key, the same for an item whichever process sees it."""
    with np.errstate(over="ignore"):
        x = np.asarray(ids, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & _MASK64)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class TopK:
    """Per group, the ``k`` items with the largest ``score`` (ties: smaller ``id`` first), each with a payload row.

    ``score`` [G, k] float64 (-inf where empty), ``id`` [G, k] int64 (EMPTY_ID where empty), ``payload``
    [G, k, W] int64 (what the item carries: a context window of token ids). Rows are kept sorted best first."""

    score: np.ndarray
    id: np.ndarray
    payload: np.ndarray

    @classmethod
    def empty(cls, groups: int, k: int, width: int) -> TopK:
        return cls(
            np.full((groups, k), -np.inf),
            np.full((groups, k), EMPTY_ID, dtype=np.int64),
            np.full((groups, k, width), EMPTY_ID, dtype=np.int64),
        )

    @property
    def k(self) -> int:
        return self.score.shape[1]

    def offer(
        self,
        group: np.ndarray,
        score: np.ndarray,
        ident: np.ndarray,
        payload_of: Callable[[np.ndarray], np.ndarray],
    ) -> TopK:
        """The table after offering candidates (``group``, ``score``, ``ident`` 1-D, ids unique and new); the payload
        is computed (``payload_of(candidate indices) -> [n, W]``) only for candidates that are kept."""
        group = np.asarray(group, dtype=np.int64).reshape(-1)
        score = np.asarray(score, dtype=np.float64).reshape(-1)
        ident = np.asarray(ident, dtype=np.int64).reshape(-1)
        G, k = self.score.shape
        # only candidates that can enter: at most the k best of each group (cheap pre-selection)
        keep = _top_per_group(group, score, ident, k)
        group, score, ident = group[keep], score[keep], ident[keep]
        payload = payload_of(keep) if keep.size else np.zeros((0, self.payload.shape[2]), dtype=np.int64)
        return self._merged(group, score, ident, np.asarray(payload, dtype=np.int64))

    def merge(self, other: TopK) -> TopK:
        """The table of both streams (associative and commutative)."""
        if self.score.shape != other.score.shape or self.payload.shape != other.payload.shape:
            raise ValueError(f"top-k tables differ in shape: {self.payload.shape} and {other.payload.shape}")
        live = other.id != EMPTY_ID
        groups = np.broadcast_to(np.arange(self.score.shape[0])[:, None], live.shape)
        return self._merged(groups[live], other.score[live], other.id[live], other.payload[live])

    def _merged(self, group: np.ndarray, score: np.ndarray, ident: np.ndarray, payload: np.ndarray) -> TopK:
        G, k = self.score.shape
        live = self.id != EMPTY_ID
        own_groups = np.broadcast_to(np.arange(G)[:, None], live.shape)[live]
        all_group = np.concatenate([own_groups, group])
        all_score = np.concatenate([self.score[live], score])
        all_id = np.concatenate([self.id[live], ident])
        all_payload = np.concatenate([self.payload[live], payload.reshape(-1, self.payload.shape[2])])
        order = np.lexsort((all_id, -all_score, all_group))
        g_sorted = all_group[order]
        starts = np.searchsorted(g_sorted, np.arange(G))
        rank = np.arange(order.size) - starts[g_sorted]
        chosen = rank < k
        out = TopK.empty(G, k, self.payload.shape[2])
        rows, cols, src = g_sorted[chosen], rank[chosen], order[chosen]
        out.score[rows, cols] = all_score[src]
        out.id[rows, cols] = all_id[src]
        out.payload[rows, cols] = all_payload[src]
        return out


def _top_per_group(group: np.ndarray, score: np.ndarray, ident: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best (score desc, id asc) candidates of each group."""
    if group.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((ident, -score, group))
    g = group[order]
    first = np.concatenate([[0], np.flatnonzero(g[1:] != g[:-1]) + 1])
    starts = np.repeat(first, np.diff(np.concatenate([first, [g.size]])))
    return np.sort(order[(np.arange(g.size) - starts) < k])
