"""Corpus surveys: statistics of a run over every token of a corpus, kept as bounded aggregates (DIAGNOSTICS.md).
This module runs them: the forward of one batch with read hooks (``survey_batch``) and the driver (``run_survey``,
``run_survey_distributed``, ``estimate_seconds``).

    corpus token ids --sequences of seq_len (+1 for the targets)--> batches (fixed: batch b = sequences
        [b * batch_size, (b + 1) * batch_size); analysis.survey.plan) --forward with read hooks
        (k3core.modeling.hooks)--> per-batch numpy --SurveyState.add_batch (analysis.survey.state)--> counts, sums,
        fixed-bin histograms, top-k tables (analysis.survey.aggregates) --save_survey (analysis.survey.folder)-->
        DIR/survey.json (the plan, progress, layer tables, bins) + DIR/state.npz (arrays)

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
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from analysis.metrics.attention import causal_normalised_entropy
from analysis.metrics.expert_cache import OnlineLRU, forward_access_trace
from analysis.survey.aggregates import TopK
from analysis.survey.folder import (
    DONE_ARRAY,
    check_survey_folder,
    is_survey_dir,
    read_survey,
    save_survey,
    state_arrays,
    survey_lock,
)
from analysis.survey.plan import Layout, SurveyError, SurveyPlan, attnres_sites, batch_ids, make_layout, run_device
from analysis.survey.state import SurveyState
from k3core.interp.attention_stats import blocked_attention_stats
from k3core.interp.catalogue import POINTS
from k3core.modeling.hooks import HookNames, hooks

MLA_QUERY_BLOCK = 128  # MLA statistics are computed [block, T] at a time, never T x T per head and batch at once


class SurveyStopped(RuntimeError):
    """The progress callback asked to stop; the state up to the last saved batch is on disk."""


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
    device = run_device(run)
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
    out = check_survey_folder(out)
    run_info = {
        "path": str(run.path),
        "label": run.label,
        "fingerprint": run.fingerprint,
        "config": run.config.to_dict(),
    }
    with survey_lock(out) if world == 1 else nullcontext():  # one writer per folder; ranks > 0 never write
        state = SurveyState(layout, plan)
        if world == 1 and is_survey_dir(out):
            previous = read_survey(out, continuing=True)
            if asdict(previous.plan) != asdict(plan):
                raise SurveyError(f"{out} holds a survey of another plan ({previous.plan.corpus}); choose a new --out")
            state = previous.state
        return _survey_batches(run, ids, out, state, run_info, progress, save_every, rank, world)


def _survey_batches(
    run: Any,
    ids: np.ndarray,
    out: Path,
    state: SurveyState,
    run_info: dict[str, Any],
    progress: ProgressFn | None,
    save_every: int,
    rank: int,
    world: int,
) -> SurveyState:
    """The batches of ``run_survey`` this rank runs that are not yet in ``state`` (one process: saved every
    ``save_every`` batches and at the end)."""
    layout, plan = state.layout, state.plan
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
    """A streamed run's expert cache (``k3core.loading.expert_store``, LRU over stored bytes) beside its simulation:
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
        loading = getattr(run.model, "loading", None)  # run.model is None for a trace folder
        session = loading.streaming if loading is not None else None
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
    buf = io.BytesIO()
    np.savez(buf, **state_arrays(state))
    return buf.getvalue()


def state_from_bytes(data: bytes, layout: Layout, plan: SurveyPlan) -> SurveyState:
    state = SurveyState(layout, plan)
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        for name in state.sums:
            if name in npz.files or ".maxvio_" not in name:  # a survey from before the MaxVio scopes: from now on
                state.sums[name] = npz[name]
        for name in state.tops:
            state.tops[name] = TopK(npz[f"{name}.score"], npz[f"{name}.id"], npz[f"{name}.payload"])
        state.done = set(npz[DONE_ARRAY].tolist())
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
