"""How the recorder reads each kind of layer: the read hooks of KDA (gates, beta, the chunk-end state norms and
ranks, a recorded prefix ending inside a chunk stepped on with ``kda_recurrent``), MLA (attention statistics from q
and k in query blocks, the query window's map), MoE (routing, load, latent) and AttnRes (depth weights, pseudo-query
norms, scale/bias parameters).

``LayerReads`` is mixed into ``k3core.interp.recorder.Recorder``, which dispatches to it from ``read_hooks``; its
methods use the recorder's own state (``put``, ``put_tokens``, ``put_binned_mean``, ``clip_window``, ``_limit``,
``_held``, ``max_batch``, ``max_tokens``, ``what``, ``attn_window``, ``attn_block``, ``trace``, ``model``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..modeling.hooks import AttnResSite
from ..ops.kda import kda_recurrent
from ..ops.kda.implicit_attention import kda_attention_window
from .attention_stats import blocked_attention_stats, position_bins
from .catalogue import point_name, source_label
from .kda_attention_stats import KDA_STATS, kda_attention_stats
from .trace import TraceNames


class LayerReads:
    """The per-layer read hooks of the recorder (a mixin of ``Recorder``; see the module docstring)."""

    def _hold(self, key: str) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> None:
            self._held[key] = value

        return hook

    def _kda_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        if "kda_attn" in self.what or "attn_probs" in self.what:
            self._kda_attention_hooks(table, i, config)
        if "kda" not in self.what:
            return
        # A recorded prefix ending inside a chunk: that chunk's first recorded tokens, to step the state
        # from the chunk start to the prefix end (fewer than a chunk of tokens, only then).
        hold = {p: self._hold_partial_chunk(i, p, config.kda_chunk_size) for p in ("q", "k", "v", "g", "beta")}
        for p in ("q", "k", "v"):
            _add(table, point_name(f"kda.{p}", i), hold[p])

        def decay(value, name, info):
            self.put(N.kda_g(i), self.clip_window(value), ("batch", "token", "head", "channel"))
            self.put_binned_mean(N.kda_g_bins(i), value, ("batch", "bin", "head", "channel"))

        _add(table, point_name("kda.g", i), decay, hold["g"])
        _add(
            table,
            point_name("kda.beta", i),
            lambda v, n, info: self.put_tokens(N.kda_beta(i), v, ("batch", "token", "head")),
            hold["beta"],
        )
        table[point_name("kda.gate", i)] = lambda v, n, info: self.put_tokens(
            N.kda_gate(i), v.float().mean(-1), ("batch", "token", "head")
        )
        table[point_name("kda.chunk_state", i)] = lambda v, n, info: self._kda_chunk_state(i, v, info)
        table[point_name("kda.state", i)] = lambda v, n, info: self._kda_state(i, v, info)

    def _kda_attention_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        """KDA's implicit attention from the forward's own q, k, g, beta (held until the core output, then dropped):
        the per-position statistics with "kda_attn", the query window's map and its mass before with "attn_probs"."""
        N, parts = TraceNames, ("q", "k", "g", "beta")
        for p in parts:
            _add(table, point_name(f"kda.{p}", i), self._hold(f"{i}.kda_attn.{p}"))

        def statistics(value, name, info):
            held = [self._held.pop(f"{i}.kda_attn.{p}", None) for p in parts]
            if any(x is None for x in held):
                return
            n = self._limit(held[0].shape[1])
            q, k, g, beta = (x[: self.max_batch, :n] for x in held)
            C = config.kda_chunk_size
            if "kda_attn" in self.what:
                stats = kda_attention_stats(q, k, g, beta, position_bins(n), chunk_size=C)
                for kind in KDA_STATS:
                    self.put(N.kda_attn_stat(i, kind), stats[kind], ("batch", "head", "token"))
                self.put(N.kda_attn_stat(i, "distance"), stats["distance"], ("batch", "head", "bin", "distance"))
                self.put(N.kda_attn_stat(i, "distance_edges"), stats["distance_edges"], ("edge",))
            if "attn_probs" in self.what and self.attn_window[0] < n:
                window = (self.attn_window[0], min(n, self.attn_window[1]))
                self.trace.meta["attn_window"] = list(window)
                attn, before = kda_attention_window(q, k, g, beta, window, chunk_size=C)
                self.put(N.kda_attn(i), attn, ("batch", "head", "query", "key"))
                self.put(N.kda_attn_stat(i, "before"), before, ("batch", "head", "query"))

        _add(table, point_name("kda.o", i), statistics)

    def _partial_chunk(self, T: int, chunk_size: int) -> tuple[int, int] | None:
        """[chunk start, prefix end) when the recorded prefix of T tokens ends inside a chunk, else None."""
        end = self._limit(T)
        start = end - end % chunk_size
        return (start, end) if end < T and start < end else None

    def _hold_partial_chunk(self, i: int, part: str, chunk_size: int) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> None:
            span = self._partial_chunk(value.shape[1], chunk_size)
            if span is not None:
                self._held[f"{i}.{part}"] = value[: self.max_batch, span[0] : span[1]]

        return hook

    @torch.no_grad()
    def _kda_chunk_state(self, i: int, state: torch.Tensor, info: dict) -> None:
        """The norm and effective rank of S at a chunk end inside the recorded prefix (the forward's own
        state loop); only the last state is held, so memory does not grow with the number of chunks."""
        token = info["token"]
        if self.max_tokens is None or token <= self.max_tokens:
            norm, rank = state_norm_and_rank(state[: self.max_batch])
            self._held.setdefault(f"{i}.norms", []).append(norm)
            self._held.setdefault(f"{i}.ranks", []).append(rank)
            self._held.setdefault(f"{i}.steps", []).append(token)
            self._held[f"{i}.last"] = state[: self.max_batch]

    @torch.no_grad()
    def _kda_state(self, i: int, final_state: torch.Tensor, info: dict) -> None:
        N = TraceNames
        self.put(N.kda_final_state(i), final_state[: self.max_batch], ("batch", "head", "key", "value"))
        norms, steps = self._held.pop(f"{i}.norms", []), self._held.pop(f"{i}.steps", [])
        ranks = self._held.pop(f"{i}.ranks", [])
        last = self._held.pop(f"{i}.last", None)
        partial = [self._held.pop(f"{i}.{p}", None) for p in ("q", "k", "v", "g", "beta")]
        if partial[0] is not None:  # the prefix ends inside a chunk: step on from the last chunk end
            q, k, v, g, beta = partial
            start = last if steps else info.get("initial")
            start = None if start is None else start[: self.max_batch]
            _, state = kda_recurrent(q, k, v, g, beta, initial_state=start, output_final_state=True)
            norm, rank = state_norm_and_rank(state)
            norms.append(norm)
            ranks.append(rank)
            steps.append(steps[-1] + q.shape[1] if steps else q.shape[1])
        if steps:
            self.put(N.kda_state_norm(i), torch.stack(norms, 1), ("batch", "step", "head"))
            self.put(N.kda_state_rank(i), torch.stack(ranks, 1), ("batch", "step", "head"))
            self.put(N.kda_state_steps(i), torch.tensor(steps), ("step",))

    def _mla_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        if "mla" in self.what and config.mla_output_gate:
            table[point_name("mla.gate", i)] = lambda v, n, info: self.put_tokens(
                N.mla_gate(i), v.float().mean(-1), ("batch", "token", "head")
            )
        if "mla" not in self.what and "attn_probs" not in self.what:
            return
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        table[point_name("mla.q", i)] = self._hold(f"{i}.mla.q")
        table[point_name("mla.k", i)] = self._hold(f"{i}.mla.k")
        # A key mask is a hook point only when an edit writes it (one query block at a time); the statistics follow it.
        table[point_name("mla.key_mask", i)] = lambda v, n, info: self._held.setdefault(f"{i}.mla.key_mask", []).append(
            (info["start"], v)
        )

        def statistics(value, name, info):  # the attention output: q, k (and a mask) are complete; drop them after
            q = self._held.pop(f"{i}.mla.q", None)
            k = self._held.pop(f"{i}.mla.k", None)
            mask = self._held.pop(f"{i}.mla.key_mask", None)
            if q is None or k is None or q.shape[2] != k.shape[2]:  # decoding with a cache: not recorded
                return
            n = self._limit(q.shape[2])
            q, k = q[: self.max_batch, :, :n], k[: self.max_batch, :, :n]
            mask = None if mask is None else _rows_of(mask, n)
            window = None
            if "attn_probs" in self.what and self.attn_window[0] < n:
                window = (self.attn_window[0], min(n, self.attn_window[1]))
                self.trace.meta["attn_window"] = list(window)
            stats = blocked_attention_stats(q, k, scale, visible=mask, block=self.attn_block, window=window)
            if "mla" in self.what:
                for kind in ("entropy", "sink", "received"):
                    self.put(N.mla_stat(i, kind), stats[kind], ("batch", "head", "token"))
            if window is not None:
                self.put(N.mla_attn(i), stats["map"], ("batch", "head", "query", "key"))

        table[point_name("mla.o", i)] = statistics

    def _moe_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        E = config.num_experts
        table[point_name("moe.scores", i)] = lambda v, n, info: self.put_tokens(
            N.moe_scores(i), v, ("batch", "token", "expert")
        )
        table[point_name("moe.selection_bias", i)] = lambda v, n, info: self.put(N.moe_bias(i), v, ("expert",))

        def experts(value, name, info):
            self.put_tokens(N.moe_experts(i), value, ("batch", "token", "rank"))
            self.put(N.moe_load(i), torch.bincount(value.reshape(-1), minlength=E), ("expert",))

        table[point_name("moe.experts", i)] = experts
        table[point_name("moe.weights", i)] = lambda v, n, info: self.put_tokens(
            N.moe_weights(i), v, ("batch", "token", "rank")
        )
        if "latent" in self.what:
            table[point_name("moe.latent", i)] = lambda v, n, info: self.put(
                N.moe_latent(i), self.clip_window(v), ("batch", "token", "latent")
            )

    def _attnres_weights(self, value: torch.Tensor, name: str, info: dict) -> None:
        site = info["site"]
        self.put_tokens(TraceNames.attnres(site), value, ("batch", "token", "source"))
        self.trace.meta.setdefault(TraceNames.ATTNRES_SOURCES_META, {})[site] = [
            source_label(s) for s in info["sources"]
        ]
        if self.model is not None:
            inner = self.model.model
            where = AttnResSite.parse(site)
            owner = inner if where.is_output else inner.layers[where.layer]
            proj = owner.output_attn_res_proj if where.is_output else (
                owner.self_attention_res_proj if where.sublayer == "attn" else owner.mlp_res_proj
            )  # fmt: skip
            self.put(TraceNames.attnres_query_norm(site), proj.weight.detach().float().norm().reshape(()), ())

    def _residual_parameters(self) -> None:
        """Scale/bias residual parameters of every layer (read from the model, not the forward)."""
        if self.model.config.residual != "scale_bias":
            return
        for i, layer in enumerate(self.model.model.layers):
            for side, module_side in (("attn", "self_attention_res"), ("mlp", "mlp_res")):
                for kind in ("scale", "bias"):
                    value = getattr(layer, f"{module_side}_{kind}")
                    if value.is_meta:  # a layer another pipeline rank holds (k3core.distributed.pipeline)
                        continue
                    self.put(TraceNames.residual(i, side, kind), value, ("hidden",))


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
