"""Expert-cache simulation: what a cache of routed experts would hit on a routing trace (see DIAGNOSTICS.md).

An *access trace* is the sequence of expert keys an engine asks for, in order: for a decoding engine, token by
token and within a token layer by layer, each layer's k chosen experts in rank order (``access_trace``). A cache
holds ``C`` experts; an access is a hit when its expert is cached, else a miss that loads it (evicting one when
full: demand paging, the cache starts empty). Three eviction policies:

- **LRU**: evict the expert used least recently.
- **LFU**: evict the expert used least often so far in the trace (counts over the whole trace, kept also for
  experts not cached: "perfect LFU"); ties go to the least recently used.
- **Belady (OPT)**: evict the expert whose next use is farthest in the future (never used again: farthest;
  ties: the larger key). Optimal: no policy has fewer misses on the trace (Belady 1966).

All three rank every key by a priority that does not depend on ``C``, so they are *stack algorithms* (Mattson et
al. 1970): the cache of size ``C`` is always the top ``C`` of one priority stack, and one pass over the trace gives
the hits at every cache size at once (``stack_hits``). The *stack distance* of an access is its key's depth in
that stack (0 = top); it hits exactly in the caches with ``C > depth``. For LRU the stack distance is the classic
*reuse distance*: the number of distinct other experts used since this one's last use (``reuse_distances``).
``simulate_cache`` is the direct, one-size simulation the stack pass is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

POLICIES = ("lru", "lfu", "belady")
COLD = -1  # the stack distance of a first use (a miss at every cache size)


def access_trace(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Token-major access keys of one sequence: ``experts`` [layer, token, rank] (ids in 0..E-1) ->
    ``key = layer * E + expert`` ordered (token, layer, rank), shape [token * layer * rank]."""
    experts = np.asarray(experts, dtype=np.int64)
    if experts.ndim != 3:
        raise ValueError(f"experts must be [layer, token, rank], got shape {experts.shape}")
    layers = np.arange(experts.shape[0], dtype=np.int64)[:, None, None]
    return (layers * num_experts + experts).transpose(1, 0, 2).reshape(-1)


def next_uses(trace: Sequence[int]) -> np.ndarray:
    """For each access ``t``, the index of the next access to the same key (``len(trace)`` when none)."""
    keys = _as_list(trace)
    n = len(keys)
    out = [n] * n
    seen: dict[int, int] = {}
    for t in range(n - 1, -1, -1):
        key = keys[t]
        out[t] = seen.get(key, n)
        seen[key] = t
    return np.asarray(out, dtype=np.int64)


def _as_list(trace: Sequence[int]) -> list[int]:
    return np.asarray(trace, dtype=np.int64).reshape(-1).tolist()


def _priorities(trace: Sequence[int], policy: str) -> list[int]:
    """The priority each access gives its key (larger = keep; other keys keep theirs), one integer per access:
    LRU ``t``; LFU ``count * n + t`` (count first, then recency); Belady ``-(next_use * K + key)`` with K above
    every key (the sooner next use first, then the smaller key)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    trace = _as_list(trace)
    n = len(trace)
    if policy == "lru":
        return list(range(n))
    if policy == "lfu":
        counts: dict[int, int] = {}
        out = []
        for t, key in enumerate(trace):
            counts[key] = counts.get(key, 0) + 1
            out.append(counts[key] * (n + 1) + t)
        return out
    nxt = next_uses(trace).tolist()
    span = max(trace) + 1 if n else 1
    return [-(nxt[t] * span + trace[t]) for t in range(n)]


def stack_distances(trace: Sequence[int], policy: str = "lru") -> np.ndarray:
    """Depth of each access's key in the policy's priority stack before the access (COLD for a first use).

    Mattson's update: the accessed key goes to the top; the key that was on top is carried down through the
    depths above the accessed key's old one (the whole stack on a first use), at each depth the lower-priority
    of the carried key and the key there is carried on, and the last one carried fills the hole."""
    prio = _priorities(trace, policy)
    trace = _as_list(trace)
    stack: list[int] = []
    current: dict[int, int] = {}  # key -> its priority now (every key ever used stays in the stack)
    out = [COLD] * len(trace)
    for t, key in enumerate(trace):
        depth = stack.index(key) if key in current else COLD
        out[t] = depth
        end = depth if depth != COLD else len(stack)
        if depth == COLD:
            stack.append(key)
        if policy == "lru":  # recency order: the carried key always wins, so this is move-to-front
            del stack[end]
            stack.insert(0, key)
            current[key] = prio[t]
            continue
        if end > 0:
            carried = stack[0]
            for i in range(1, end):
                here = stack[i]
                if current[carried] > current[here]:  # the carried key stays here, this one goes on down
                    stack[i], carried = carried, here
            stack[end] = carried
        stack[0] = key
        current[key] = prio[t]
    return np.asarray(out, dtype=np.int64)


def hits_by_size(distances: np.ndarray, max_size: int) -> np.ndarray:
    """Hits at every cache size ``C = 0..max_size`` from stack distances: ``hits[C] = #{t : 0 <= d_t < C}``."""
    d = np.asarray(distances, dtype=np.int64)
    counts = np.bincount(d[(d >= 0) & (d < max_size)], minlength=max_size)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def stack_hits(trace: Sequence[int], max_size: int, policy: str = "lru") -> np.ndarray:
    """Hits of the policy at every cache size 0..max_size on the trace, from one stack pass: [max_size + 1]."""
    return hits_by_size(stack_distances(trace, policy), max_size)


def simulate_cache(trace: Sequence[int], size: int, policy: str = "lru") -> int:
    """Hits of one cache of ``size`` experts on the trace, simulated directly (the reference for the stack pass)."""
    if size < 0:
        raise ValueError(f"cache size must be >= 0, got {size}")
    prio = _priorities(trace, policy)
    trace = _as_list(trace)
    cached: dict[int, tuple] = {}
    current: dict[int, int] = {}
    hits = 0
    for t, key in enumerate(trace):
        key = int(key)
        if key in cached:
            hits += 1
        elif size > 0:
            if len(cached) >= size:
                victim = min(cached, key=lambda k: current[k])
                del cached[victim]
            cached[key] = ()
        current[key] = prio[t]
    return hits


def optimal_hits(trace: Sequence[int], size: int) -> int:
    """The most hits any demand-paging policy gets with ``size`` experts, by exhaustive search over every
    eviction choice (exponential: tiny traces only, the check of Belady's optimality)."""
    states: dict[frozenset, int] = {frozenset(): 0}
    for key in trace:
        key = int(key)
        nxt: dict[frozenset, int] = {}
        for cache, hits in states.items():
            if key in cache:
                options = [(cache, hits + 1)]
            elif size == 0:
                options = [(cache, hits)]
            elif len(cache) < size:
                options = [(cache | {key}, hits)]
            else:
                options = [((cache - {victim}) | {key}, hits) for victim in cache]
            for state, h in options:
                if nxt.get(state, -1) < h:
                    nxt[state] = h
        states = nxt
    return max(states.values())


def reuse_distances(trace: Sequence[int]) -> np.ndarray:
    """Reuse distance of each access: distinct other keys used since the key's last use (COLD for a first use);
    the LRU stack distance, computed here from last-use times (``d_t = #{k : last(k) > last(key_t)}``)."""
    last: dict[int, int] = {}
    out = np.empty(len(trace), dtype=np.int64)
    for t, key in enumerate(trace):
        key = int(key)
        if key in last:
            prev = last[key]
            out[t] = sum(1 for when in last.values() if when > prev)
        else:
            out[t] = COLD
        last[key] = t
    return out


def cache_sizes(num_keys: int, points: int = 24) -> np.ndarray:
    """The cache sizes a curve is drawn at: every size 1..num_keys when there are at most ``points``, else
    ``points`` sizes spaced geometrically from 1 to num_keys (both ends included)."""
    if num_keys <= points:
        return np.arange(1, num_keys + 1, dtype=np.int64)
    sizes = np.unique(np.round(np.geomspace(1, num_keys, points)).astype(np.int64))
    return sizes


def hit_rate(hits: np.ndarray, accesses: int) -> np.ndarray:
    """hits / accesses (NaN with no access)."""
    hits = np.asarray(hits, dtype=np.float64)
    return hits / accesses if accesses else np.full(hits.shape, math.nan)


def forward_access_trace(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """The expert reads of one batched forward of a streamed run (``k3core.loading.expert_store``): layer by layer,
    each layer's distinct chosen experts in ascending order (the sorted dispatch runs each active expert once).
    ``experts`` [layer, ...token axes, rank] -> keys ``layer * E + expert``."""
    experts = np.asarray(experts, dtype=np.int64)
    return (
        np.concatenate([layer * num_experts + np.unique(experts[layer]) for layer in range(experts.shape[0])])
        if experts.shape[0]
        else np.zeros(0, dtype=np.int64)
    )


class OnlineLRU:
    """An LRU cache of ``size`` keys fed one access at a time across forwards (the streamed run's own cache policy,
    simulated): ``access(key)`` returns whether it hit; ``hits`` and ``accesses`` count."""

    def __init__(self, size: int, warm: Sequence[int] = ()) -> None:
        """``warm``: keys already cached, least recently used first (a cache that has served before)."""
        from collections import OrderedDict

        self.size, self.hits, self.accesses = size, 0, 0
        self._keys: OrderedDict[int, None] = OrderedDict((int(k), None) for k in list(warm)[-size:] if size > 0)

    def access(self, key: int) -> bool:
        self.accesses += 1
        if key in self._keys:
            self._keys.move_to_end(key)
            self.hits += 1
            return True
        if self.size > 0:
            self._keys[key] = None
            if len(self._keys) > self.size:
                self._keys.popitem(last=False)
        return False
