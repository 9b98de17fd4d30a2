"""The survey's building blocks: expert-cache simulation, bounded mergeable aggregates, routing formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.metrics import expert_cache as ec
from analysis.metrics.intervals import wilson_interval
from analysis.metrics.routing_stats import (
    byte_classes,
    chosen_mask,
    cutoff_gaps,
    lift,
    reap_saliency,
    selection_margin,
    specialisation,
    string_class,
)
from analysis.survey.aggregates import TopK, bin_index, grouped_histogram, uniform_hash

traces = st.lists(st.integers(0, 4), min_size=0, max_size=11)


@settings(max_examples=150, deadline=None)
@given(traces, st.integers(0, 5))
def test_belady_equals_the_exhaustive_optimum(trace, size):
    assert ec.simulate_cache(trace, size, "belady") == ec.optimal_hits(trace, size)


@settings(max_examples=150, deadline=None)
@given(traces)
def test_stack_pass_equals_direct_simulation_at_every_size(trace):
    for policy in ec.POLICIES:
        hits = ec.stack_hits(trace, 6, policy)
        assert list(hits) == [ec.simulate_cache(trace, c, policy) for c in range(7)], policy
    assert (ec.reuse_distances(trace) == ec.stack_distances(trace, "lru")).all()


def _lru_by_hand(trace, size):
    cache: list[int] = []  # most recent last
    hits = 0
    for key in trace:
        if key in cache:
            hits += 1
            cache.remove(key)
        elif not size:
            continue
        elif len(cache) == size:
            cache.pop(0)
        cache.append(key)
    return hits


def _lfu_by_hand(trace, size):
    counts, last, cache, hits = {}, {}, set(), 0
    for t, key in enumerate(trace):
        counts[key] = counts.get(key, 0) + 1
        if key in cache:
            hits += 1
        elif size:
            if len(cache) == size:
                cache.remove(min(cache, key=lambda k: (counts[k], last[k])))
            cache.add(key)
        last[key] = t
    return hits


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=30), st.integers(0, 7))
def test_lru_and_lfu_equal_a_plain_simulation(trace, size):
    assert ec.simulate_cache(trace, size, "lru") == _lru_by_hand(trace, size)
    assert ec.simulate_cache(trace, size, "lfu") == _lfu_by_hand(trace, size)
    assert ec.stack_hits(trace, 7, "lfu")[size] == _lfu_by_hand(trace, size)


def test_belady_beats_lru_on_a_cyclic_trace():
    trace = [0, 1, 2] * 5  # LRU with 2 slots misses every time; OPT keeps one of them
    assert ec.simulate_cache(trace, 2, "lru") == 0
    assert ec.simulate_cache(trace, 2, "belady") == ec.optimal_hits(trace, 2) == 6


def test_reuse_distance_and_access_trace():
    assert list(ec.reuse_distances([3, 1, 3, 2, 1, 1])) == [ec.COLD, ec.COLD, 1, ec.COLD, 2, 0]
    experts = np.array([[[0, 1], [1, 2]], [[2, 0], [0, 1]]])  # [layer 2, token 2, rank 2]
    assert list(ec.access_trace(experts, 3)) == [0, 1, 5, 3, 1, 2, 3, 4]
    assert list(ec.cache_sizes(5)) == [1, 2, 3, 4, 5]
    sizes = ec.cache_sizes(1000, points=10)
    assert sizes[0] == 1 and sizes[-1] == 1000 and len(sizes) <= 10


def test_histograms_bin_as_documented():
    edges = np.array([0.0, 1.0, 2.0])
    assert list(bin_index([-1, 0, 0.5, 1, 2, 5], edges)) == [0, 1, 1, 2, 3, 3]
    h = grouped_histogram(np.array([[0.5, 3.0], [np.nan, -2.0]]), np.array([[0], [1]]), 2, edges)
    assert h.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]


def _brute_topk(groups, scores, ids, k, G):
    out = []
    for g in range(G):
        items = sorted([(-s, i) for gg, s, i in zip(groups, scores, ids) if gg == g])[:k]
        out.append({i for _, i in items})
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=0, max_size=40), st.integers(1, 4))
def test_topk_is_exact_and_merges_in_any_split(items, k):
    groups = np.array([g for g, _ in items], dtype=np.int64)
    scores = np.array([s for _, s in items], dtype=np.float64)  # many ties: broken by id
    ids = np.arange(len(items), dtype=np.int64)
    whole = TopK.empty(3, k, 1).offer(groups, scores, ids, lambda idx: ids[idx, None] * 10)
    cut = len(items) // 3
    a = TopK.empty(3, k, 1).offer(groups[:cut], scores[:cut], ids[:cut], lambda idx: ids[:cut][idx, None] * 10)
    b = TopK.empty(3, k, 1).offer(groups[cut:], scores[cut:], ids[cut:], lambda idx: ids[cut:][idx, None] * 10)
    for merged in (a.merge(b), b.merge(a)):
        assert (merged.id == whole.id).all() and (merged.score == whole.score).all()
        assert (merged.payload == whole.payload).all()
    assert [set(r[r >= 0].tolist()) for r in whole.id] == _brute_topk(groups, scores, ids, k, 3)
    live = whole.id >= 0
    assert (whole.payload[..., 0][live] == whole.id[live] * 10).all()


def test_uniform_hash_is_seeded_and_uniform():
    ids = np.arange(20000)
    a, b = uniform_hash(1, ids), uniform_hash(2, ids)
    assert (a == uniform_hash(1, ids)).all() and not (a == b).all()
    assert 0 <= a.min() and a.max() < 1 and abs(a.mean() - 0.5) < 0.01


def test_wilson_interval_matches_the_formula():
    low, high = wilson_interval(np.array([0, 5, 10]), 10)
    z = 1.96
    p, n = 0.5, 10
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert low[1] == pytest.approx(centre - half) and high[1] == pytest.approx(centre + half)
    assert low[0] == 0 and high[2] == 1 and 0 < high[0] < 0.35
    assert np.isnan(wilson_interval(np.array([0]), 0)[0]).all()


def test_margins_cutoffs_and_masks():
    sel = np.array([[0.9, 0.1, 0.5, 0.7]])
    scores = sel - 0.1
    assert selection_margin(sel, 2) == pytest.approx([0.2])  # 0.7 - 0.5
    assert cutoff_gaps(sel, scores, 2)[0] == pytest.approx([0.5 - 0.8, 0.5, 0.1, -0.1])
    assert chosen_mask(np.array([[0, 3]]), 4).tolist() == [[True, False, False, True]]


def test_classes_lift_specialisation_saliency():
    cls = byte_classes()
    assert [cls[ord(c)] for c in "aZ7 .\n"] == [0, 1, 2, 3, 4, 3] and cls[0xC3] == 5
    assert [string_class(s) for s in (" the", "The", "42", "  ", "!!", "a1")] == [0, 1, 2, 3, 4, 5]
    counts = np.array([[10, 0], [5, 5], [0, 0]])
    corpus = np.array([50, 50])
    assert lift(counts, corpus)[0].tolist() == [2.0, 0.0] and np.isnan(lift(counts, corpus)[2]).all()
    s = specialisation(counts, corpus)
    assert s[0] == pytest.approx(1.0) and s[1] == pytest.approx(0.0) and np.isnan(s[2])
    assert reap_saliency(np.array([3.0, 1.0]), np.array([2, 0]))[0] == 1.5
