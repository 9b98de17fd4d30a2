"""The survey state: bounded aggregates of every batch (``SurveyState``: counts, sums, fixed-bin histograms over
``EDGES``, top-k tables and reservoirs of contexts), merged by addition in any grouping of batches.

    per-batch numpy hook reads --SurveyState.add_batch--> counts, sums, fixed-bin histograms, top-k tables
        (analysis.survey.aggregates)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from analysis.metrics.expert_cache import POLICIES, access_trace, hits_by_size, stack_distances
from analysis.metrics.moe import coactivation
from analysis.metrics.routing_stats import TOKEN_CLASSES, cutoff_gaps, selection_margin
from analysis.survey.aggregates import EMPTY_ID, TopK, grouped_histogram, uniform_hash
from analysis.survey.plan import Layout, SurveyError, SurveyPlan

# fixed bin edges (analysis.survey.aggregates.bin_index: n edges -> n + 1 bins, under- and overflow at the ends)
EDGES = {
    "score": np.linspace(0.0, 1.0, 41),
    "margin": np.linspace(0.0, 0.5, 51),
    "gap": np.linspace(-1.0, 1.0, 81),
    "kda_g": np.linspace(-10.0, 0.0, 41),
    "beta": np.linspace(0.0, 1.0, 21),
    "entropy": np.linspace(0.0, 1.0, 21),
    "sink": np.linspace(0.0, 1.0, 21),
    "maxvio": np.linspace(0.0, 4.0, 41),
}
#: MaxVio scopes kept per MoE layer besides the corpus-wide load: over each batch, over each sequence
MAXVIO_SCOPES = ("batch", "sequence")


class SurveyState:
    """The aggregates of a survey: ``sums`` (name -> array; merged by +) and ``tops`` (name -> TopK; merged by
    ``TopK.merge``), plus the batches already in it."""

    def __init__(self, layout: Layout, plan: SurveyPlan):
        self.layout, self.plan = layout, plan
        self.done: set[int] = set()
        self.sums: dict[str, np.ndarray] = {}
        self.tops: dict[str, TopK] = {}
        L = layout
        nb = {k: len(v) + 1 for k, v in EDGES.items()}
        self._zeros("tokens", (1,), np.int64)
        self._zeros("sequences", (1,), np.int64)
        self._zeros("corpus.class_counts", (len(TOKEN_CLASSES),), np.int64)
        if L.count_tokens:
            self._zeros("corpus.token_counts", (L.vocab_size,), np.int64)
        self._zeros("loss.sum", (plan.seq_len,), np.float64)
        self._zeros("loss.count", (plan.seq_len,), np.int64)
        E = L.num_experts
        width = plan.context_before + 1 + plan.context_after
        for i in L.moe_layers:
            p = f"moe.{i}."
            self._zeros(p + "load", (E,), np.int64)
            self._zeros(p + "gate_mass", (E,), np.float64)
            self._zeros(p + "coactivation", (E, E), np.int64)
            self._zeros(p + "margin_hist", (nb["margin"],), np.int64)
            self._zeros(p + "cutoff_hist", (E, nb["gap"]), np.int64)
            self._zeros(p + "chosen_hist", (E, nb["score"]), np.int64)
            self._zeros(p + "unchosen_hist", (E, nb["score"]), np.int64)
            self._zeros(p + "saliency_sum", (E,), np.float64)
            self._zeros(p + "class_counts", (E, len(TOKEN_CLASSES)), np.int64)
            if L.count_tokens:
                self._zeros(p + "token_counts", (E, L.vocab_size), np.int64)
            self._zeros(p + "reuse_hist", (E, E + 2), np.int64)
            for policy in POLICIES:
                self._zeros(p + f"cache_{policy}", (len(L.layer_sizes),), np.int64)
            self._zeros(p + "accesses", (1,), np.int64)
            for scope in MAXVIO_SCOPES:  # [count, sum, sum of squares] and a histogram of MaxVio per batch / sequence
                self._zeros(p + f"maxvio_{scope}", (3,), np.float64)
                self._zeros(p + f"maxvio_{scope}_hist", (len(EDGES["maxvio"]) + 1,), np.int64)
            self.tops[p + "top_contexts"] = TopK.empty(E, plan.top_contexts, width)
            self.tops[p + "reservoir"] = TopK.empty(E, plan.reservoir, width)
        if L.moe_layers:
            for policy in POLICIES:
                self._zeros(f"cache.model_{policy}", (len(L.model_sizes),), np.int64)
            self._zeros("cache.model_accesses", (1,), np.int64)
        for i in L.kda_layers:
            for what in ("kda_g", "beta"):
                self._zeros(f"kda.{i}.{what}_hist", (L.kda_heads, nb[what]), np.int64)
                self._zeros(f"kda.{i}.{what}_sum", (L.kda_heads,), np.float64)
            self._zeros(f"kda.{i}.count", (1,), np.int64)
        for i in L.mla_layers:
            for what in ("entropy", "sink"):
                self._zeros(f"mla.{i}.{what}_hist", (L.mla_heads, nb[what]), np.int64)
                self._zeros(f"mla.{i}.{what}_by_position", (L.mla_heads, plan.seq_len), np.float64)
            self._zeros(f"mla.{i}.rows", (1,), np.int64)
        for site, sources in L.attnres_sites.items():
            self._zeros(f"attnres.{site}.sum", (sources,), np.float64)
            self._zeros(f"attnres.{site}.sumsq", (sources,), np.float64)
            self._zeros(f"attnres.{site}.count", (1,), np.int64)

    def _zeros(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.sums[name] = np.zeros(shape, dtype=dtype)

    def merge(self, other: SurveyState) -> SurveyState:
        """This state plus another of the same plan over other batches (in place; returns self)."""
        if asdict(other.plan) != asdict(self.plan):
            raise SurveyError("cannot merge surveys of different plans")
        overlap = self.done & other.done
        if overlap:
            raise SurveyError(f"both states hold batches {sorted(overlap)[:5]}")
        for name, value in other.sums.items():
            self.sums[name] = self.sums[name] + value
        for name, top in other.tops.items():
            self.tops[name] = self.tops[name].merge(top)
        self.done |= other.done
        return self

    # ---------------------------------------------------------------------------------------- one batch
    def add_batch(self, batch: int, inputs: np.ndarray, reads: dict[str, Any]) -> None:
        """Fold one batch's hook reads (``survey_batch``) into the state."""
        if batch in self.done:
            raise SurveyError(f"batch {batch} is already in the survey")
        L, plan = self.layout, self.plan
        B, T = inputs.shape
        first_seq = batch * plan.batch_size
        positions = (first_seq + np.arange(B))[:, None] * plan.seq_len + np.arange(T)[None, :]  # global token ids
        classes = np.asarray(L.token_classes, dtype=np.int64)[inputs]
        s = self.sums
        s["tokens"] += B * T
        s["sequences"] += B
        s["corpus.class_counts"] += np.bincount(classes.ravel(), minlength=len(TOKEN_CLASSES))
        if L.count_tokens:
            s["corpus.token_counts"] += np.bincount(inputs.ravel(), minlength=L.vocab_size)
        nll = reads["token_nll"]
        valid = ~np.isnan(nll)
        s["loss.sum"] += np.where(valid, nll, 0.0).sum(0)
        s["loss.count"] += valid.sum(0)
        for i in L.moe_layers:
            self._add_moe(i, inputs, positions, classes, reads[f"moe.{i}"])
        if L.moe_layers:
            self._add_model_cache(np.stack([reads[f"moe.{i}"]["experts"] for i in L.moe_layers]))
        for i in L.kda_layers:
            g, beta = reads[f"kda.{i}.g"], reads[f"kda.{i}.beta"]  # [B, T, H, C], [B, T, H]
            heads = np.arange(L.kda_heads)
            s[f"kda.{i}.kda_g_hist"] += grouped_histogram(g, heads[:, None], L.kda_heads, EDGES["kda_g"])
            s[f"kda.{i}.kda_g_sum"] += g.astype(np.float64).sum((0, 1, 3))
            s[f"kda.{i}.beta_hist"] += grouped_histogram(beta, heads, L.kda_heads, EDGES["beta"])
            s[f"kda.{i}.beta_sum"] += beta.astype(np.float64).sum((0, 1))
            s[f"kda.{i}.count"] += B * T
        for i in L.mla_layers:
            heads = np.arange(L.mla_heads)[:, None]
            for start, ent, sink in reads[f"mla.{i}"]:
                rows = slice(1 if start == 0 else 0, None)  # row 0 (one key) is not in the distributions
                s[f"mla.{i}.entropy_hist"] += grouped_histogram(ent[..., rows], heads, L.mla_heads, EDGES["entropy"])
                s[f"mla.{i}.sink_hist"] += grouped_histogram(sink[..., rows], heads, L.mla_heads, EDGES["sink"])
                stop = start + ent.shape[-1]
                s[f"mla.{i}.entropy_by_position"][:, start:stop] += np.nan_to_num(ent, nan=0.0).sum(0)
                s[f"mla.{i}.sink_by_position"][:, start:stop] += sink.sum(0)
            s[f"mla.{i}.rows"] += B
        for site in L.attnres_sites:
            w = reads[f"attnres.{site}"].astype(np.float64).reshape(-1, L.attnres_sites[site])
            s[f"attnres.{site}.sum"] += w.sum(0)
            s[f"attnres.{site}.sumsq"] += (w * w).sum(0)
            s[f"attnres.{site}.count"] += w.shape[0]
        self.done.add(batch)

    def _add_moe(self, i: int, inputs: np.ndarray, positions: np.ndarray, classes: np.ndarray, r: dict) -> None:
        L, plan, s, p = self.layout, self.plan, self.sums, f"moe.{i}."
        E, k = L.num_experts, L.top_k
        experts, weights = r["experts"].astype(np.int64), r["weights"].astype(np.float64)  # [B, T, k]
        scores, selection = r["scores"], r["selection"]  # [B, T, E]
        flat_e = experts.reshape(-1)
        s[p + "load"] += np.bincount(flat_e, minlength=E)
        s[p + "gate_mass"] += np.bincount(flat_e, weights=weights.reshape(-1), minlength=E)
        s[p + "coactivation"] += coactivation(experts, E)
        per_sequence = np.bincount(
            (np.arange(experts.shape[0])[:, None] * E + experts.reshape(experts.shape[0], -1)).ravel(),
            minlength=experts.shape[0] * E,
        ).reshape(-1, E)
        for scope, loads in (("batch", per_sequence.sum(0, keepdims=True)), ("sequence", per_sequence)):
            vio = loads.max(-1) / loads.mean(-1) - 1.0  # moe_load_stats' MaxVio of each load row
            s[p + f"maxvio_{scope}"] += [vio.size, vio.sum(), (vio * vio).sum()]
            s[p + f"maxvio_{scope}_hist"] += grouped_histogram(vio, 0, 1, EDGES["maxvio"])[0]
        groups = np.arange(E)
        mask = np.zeros(scores.shape, dtype=bool)
        np.put_along_axis(mask, experts, True, axis=-1)
        s[p + "chosen_hist"] += grouped_histogram(np.where(mask, scores, np.nan), groups, E, EDGES["score"])
        s[p + "unchosen_hist"] += grouped_histogram(np.where(mask, np.nan, scores), groups, E, EDGES["score"])
        if k < E:
            s[p + "margin_hist"] += grouped_histogram(selection_margin(selection, k), 0, 1, EDGES["margin"])[0]
            s[p + "cutoff_hist"] += grouped_histogram(cutoff_gaps(selection, scores, k), groups, E, EDGES["gap"])
        s[p + "saliency_sum"] += np.bincount(flat_e, weights=(weights * r["out_norm"]).reshape(-1), minlength=E)
        token_class = np.broadcast_to(classes[..., None], experts.shape).reshape(-1)
        s[p + "class_counts"] += np.bincount(
            flat_e * len(TOKEN_CLASSES) + token_class, minlength=E * len(TOKEN_CLASSES)
        ).reshape(E, -1)
        if L.count_tokens:
            tok = np.broadcast_to(inputs[..., None], experts.shape).reshape(-1)
            s[p + "token_counts"] += np.bincount(flat_e * L.vocab_size + tok, minlength=E * L.vocab_size).reshape(E, -1)
        ident = np.broadcast_to(positions[..., None], experts.shape).reshape(-1)
        payload = _contexts(inputs, plan)
        rows = np.broadcast_to(np.arange(inputs.size).reshape(inputs.shape)[..., None], experts.shape).reshape(-1)
        take = lambda idx: payload[rows[idx]]  # noqa: E731
        self.tops[p + "top_contexts"] = self.tops[p + "top_contexts"].offer(flat_e, weights.reshape(-1), ident, take)
        keys = uniform_hash(plan.seed, ident * max(1, E * (max(L.moe_layers) + 1)) + i * E + flat_e)
        self.tops[p + "reservoir"] = self.tops[p + "reservoir"].offer(flat_e, keys, ident, take)
        sizes = np.asarray(L.layer_sizes)
        for b in range(experts.shape[0]):
            trace = experts[b].reshape(-1)  # token-major, rank order within a token
            for policy in POLICIES:
                d = stack_distances(trace, policy)
                s[p + f"cache_{policy}"] += hits_by_size(d, E)[sizes]
                if policy == "lru":  # reuse distance = LRU stack distance; bin 0: first use
                    s[p + "reuse_hist"] += np.bincount(trace * (E + 2) + (d + 1), minlength=E * (E + 2)).reshape(E, -1)
            s[p + "accesses"] += trace.size

    def _add_model_cache(self, experts: np.ndarray) -> None:
        """Hits of one cache shared by every MoE layer (keys layer x expert, token-major order) per sequence."""
        L, s = self.layout, self.sums
        n_keys = L.num_experts * len(L.moe_layers)
        sizes = np.asarray(L.model_sizes)
        for b in range(experts.shape[1]):
            trace = access_trace(experts[:, b], L.num_experts)
            for policy in POLICIES:
                s[f"cache.model_{policy}"] += hits_by_size(stack_distances(trace, policy), n_keys)[sizes]
            s["cache.model_accesses"] += trace.size


def _contexts(inputs: np.ndarray, plan: SurveyPlan) -> np.ndarray:
    """Context window of every token of a batch: [B * T, before + 1 + after] token ids, EMPTY_ID outside its
    sequence; the token itself is column ``before``."""
    B, T = inputs.shape
    offsets = np.arange(-plan.context_before, plan.context_after + 1)
    where = np.arange(T)[:, None] + offsets[None, :]  # [T, W]
    inside = (where >= 0) & (where < T)
    window = np.where(inside[None], inputs[:, np.clip(where, 0, T - 1)], EMPTY_ID)
    return window.reshape(B * T, -1)


def state_size_bytes(state: SurveyState) -> int:
    return sum(a.nbytes for a in state.sums.values()) + sum(
        t.score.nbytes + t.id.nbytes + t.payload.nbytes for t in state.tops.values()
    )
