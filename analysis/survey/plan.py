"""What a survey reads and keeps: the corpus and its batches, the plan (``SurveyPlan``), the layout of a run
(``Layout``: which layers, heads, experts and AttnRes sites; cache sizes; token classes) and ``SurveyError``.

    corpus token ids --sequences of seq_len (+1 for the targets)--> batches (fixed: batch b = sequences
        [b * batch_size, (b + 1) * batch_size))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from analysis.metrics.expert_cache import cache_sizes
from analysis.metrics.routing_stats import TOKEN_CLASSES, byte_classes, string_class
from k3core.interp.catalogue import attnres_has_attn_site
from k3core.modeling.hooks import HookNames, hooks

MAX_TOKEN_COUNTS = 4096  # per-expert token counts kept for vocabularies up to this size (byte models: 256)


class SurveyError(ValueError):
    """A survey folder that cannot be read or continued (the message says why)."""


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
    from k3core.loading.expert_store import EXPERT_NAME, WEIGHTS
    from k3core.loading.folder import CheckpointFiles

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
        run.model(torch.zeros(1, 2, dtype=torch.long, device=run_device(run)))
    return out


def _recorder(out: dict, site: str) -> Callable:
    def read(value: torch.Tensor, name: str, info: dict) -> None:
        out[site] = int(value.shape[-1])

    return read


def run_device(run: Any) -> torch.device:
    """The device of the run's parameters (where a survey's forward inputs go)."""
    return next(run.model.parameters()).device
