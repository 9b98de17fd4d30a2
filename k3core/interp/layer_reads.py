"""How the recorder reads each kind of layer: the read hooks of KDA (gates, beta, the chunk-end state norms and
ranks, a recorded prefix ending inside a chunk stepped on with ``kda_recurrent``), MLA (attention statistics from q
and k in query blocks, the query window's map), MoE (routing, load, latent) and AttnRes (depth weights, pseudo-query
norms, scale/bias parameters).

One reader per kind (``KDAReads``, ``MLAReads``, ``MoEReads``, ``ResidualReads``), each built on the recorder
(``k3core.interp.recorder.Recorder.read_hooks``) and using only its small public interface, ``RecordingTarget``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ..modeling.hooks import AttnResSite
from ..ops.kda import kda_recurrent
from ..ops.kda.implicit_attention import kda_attention_window
from .attention_stats import blocked_attention_stats, position_bins
from .catalogue import point_name, source_label
from .kda_attention_stats import KDA_STATS, kda_attention_stats
from .trace import Trace, TraceNames


class RecordingTarget(Protocol):
    """What a reader may use of the recorder (``k3core.interp.recorder.Recorder``): the options, the trace being
    written and the ways to write into it, and ``held``, values kept between hook points of one forward."""

    what: frozenset[str]
    max_batch: int
    max_tokens: int | None
    attn_window: tuple[int, int]
    attn_block: int
    trace: Trace
    model: Any
    held: dict[str, Any]

    def limit(self, T: int) -> int: ...
    def clip_window(self, x: torch.Tensor, token_dim: int = 1) -> torch.Tensor: ...
    def put(self, name: str, value: Any, axes: Iterable[str]) -> None: ...
    def put_tokens(self, name: str, value: torch.Tensor, axes: Iterable[str]) -> None: ...
    def put_binned_mean(self, name: str, value: torch.Tensor, axes: Iterable[str]) -> None: ...


class _Reader:
    """A reader of one kind of layer, writing through ``rec``."""

    def __init__(self, rec: RecordingTarget):
        self.rec = rec

    def _hold(self, key: str) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> None:
            self.rec.held[key] = value

        return hook


class KDAReads(_Reader):
    """KDA: gates, beta, output gate, chunk-end state norms and ranks (a prefix ending inside a chunk stepped on with
    ``kda_recurrent``), the implicit attention's statistics and window map."""

    def hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        if "kda_attn" in self.rec.what or "attn_probs" in self.rec.what:
            self._attention_hooks(table, i, config)
        if "kda" not in self.rec.what:
            return
        # A recorded prefix ending inside a chunk: that chunk's first recorded tokens, to step the state
        # from the chunk start to the prefix end (fewer than a chunk of tokens, only then).
        hold = {p: self._hold_partial_chunk(i, p, config.kda_chunk_size) for p in ("q", "k", "v", "g", "beta")}
        for p in ("q", "k", "v"):
            _add(table, point_name(f"kda.{p}", i), hold[p])

        def decay(value, name, info):
            self.rec.put(N.kda_g(i), self.rec.clip_window(value), ("batch", "token", "head", "channel"))
            self.rec.put_binned_mean(N.kda_g_bins(i), value, ("batch", "bin", "head", "channel"))

        _add(table, point_name("kda.g", i), decay, hold["g"])
        _add(
            table,
            point_name("kda.beta", i),
            lambda v, n, info: self.rec.put_tokens(N.kda_beta(i), v, ("batch", "token", "head")),
            hold["beta"],
        )
        table[point_name("kda.gate", i)] = lambda v, n, info: self.rec.put_tokens(
            N.kda_gate(i), v.float().mean(-1), ("batch", "token", "head")
        )
        table[point_name("kda.chunk_state", i)] = lambda v, n, info: self._chunk_state(i, v, info)
        table[point_name("kda.state", i)] = lambda v, n, info: self._state(i, v, info)

    def _attention_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        """KDA's implicit attention from the forward's own q, k, g, beta (held until the core output, then dropped):
        the per-position statistics with "kda_attn", the query window's map and its mass before with "attn_probs"."""
        N, parts = TraceNames, ("q", "k", "g", "beta")
        for p in parts:
            _add(table, point_name(f"kda.{p}", i), self._hold(f"{i}.kda_attn.{p}"))

        def statistics(value, name, info):
            held = [self.rec.held.pop(f"{i}.kda_attn.{p}", None) for p in parts]
            if any(x is None for x in held):
                return
            n = self.rec.limit(held[0].shape[1])
            q, k, g, beta = (x[: self.rec.max_batch, :n] for x in held)
            C = config.kda_chunk_size
            if "kda_attn" in self.rec.what:
                stats = kda_attention_stats(q, k, g, beta, position_bins(n), chunk_size=C)
                for kind in KDA_STATS:
                    self.rec.put(N.kda_attn_stat(i, kind), stats[kind], ("batch", "head", "token"))
                self.rec.put(N.kda_attn_stat(i, "distance"), stats["distance"], ("batch", "head", "bin", "distance"))
                self.rec.put(N.kda_attn_stat(i, "distance_edges"), stats["distance_edges"], ("edge",))
            if "attn_probs" in self.rec.what and self.rec.attn_window[0] < n:
                window = (self.rec.attn_window[0], min(n, self.rec.attn_window[1]))
                self.rec.trace.meta["attn_window"] = list(window)
                attn, before = kda_attention_window(q, k, g, beta, window, chunk_size=C)
                self.rec.put(N.kda_attn(i), attn, ("batch", "head", "query", "key"))
                self.rec.put(N.kda_attn_stat(i, "before"), before, ("batch", "head", "query"))

        _add(table, point_name("kda.o", i), statistics)

    def _partial_chunk(self, T: int, chunk_size: int) -> tuple[int, int] | None:
        """[chunk start, prefix end) when the recorded prefix of T tokens ends inside a chunk, else None."""
        end = self.rec.limit(T)
        start = end - end % chunk_size
        return (start, end) if end < T and start < end else None

    def _hold_partial_chunk(self, i: int, part: str, chunk_size: int) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> None:
            span = self._partial_chunk(value.shape[1], chunk_size)
            if span is not None:
                self.rec.held[f"{i}.{part}"] = value[: self.rec.max_batch, span[0] : span[1]]

        return hook

    @torch.no_grad()
    def _chunk_state(self, i: int, state: torch.Tensor, info: dict) -> None:
        """The norm and effective rank of S at a chunk end inside the recorded prefix (the forward's own
        state loop); only the last state is held, so memory does not grow with the number of chunks."""
        token = info["token"]
        if self.rec.max_tokens is None or token <= self.rec.max_tokens:
            norm, rank = state_norm_and_rank(state[: self.rec.max_batch])
            self.rec.held.setdefault(f"{i}.norms", []).append(norm)
            self.rec.held.setdefault(f"{i}.ranks", []).append(rank)
            self.rec.held.setdefault(f"{i}.steps", []).append(token)
            self.rec.held[f"{i}.last"] = state[: self.rec.max_batch]

    @torch.no_grad()
    def _state(self, i: int, final_state: torch.Tensor, info: dict) -> None:
        N = TraceNames
        self.rec.put(N.kda_final_state(i), final_state[: self.rec.max_batch], ("batch", "head", "key", "value"))
        norms, steps = self.rec.held.pop(f"{i}.norms", []), self.rec.held.pop(f"{i}.steps", [])
        ranks = self.rec.held.pop(f"{i}.ranks", [])
        last = self.rec.held.pop(f"{i}.last", None)
        partial = [self.rec.held.pop(f"{i}.{p}", None) for p in ("q", "k", "v", "g", "beta")]
        if partial[0] is not None:  # the prefix ends inside a chunk: step on from the last chunk end
            q, k, v, g, beta = partial
            start = last if steps else info.get("initial")
            start = None if start is None else start[: self.rec.max_batch]
            _, state = kda_recurrent(q, k, v, g, beta, initial_state=start, output_final_state=True)
            norm, rank = state_norm_and_rank(state)
            norms.append(norm)
            ranks.append(rank)
            steps.append(steps[-1] + q.shape[1] if steps else q.shape[1])
        if steps:
            self.rec.put(N.kda_state_norm(i), torch.stack(norms, 1), ("batch", "step", "head"))
            self.rec.put(N.kda_state_rank(i), torch.stack(ranks, 1), ("batch", "step", "head"))
            self.rec.put(N.kda_state_steps(i), torch.tensor(steps), ("step",))


class MLAReads(_Reader):
    """MLA: output gate, attention statistics from q and k in query blocks, the query window's map."""

    def hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        if "mla" in self.rec.what and config.mla_output_gate:
            table[point_name("mla.gate", i)] = lambda v, n, info: self.rec.put_tokens(
                N.mla_gate(i), v.float().mean(-1), ("batch", "token", "head")
            )
        if "mla" not in self.rec.what and "attn_probs" not in self.rec.what:
            return
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        table[point_name("mla.q", i)] = self._hold(f"{i}.mla.q")
        table[point_name("mla.k", i)] = self._hold(f"{i}.mla.k")
        # A key mask is a hook point only when an edit writes it (one query block at a time); the statistics follow it.
        table[point_name("mla.key_mask", i)] = lambda v, n, info: self.rec.held.setdefault(
            f"{i}.mla.key_mask", []
        ).append((info["start"], v))

        def statistics(value, name, info):  # the attention output: q, k (and a mask) are complete; drop them after
            q = self.rec.held.pop(f"{i}.mla.q", None)
            k = self.rec.held.pop(f"{i}.mla.k", None)
            mask = self.rec.held.pop(f"{i}.mla.key_mask", None)
            if q is None or k is None or q.shape[2] != k.shape[2]:  # decoding with a cache: not recorded
                return
            n = self.rec.limit(q.shape[2])
            q, k = q[: self.rec.max_batch, :, :n], k[: self.rec.max_batch, :, :n]
            mask = None if mask is None else _rows_of(mask, n)
            window = None
            if "attn_probs" in self.rec.what and self.rec.attn_window[0] < n:
                window = (self.rec.attn_window[0], min(n, self.rec.attn_window[1]))
                self.rec.trace.meta["attn_window"] = list(window)
            stats = blocked_attention_stats(q, k, scale, visible=mask, block=self.rec.attn_block, window=window)
            if "mla" in self.rec.what:
                for kind in ("entropy", "sink", "received"):
                    self.rec.put(N.mla_stat(i, kind), stats[kind], ("batch", "head", "token"))
            if window is not None:
                self.rec.put(N.mla_attn(i), stats["map"], ("batch", "head", "query", "key"))

        table[point_name("mla.o", i)] = statistics


class MoEReads(_Reader):
    """MoE: router scores, selection bias, chosen experts and their load, routing weights, latent."""

    def hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        E = config.num_experts
        table[point_name("moe.scores", i)] = lambda v, n, info: self.rec.put_tokens(
            N.moe_scores(i), v, ("batch", "token", "expert")
        )
        table[point_name("moe.selection_bias", i)] = lambda v, n, info: self.rec.put(N.moe_bias(i), v, ("expert",))

        def experts(value, name, info):
            self.rec.put_tokens(N.moe_experts(i), value, ("batch", "token", "rank"))
            self.rec.put(N.moe_load(i), torch.bincount(value.reshape(-1), minlength=E), ("expert",))

        table[point_name("moe.experts", i)] = experts
        table[point_name("moe.weights", i)] = lambda v, n, info: self.rec.put_tokens(
            N.moe_weights(i), v, ("batch", "token", "rank")
        )
        if "latent" in self.rec.what:
            table[point_name("moe.latent", i)] = lambda v, n, info: self.rec.put(
                N.moe_latent(i), self.rec.clip_window(v), ("batch", "token", "latent")
            )


class ResidualReads(_Reader):
    """The residual stream: AttnRes depth weights and pseudo-query norms, scale/bias parameters."""

    def attnres_weights(self, value: torch.Tensor, name: str, info: dict) -> None:
        site = info["site"]
        self.rec.put_tokens(TraceNames.attnres(site), value, ("batch", "token", "source"))
        self.rec.trace.meta.setdefault(TraceNames.ATTNRES_SOURCES_META, {})[site] = [
            source_label(s) for s in info["sources"]
        ]
        if self.rec.model is not None:
            inner = self.rec.model.model
            where = AttnResSite.parse(site)
            owner = inner if where.is_output else inner.layers[where.layer]
            proj = owner.output_attn_res_proj if where.is_output else (
                owner.self_attention_res_proj if where.sublayer == "attn" else owner.mlp_res_proj
            )  # fmt: skip
            self.rec.put(TraceNames.attnres_query_norm(site), proj.weight.detach().float().norm().reshape(()), ())

    def residual_parameters(self) -> None:
        """Scale/bias residual parameters of every layer (read from the model, not the forward)."""
        if self.rec.model.config.residual != "scale_bias":
            return
        for i, layer in enumerate(self.rec.model.model.layers):
            for side, module_side in (("attn", "self_attention_res"), ("mlp", "mlp_res")):
                for kind in ("scale", "bias"):
                    value = getattr(layer, f"{module_side}_{kind}")
                    if value.is_meta:  # a layer another pipeline rank holds (k3core.distributed.pipeline)
                        continue
                    self.rec.put(TraceNames.residual(i, side, kind), value, ("hidden",))


def _add(table: dict[str, Any], name: str, *hooks: Any) -> None:
    """Add read hooks to a point's entry of a hook table (a point may have several readers)."""
    have = table.get(name, [])
    table[name] = [*(have if isinstance(have, list) else [have]), *hooks]


def _rows_of(blocks: list[tuple[int, torch.Tensor]], n: int):
    """``visible(start, stop)``: the rows of queries [start, stop) of a key mask held as query blocks (first query,
    rows [..., block, S]), on the first ``n`` keys, never stacked into the whole [T, S] mask."""

    def visible(start: int, stop: int) -> torch.Tensor:
        parts = [r[..., max(start - s, 0) : stop - s, :n] for s, r in blocks if s < stop and s + r.shape[-2] > start]
        lead = torch.broadcast_shapes(*(p.shape[:-2] for p in parts))
        return torch.cat([p.expand(*lead, *p.shape[-2:]) for p in parts], -2)

    return visible


def state_norm_and_rank(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Frobenius norm ``||S||_F`` and effective rank ``exp(H(p))``, ``p = sigma / sum sigma`` (uncentred; the
    formula of ``analysis.metrics.hidden_states.effective_rank``, tested equal) of states [..., key, value]; [...] each.
    A zero state has rank 0."""
    s = state.float()
    sigma = torch.linalg.svdvals(s)
    total = sigma.sum(-1, keepdim=True)
    p = sigma / total.clamp_min(1e-30)
    ent = -(torch.where(p > 0, p * p.clamp_min(1e-30).log(), 0.0)).sum(-1)
    rank = torch.where(total.squeeze(-1) > 0, ent.exp(), 0.0)
    return s.flatten(-2).norm(dim=-1), rank
