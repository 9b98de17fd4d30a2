"""Corpus surveys: statistics of a run over every token of a corpus, kept as bounded aggregates (DIAGNOSTICS.md).

    corpus token ids --sequences of seq_len (+1 for the targets)--> batches (fixed: batch b = sequences
        [b * batch_size, (b + 1) * batch_size)) --forward with read hooks (k3core.interp.hooks)--> per-batch numpy
        --SurveyState.add_batch--> counts, sums, fixed-bin histograms, top-k tables (analysis.survey.aggregates)
        --save_survey--> DIR/survey.json (the plan, progress, layer tables, bins) + DIR/state.npz (arrays)

A survey folder opens without the weights (``read_survey``: bounded reads through ``k3core.utils.files``, JSON and an
npz read with ``allow_pickle=False``, every array's name, dtype and shape checked against the card). It is
written after every ``save_every`` batches, atomically, so an interrupted survey continues at the first batch not
yet in the state (``run_survey`` on the same DIR and plan) and ends with the same state as an uninterrupted one.
Under torchrun each rank surveys batches ``rank, rank + world, ...`` and rank 0 merges the states: batches are
the same whatever the number of processes, so counts, histograms and top-k tables equal one process's exactly and
float sums up to the order of summation.

Per MoE layer, over every token: load in tokens and gate mass, co-activation, the selection margin, the quantile
cut-off gaps, chosen and unchosen score histograms, REAP saliency sums, token-class (and, for vocabularies up to
MAX_TOKEN_COUNTS, token) counts per expert, the top contexts by routing weight and a uniform reservoir of contexts,
reuse distances per expert and cache hits per policy and size (the cache starts empty at each sequence, so hits
add up over sequences). Model-wide: the shared expert cache's hits. KDA: decay (log alpha) and beta histograms
per head. MLA: normalised entropy and first-key (sink) mass per head, as histograms and by query position, from
q and k in query blocks (``mla_block_stats``). AttnRes: depth-weight sums and squares per site. Loss by position.
"""

from __future__ import annotations

import io
import json
import math
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from analysis.metrics.attention import causal_normalised_entropy
from analysis.metrics.expert_cache import (
    POLICIES,
    OnlineLRU,
    access_trace,
    cache_sizes,
    forward_access_trace,
    hits_by_size,
    stack_distances,
)
from analysis.metrics.moe import coactivation
from analysis.metrics.routing_stats import TOKEN_CLASSES, byte_classes, cutoff_gaps, selection_margin, string_class
from analysis.survey.aggregates import EMPTY_ID, TopK, grouped_histogram, uniform_hash
from k3core.interp.attention_stats import blocked_attention_stats
from k3core.interp.catalogue import POINTS, attnres_has_attn_site
from k3core.interp.hooks import HookNames, hooks
from k3core.utils.files import atomic_write_bytes, parse_json, read_bytes_limited

SURVEY_FORMAT = "k3lab-survey/1"
CARD_NAME = "survey.json"
STATE_NAME = "state.npz"
MAX_CARD_BYTES = 64 * 1024**2
MAX_STATE_BYTES = 2 * 1024**3
MAX_TOKEN_COUNTS = 4096  # per-expert token counts kept for vocabularies up to this size (byte models: 256)
MLA_QUERY_BLOCK = 128  # MLA statistics are computed [block, T] at a time, never T x T per head and batch at once

# fixed bin edges (analysis.survey.aggregates.bin_index: n edges -> n + 1 bins, under- and overflow at the ends)
EDGES = {
    "score": np.linspace(0.0, 1.0, 41),
    "margin": np.linspace(0.0, 0.5, 51),
    "gap": np.linspace(-1.0, 1.0, 81),
    "kda_g": np.linspace(-10.0, 0.0, 41),
    "beta": np.linspace(0.0, 1.0, 21),
    "entropy": np.linspace(0.0, 1.0, 21),
    "sink": np.linspace(0.0, 1.0, 21),
}


class SurveyError(ValueError):
    """A survey folder that cannot be read or continued (the message says why)."""


class SurveyStopped(RuntimeError):
    """The progress callback asked to stop; the state up to the last saved batch is on disk."""


@dataclass(frozen=True)
class SurveyPlan:
    """What a survey reads and keeps; a survey folder continues only under the same plan."""

    corpus: str  # description: files or sample name
    corpus_digest: str
    corpus_tokens: int
    seq_len: int
    batch_size: int
    sequences: int
    run_fingerprint: str
    top_contexts: int = 16
    reservoir: int = 16
    context_before: int = 24
    context_after: int = 8
    seed: int = 0

    @property
    def batches(self) -> int:
        return math.ceil(self.sequences / self.batch_size)

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len


# ------------------------------------------------------------------------------------------------ the corpus
SURVEY_SAMPLES = {
    "shakespeare": "the 38 Shakespeare plays (training plays, then the held-out ones)",
    "shakespeare-val": "the held-out Shakespeare plays (Julius Caesar, The Tempest, Twelfth Night)",
}


def sample_corpus_text(name: str) -> str:
    """The text of a built-in survey corpus (SURVEY_SAMPLES)."""
    from k3core.data import load_shakespeare

    if name not in SURVEY_SAMPLES:
        raise ValueError(f"unknown survey sample {name!r}; choose one of {tuple(SURVEY_SAMPLES)}")
    corpus = load_shakespeare()
    data = corpus.val if name == "shakespeare-val" else np.concatenate([corpus.train, corpus.val])
    return bytes(data).decode("utf-8", errors="replace")


def corpus_ids(text: str, tokenizer: Any, max_tokens: int | None = None) -> np.ndarray:
    """Token ids of a corpus text (int32), the first ``max_tokens`` + 1 kept (the + 1 is the last target)."""
    ids = tokenizer.encode(text if max_tokens is None else text[: 8 * (max_tokens + 1) + 64])
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    return np.asarray(ids, dtype=np.int32)


def make_plan(
    ids: np.ndarray,
    corpus: str,
    run_fingerprint: str,
    seq_len: int,
    batch_size: int = 8,
    **options: Any,
) -> SurveyPlan:
    """The plan for a corpus of ``ids``: sequences of ``seq_len`` inputs (and their next-token targets) at stride
    ``seq_len``, ``(len(ids) - 1) // seq_len`` of them (a shorter remainder is not surveyed)."""
    import hashlib

    if seq_len < 2:
        raise ValueError(f"the sequence length must be at least 2, got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"the batch size must be at least 1, got {batch_size}")
    sequences = (len(ids) - 1) // seq_len
    if sequences < 1:
        raise ValueError(f"the corpus has {len(ids):,} tokens, fewer than one sequence of {seq_len} (+1)")
    digest = hashlib.sha256(np.ascontiguousarray(ids[: sequences * seq_len + 1]).tobytes()).hexdigest()[:16]
    return SurveyPlan(
        corpus=corpus,
        corpus_digest=digest,
        corpus_tokens=int(len(ids)),
        seq_len=seq_len,
        batch_size=batch_size,
        sequences=sequences,
        run_fingerprint=run_fingerprint,
        **options,
    )


def batch_ids(ids: np.ndarray, plan: SurveyPlan, batch: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(inputs [B, T], targets [B, T], first sequence index) of batch ``batch``."""
    first = batch * plan.batch_size
    last = min(first + plan.batch_size, plan.sequences)
    T = plan.seq_len
    rows = np.stack([ids[s * T : s * T + T + 1] for s in range(first, last)]).astype(np.int64)
    return rows[:, :-1], rows[:, 1:], first


# ------------------------------------------------------------------------------------------------ layout
@dataclass
class Layout:
    """The layers a survey covers and the shapes of what it keeps (the card's ``layout``)."""

    moe_layers: list[int]
    num_experts: int
    top_k: int
    kda_layers: list[int]
    kda_heads: int
    mla_layers: list[int]
    mla_heads: int
    attnres_sites: dict[str, int]  # site -> number of depth sources
    vocab_size: int
    seq_len: int
    layer_sizes: list[int] = field(default_factory=list)  # per-layer cache sizes simulated
    model_sizes: list[int] = field(default_factory=list)  # shared-cache sizes simulated
    expert_bytes: list[int] = field(default_factory=list)  # stored bytes of one expert, per MoE layer
    token_classes: list[int] = field(default_factory=list)  # class of each token id (TOKEN_CLASSES)
    token_strings: list[str] | None = None  # readable token strings (vocab <= MAX_TOKEN_COUNTS)

    @property
    def count_tokens(self) -> bool:
        return self.vocab_size <= MAX_TOKEN_COUNTS


def attnres_sites(config: Any) -> dict[str, str]:
    """AttnRes site -> the hook point of its depth weights, in forward order (empty without AttnRes)."""
    if not config.uses_attnres:
        return {}
    out = {}
    for i in range(config.num_hidden_layers):
        for side in ("attn", "mlp"):
            if side == "attn" and not attnres_has_attn_site(config, i):
                continue
            site = HookNames.attnres_site(i, side)
            out[site] = HookNames.attnres_point(site, "weights")
    out["output"] = HookNames.attnres_point("output", "weights")
    return out


def expert_bytes_of(run: Any) -> list[int]:
    """Stored bytes of one routed expert (w1 + w2 + w3) per MoE layer, at the checkpoint's storage format (its
    headers); from the parameters when the run has no checkpoint files."""
    from k3core.bigmodel.expert_store import EXPERT_NAME, WEIGHTS
    from k3core.checkpoints.folder import CheckpointFiles

    layers = [i for i in range(run.config.num_hidden_layers) if run.config.is_moe_layer(i)]
    try:
        files = CheckpointFiles.open(run.path)
        return [sum(files.tensors[EXPERT_NAME.format(layer=i, expert=0, w=w)].nbytes for w in WEIGHTS) for i in layers]
    except Exception:  # noqa: BLE001 - no files (an in-memory run) or a layout without per-expert names
        moes = run.model.moe_layers()
        return [
            sum(getattr(m.experts, w)[0].numel() * getattr(m.experts, w).element_size() for w in WEIGHTS) for m in moes
        ]


def make_layout(run: Any, seq_len: int) -> Layout:
    """The layout of a run's survey (which layers, heads, experts, sites; cache sizes; token classes)."""
    config = run.config
    moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    mla = [i for i in range(config.num_hidden_layers) if config.is_mla_layer(i)]
    kda = [i for i in range(config.num_hidden_layers) if not config.is_mla_layer(i)]
    E = config.num_experts if moe else 0
    sites = {}
    if attnres_sites(config):
        sources = _attnres_source_counts(run)
        sites = {site: sources[site] for site in attnres_sites(config)}
    V = config.vocab_size
    strings = None
    if run.tokenizer is None and V == 256:
        classes = byte_classes()
        from k3core.tokenizer.readable import readable_bytes

        strings = [readable_bytes(bytes([b])) for b in range(256)]
    else:
        tok = run.tokenizer
        pieces = tok.token_strings(range(min(V, tok.vocab_size))) if tok is not None else []
        classes = np.array([string_class(p) for p in pieces] + [TOKEN_CLASSES.index("other")] * (V - len(pieces)))
        strings = list(pieces) + [f"<{i}>" for i in range(len(pieces), V)] if V <= MAX_TOKEN_COUNTS else None
    return Layout(
        moe_layers=moe,
        num_experts=E,
        top_k=config.num_experts_per_token if moe else 0,
        kda_layers=kda,
        kda_heads=config.kda_num_heads,
        mla_layers=mla,
        mla_heads=config.num_attention_heads,
        attnres_sites=sites,
        vocab_size=V,
        seq_len=seq_len,
        layer_sizes=cache_sizes(E).tolist() if moe else [],
        model_sizes=cache_sizes(E * len(moe)).tolist() if moe else [],
        expert_bytes=expert_bytes_of(run) if moe else [],
        token_classes=np.asarray(classes, dtype=np.int64).tolist(),
        token_strings=strings,
    )


def _attnres_source_counts(run: Any) -> dict[str, int]:
    """Depth sources of each AttnRes site, read from one 2-token forward."""
    out: dict[str, int] = {}
    table = {point: _recorder(out, site) for site, point in attnres_sites(run.config).items()}
    with torch.no_grad(), hooks(read=table):
        run.model(torch.zeros(1, 2, dtype=torch.long, device=_device(run)))
    return out


def _recorder(out: dict, site: str) -> Callable:
    def read(value: torch.Tensor, name: str, info: dict) -> None:
        out[site] = int(value.shape[-1])

    return read


def _device(run: Any) -> torch.device:
    return next(run.model.parameters()).device


# ------------------------------------------------------------------------------------------------ MLA in blocks
def mla_block_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, block: int = MLA_QUERY_BLOCK
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per query block of causal attention ``A = softmax(q k^T * scale)`` (q [B, H, T, d], k [B, H, T, d]): yields
    (first query index, normalised row entropy ``H_i / log(i + 1)`` [B, H, block] (NaN at i = 0), first-key mass
    ``A_i0`` [B, H, block]). The statistics are the recorder's own (``blocked_attention_stats``: [block, T] scores
    at a time), normalised by ``analysis.metrics.attention.causal_normalised_entropy``: one definition for traces and
    surveys."""
    stats = blocked_attention_stats(q, k, scale, block=block)
    norm = causal_normalised_entropy(stats["entropy"].double().numpy())
    sink = stats["sink"].double().numpy()
    T = q.shape[-2]
    for start in range(0, T, block):
        stop = min(start + block, T)
        yield start, norm[..., start:stop], sink[..., start:stop]


# ------------------------------------------------------------------------------------------------ the state
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


# ------------------------------------------------------------------------------------------------ the forward
def survey_batch(run: Any, inputs: np.ndarray, targets: np.ndarray, layout: Layout) -> dict[str, Any]:
    """One forward of a batch with read hooks; returns the numpy reads ``SurveyState.add_batch`` folds in.

    The MoE's per-expert output norms (REAP) are computed from the latent z and the stacked experts
    (``StackedExperts.expert``): one more pass of the routed experts."""
    model = run.model
    reads: dict[str, Any] = {}
    table: dict[str, Any] = {}

    def keep(key: str, sub: str | None = None, fn: Callable = lambda v: v.float().cpu().numpy()):
        def read(value, name, info):
            if sub is None:
                reads[key] = fn(value.detach())
            else:
                reads.setdefault(key, {})[sub] = fn(value.detach())

        return read

    table[POINTS["token_nll"].at()] = keep("token_nll")
    moes = {m.layer_idx: m for m in model.moe_layers()}
    for i in layout.moe_layers:
        for what in ("scores", "selection", "weights"):
            table[HookNames.block(i, f"moe.{what}")] = keep(f"moe.{i}", what)
        table[HookNames.block(i, "moe.experts")] = keep(f"moe.{i}", "experts", lambda v: v.cpu().numpy())
        table[HookNames.block(i, "moe.latent")] = _norm_reader(reads, i, moes[i])
    for i in layout.kda_layers:
        table[HookNames.block(i, "kda.g")] = keep(f"kda.{i}.g")
        table[HookNames.block(i, "kda.beta")] = keep(f"kda.{i}.beta")
    for i in layout.mla_layers:
        table[HookNames.block(i, "mla.q")] = keep(f"mla.{i}.q", fn=lambda v: v)
        table[HookNames.block(i, "mla.k")] = _mla_reader(reads, i, model.model.layers[i].self_attn.scale)
    for site, point in attnres_sites(run.config).items():
        table[point] = keep(f"attnres.{site}")
    device = _device(run)
    with torch.no_grad(), hooks(read=table):
        model(torch.as_tensor(inputs, device=device), targets=torch.as_tensor(targets, device=device))
    return reads


def _norm_reader(reads: dict, i: int, moe: Any) -> Callable:
    def read(z, name, info):
        r = reads[f"moe.{i}"]
        if moe.experts.weight_source is not None:  # a streamed run: another expert pass would disturb its cache
            r["out_norm"] = np.full(r["experts"].shape, np.nan)
            return
        experts = torch.as_tensor(r["experts"], device=z.device).reshape(-1, r["experts"].shape[-1])
        flat = z.reshape(-1, z.shape[-1])
        norms = torch.zeros(experts.shape, dtype=torch.float64)
        for e in torch.unique(experts).tolist():
            rows, ranks = (experts == e).nonzero(as_tuple=True)
            out = moe.experts.expert(e, flat[rows])
            norms[rows.cpu(), ranks.cpu()] = out.float().norm(dim=-1).double().cpu()
        r["out_norm"] = norms.reshape(r["experts"].shape).numpy()

    return read


def _mla_reader(reads: dict, i: int, scale: float) -> Callable:
    def read(k, name, info):
        q = reads.pop(f"mla.{i}.q")
        reads[f"mla.{i}"] = list(mla_block_stats(q, k.detach(), scale))

    return read


# ------------------------------------------------------------------------------------------------ the folder
def survey_card(state: SurveyState, run_info: dict[str, Any], complete: bool) -> dict[str, Any]:
    return {
        "format": SURVEY_FORMAT,
        "plan": asdict(state.plan),
        "layout": asdict(state.layout),
        "edges": {k: v.tolist() for k, v in EDGES.items()},
        "done_batches": sorted(state.done),
        "complete": complete,
        "run": run_info,
        "arrays": {
            **{name: [str(a.dtype), list(a.shape)] for name, a in state.sums.items()},
            **{
                f"{name}.{part}": [str(getattr(t, part).dtype), list(getattr(t, part).shape)]
                for name, t in state.tops.items()
                for part in ("score", "id", "payload")
            },
        },
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save_survey(out: str | Path, state: SurveyState, run_info: dict[str, Any], complete: bool = False) -> Path:
    """Write DIR/state.npz then DIR/survey.json, each atomically (the card names the batches in the state)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = dict(state.sums)
    for name, top in state.tops.items():
        arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"] = top.score, top.id, top.payload
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(out / STATE_NAME, buf.getvalue())
    card = survey_card(state, run_info, complete)
    atomic_write_bytes(out / CARD_NAME, json.dumps(card, indent=1).encode())
    return out


@dataclass
class Survey:
    """A survey folder read back: its card (plan, layout, bins, run) and state."""

    path: Path
    card: dict[str, Any]
    state: SurveyState

    @property
    def layout(self) -> Layout:
        return self.state.layout

    @property
    def plan(self) -> SurveyPlan:
        return self.state.plan

    @property
    def complete(self) -> bool:
        return bool(self.card.get("complete"))


def is_survey_dir(path: str | Path) -> bool:
    return (Path(path) / CARD_NAME).is_file()


def read_survey(path: str | Path) -> Survey:
    """A survey folder, read with bounded, checked reads; SurveyError naming what is wrong otherwise."""
    path = Path(path)
    try:
        card = parse_json(read_bytes_limited(path / CARD_NAME, MAX_CARD_BYTES), CARD_NAME, error=SurveyError)
    except OSError as exc:
        raise SurveyError(f"{path}: not a survey folder ({exc.strerror or exc})") from None
    if not isinstance(card, dict) or card.get("format") != SURVEY_FORMAT:
        raise SurveyError(f"{path}: {CARD_NAME} is not a k3lab survey card (format {SURVEY_FORMAT})")
    try:
        plan = SurveyPlan(**card["plan"])
        layout = Layout(**card["layout"])
        done = {int(b) for b in card["done_batches"]}
        declared = dict(card["arrays"])
        _check_layout(layout, plan)
    except (KeyError, TypeError, ValueError) as exc:
        raise SurveyError(f"{path}: corrupt survey card ({type(exc).__name__}: {exc})") from None
    state = SurveyState(layout, plan)
    expected = {name: (str(a.dtype), list(a.shape)) for name, a in state.sums.items()}
    for name, t in state.tops.items():
        for part in ("score", "id", "payload"):
            a = getattr(t, part)
            expected[f"{name}.{part}"] = (str(a.dtype), list(a.shape))
    if {k: tuple(v) for k, v in declared.items()} != expected:
        raise SurveyError(f"{path}: the card's arrays do not match its plan and layout")
    try:
        data = read_bytes_limited(path / STATE_NAME, MAX_STATE_BYTES)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if set(npz.files) != set(expected):
                raise SurveyError(f"{path}: {STATE_NAME} holds other arrays than its card names")
            arrays = {}
            for name, (dtype, shape) in expected.items():
                a = npz[name]
                if str(a.dtype) != dtype or list(a.shape) != shape:
                    raise SurveyError(f"{path}: {STATE_NAME}: {name} is {a.dtype} {list(a.shape)}, not {dtype} {shape}")
                arrays[name] = a
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, SurveyError):
            raise
        raise SurveyError(f"{path}: {STATE_NAME} is not readable ({type(exc).__name__}: {exc})") from None
    for name in state.sums:
        state.sums[name] = arrays[name]
    for name in state.tops:
        state.tops[name] = TopK(arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"])
    state.done = done
    return Survey(path=path, card=card, state=state)


MAX_LAYOUT = {"experts": 1 << 16, "layers": 4096, "heads": 4096, "vocab": 1 << 22, "seq_len": 1 << 22}


def _check_layout(layout: Layout, plan: SurveyPlan) -> None:
    """Refuse layouts whose arrays would be absurdly large (a hostile card) before anything is allocated."""
    if not 0 <= layout.num_experts <= MAX_LAYOUT["experts"] or len(layout.moe_layers) > MAX_LAYOUT["layers"]:
        raise ValueError("expert or layer count out of range")
    if max(layout.kda_heads, layout.mla_heads) > MAX_LAYOUT["heads"] or layout.vocab_size > MAX_LAYOUT["vocab"]:
        raise ValueError("head count or vocabulary out of range")
    if not 2 <= plan.seq_len <= MAX_LAYOUT["seq_len"] or max(plan.top_contexts, plan.reservoir) > 1024:
        raise ValueError("sequence length or kept contexts out of range")
    if plan.context_before + plan.context_after > 4096 or min(plan.context_before, plan.context_after) < 0:
        raise ValueError("context width out of range")
    if len(layout.token_classes) != layout.vocab_size:
        raise ValueError("token classes do not cover the vocabulary")
    if plan.batch_size < 1 or plan.sequences < 1:
        raise ValueError("batch size or sequence count out of range")
    if state_size_estimate(layout, plan) > MAX_STATE_BYTES:
        raise ValueError(f"its state would take {state_size_estimate(layout, plan):,} bytes, out of range")


def state_size_estimate(layout: Layout, plan: SurveyPlan) -> int:
    """An upper bound of the bytes a survey state of this layout and plan holds (checked before allocating)."""
    E, V = layout.num_experts, layout.vocab_size if layout.count_tokens else 0
    bins = sum(len(v) + 1 for v in EDGES.values())
    width = plan.context_before + 1 + plan.context_after
    per_moe = E * E + E * (bins + E + 2 + 3 * len(layout.layer_sizes) + 16) + E * V
    per_moe += E * (plan.top_contexts + plan.reservoir) * (width + 2)
    heads = max(layout.kda_heads, layout.mla_heads)
    per_mixer = heads * (bins + 2 * plan.seq_len)
    total = len(layout.moe_layers) * per_moe + (len(layout.kda_layers) + len(layout.mla_layers)) * per_mixer
    total += 3 * len(layout.model_sizes) + V + 4 * plan.seq_len + sum(layout.attnres_sites.values()) * 3
    return 8 * total


# ------------------------------------------------------------------------------------------------ the driver
ProgressFn = Callable[[int, int], bool | None]  # (batches done, batches in all) -> False to stop


def run_survey(
    run: Any,
    ids: np.ndarray,
    plan: SurveyPlan,
    out: str | Path,
    progress: ProgressFn | None = None,
    save_every: int = 16,
    rank: int = 0,
    world: int = 1,
) -> SurveyState:
    """Survey ``ids`` under ``plan`` into the folder ``out`` (created, or continued when it holds a survey of the
    same plan: the batches already in it are skipped). ``progress`` is called after each batch; when it returns
    False the state is saved and SurveyStopped raised. With ``world`` > 1 this process surveys batches ``rank,
    rank + world, ...`` and returns its own state without writing (``reduce_states`` and rank 0 write)."""
    layout = make_layout(run, plan.seq_len)
    out = Path(out)
    run_info = {
        "path": str(run.path),
        "label": run.label,
        "fingerprint": run.fingerprint,
        "config": run.config.to_dict(),
    }
    if world == 1 and is_survey_dir(out):
        previous = read_survey(out)
        if asdict(previous.plan) != asdict(plan):
            raise SurveyError(f"{out} holds a survey of another plan ({previous.plan.corpus}); choose a new --out")
        state = previous.state
    else:
        if world == 1 and out.exists() and any(out.iterdir()):
            raise SurveyError(f"{out}: exists and is not a survey folder; choose a new --out")
        state = SurveyState(layout, plan)
    mine = [b for b in range(plan.batches) if b % world == rank]
    todo = [b for b in mine if b not in state.done]
    streamed = StreamedCacheCheck.of(run, layout)
    since_save = 0
    for n, batch in enumerate(todo, 1):
        inputs, targets, _ = batch_ids(ids, plan, batch)
        before = streamed.observed() if streamed else 0
        reads = survey_batch(run, inputs, targets, layout)
        if streamed:
            streamed.add(reads, streamed.observed() - before)
            run_info["streamed"] = streamed.summary()
        state.add_batch(batch, inputs, reads)
        since_save += 1
        done = len(mine) - len(todo) + n
        stop = progress is not None and progress(done, len(mine)) is False
        if world == 1 and (since_save >= save_every or stop or n == len(todo)):
            save_survey(out, state, run_info, complete=len(state.done) == plan.batches)
            since_save = 0
        if stop:
            raise SurveyStopped(f"stopped after {len(state.done)} of {plan.batches} batches; run again to continue")
    if world == 1 and not todo:
        save_survey(out, state, run_info, complete=len(state.done) == plan.batches)
    return state


class StreamedCacheCheck:
    """A streamed run's expert cache (``k3core.bigmodel.expert_store``, LRU over stored bytes) beside its simulation:
    the LRU of the same capacity in experts fed the forward's expert reads (``forward_access_trace``). Counted over
    the batches run in this process (a continued survey counts from where it continued)."""

    def __init__(self, store: Any, capacity: int, layout: Layout) -> None:
        self.store, self.layout = store, layout
        # the store's keys are (decoder layer, expert); the simulation's, MoE-layer ordinal * E + expert
        warm = [layout.moe_layers.index(layer) * layout.num_experts + e for layer, e in store.cached_keys()]
        self.sim = OnlineLRU(capacity, warm=warm)
        self.observed_hits = 0

    @classmethod
    def of(cls, run: Any, layout: Layout) -> StreamedCacheCheck | None:
        session = getattr(run.model, "streaming", None)
        if session is None or not layout.moe_layers or len(set(layout.expert_bytes)) != 1:
            return None
        return cls(session.store, session.store.budget // layout.expert_bytes[0], layout)

    def observed(self) -> int:
        return int(self.store.stats.hits)

    def add(self, reads: dict[str, Any], observed_hits: int) -> None:
        experts = np.stack([reads[f"moe.{i}"]["experts"] for i in self.layout.moe_layers])
        for key in forward_access_trace(experts, self.layout.num_experts).tolist():
            self.sim.access(key)
        self.observed_hits += observed_hits

    def summary(self) -> dict[str, int]:
        return {"capacity_experts": self.sim.size, "observed_hits": self.observed_hits,
                "simulated_lru_hits": self.sim.hits, "accesses": self.sim.accesses}  # fmt: skip


def state_bytes(state: SurveyState) -> bytes:
    """A state as npz bytes (no pickles), for sending between ranks."""
    arrays = dict(state.sums)
    for name, top in state.tops.items():
        arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"] = top.score, top.id, top.payload
    arrays["__done__"] = np.array(sorted(state.done), dtype=np.int64)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def state_from_bytes(data: bytes, layout: Layout, plan: SurveyPlan) -> SurveyState:
    state = SurveyState(layout, plan)
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        for name in state.sums:
            state.sums[name] = npz[name]
        for name in state.tops:
            state.tops[name] = TopK(npz[f"{name}.score"], npz[f"{name}.id"], npz[f"{name}.payload"])
        state.done = set(npz["__done__"].tolist())
    return state


def run_survey_distributed(run: Any, ids: np.ndarray, plan: SurveyPlan, out: str | Path) -> SurveyState | None:
    """Under torchrun (torch.distributed initialised): each rank surveys its batches, rank 0 gathers and merges
    the states (npz bytes) and writes ``out``; returns the merged state on rank 0, None elsewhere."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    state = run_survey(run, ids, plan, out, rank=rank, world=world)
    gathered: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(state_bytes(state), gathered, dst=0)
    if rank != 0:
        return None
    merged = SurveyState(state.layout, plan)
    for data in gathered:
        merged.merge(state_from_bytes(data, state.layout, plan))
    run_info = {
        "path": str(run.path),
        "label": run.label,
        "fingerprint": run.fingerprint,
        "config": run.config.to_dict(),
        "world_size": world,
    }
    save_survey(out, merged, run_info, complete=len(merged.done) == plan.batches)
    return merged


def default_seq_len(run: Any) -> int:
    """The run's training sequence length (metrics.json), else 256."""
    metrics = run.metrics or {}
    seq = (metrics.get("train_config") or {}).get("seq_len")
    return int(seq) if isinstance(seq, int) and seq >= 2 else 256


def estimate_seconds(run: Any, ids: np.ndarray, plan: SurveyPlan) -> float:
    """Seconds the whole survey will take, from one timed batch (not kept) on this machine."""
    layout = make_layout(run, plan.seq_len)
    state = SurveyState(layout, plan)
    inputs, targets, _ = batch_ids(ids, plan, 0)
    start = time.perf_counter()
    state.add_batch(0, inputs, survey_batch(run, inputs, targets, layout))
    return (time.perf_counter() - start) * plan.batches * plan.batch_size / inputs.shape[0]


def state_size_bytes(state: SurveyState) -> int:
    return sum(a.nbytes for a in state.sums.values()) + sum(
        t.score.nbytes + t.id.nbytes + t.payload.nbytes for t in state.tops.values()
    )
