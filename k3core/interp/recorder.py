"""Recording a forward pass into a plain, serialisable Trace.

    with record(model, what={"kda", "moe"}) as trace:
        model(input_ids)
    trace["blocks.0.kda.g"]          # numpy array
    trace.axes["blocks.0.kda.g"]     # ("batch", "token", "head", "channel")
    trace.save("run.trace.npz"); Trace.load("run.trace.npz")

The recorder is one consumer of the model's hook points (``k3core.interp.hooks``): ``record`` adds read hooks
for the items asked for and turns what they see into these arrays; with no hook context active the
forward runs at full speed. The hook context lives in a ``contextvars`` variable, so each thread (each
app session) records its own model without seeing another's. Recording inside ``intervene`` shows the
edited forward. What
is recorded covers every position of the first ``max_batch`` sequences (``max_tokens`` may cut a
contiguous prefix; None, the default, keeps the whole text). Items that are O(T) and small (a few
numbers per token: loss, beta, gates, routing, depth weights, RMS, MLA entropy / sink / received
attention) are kept whole; bulky per-token items (``hidden``, ``blocks.i.kda.g``, ``blocks.i.moe.latent``: a vector
per token) keep the first ``window`` positions and are summarised over every position by position bins
(``position_bins``: 0, 16, 32, 64, ... T; the ``*_bins`` arrays). MLA attention statistics are computed
here from the layer's q and k in query blocks (``k3core.interp.attention_stats``: a [block, T] slab per head,
never T x T; the model's attention path is the same with or without recording); the full attention map
(``blocks.i.mla.attn``, with "attn_probs") is kept only for a query window (``attn_window``, default the first
``max_attn_len`` positions). ``trace.meta["coverage"]`` says which positions [start, stop) each array
covers. Whole-batch aggregates (MoE load counts) use every token. KDA state norms and ranks are read from
the forward's own chunk-end states (hook point ``kda.chunk_state``, read only): on the torch path from its
state loop, on CUDA with fla's Triton kernel (which cannot hand its states out) from
``kda_chunk_end_states`` after it, so recording keeps the fast kernel.

This module is the recorder. The ``Trace`` data type, its file format and ``TraceNames`` live in
``k3core.interp.trace`` (``from k3core.interp.trace import Trace, TraceNames, names``).

Array names (``i`` is a 0-based layer index; every array carries its axis names in ``trace.axes``;
build names with ``TraceNames`` (alias ``names``) rather than by hand, e.g. ``names.kda_g(0)``). They are the
hook points' names (``k3core.interp.catalogue``): an array of a point's value is named after it, a quantity
derived from a point adds a suffix; traces of the older names (``kda.i.g``, ...) are renamed on load:

    tokens                   [batch, token]                     input ids
    token_nll                [batch, token]                     next-token loss (when labels are given)
    hidden                   [depth, batch, token, hidden]      state entering each layer, then the final one
    hidden_rms               [depth, batch, token]                  every position (hidden: the window)
    position_bins            [edge]                             edges of the position bins of the *_bins arrays
    hidden_bins.count        [bin]                              positions per bin
    hidden_bins.sum|unit_sum [depth, batch, bin, hidden]        sum of h, of h / ||h|| over each bin
    hidden_bins.gram         [depth, batch, bin, hidden, hidden2]   sum of h h^T over each bin
    hidden_bins.cross_gram   [layer, batch, bin, hidden, hidden2]   sum of h_l h_(l+1)^T (depth l to l + 1)
    hidden_bins.cos_sum      [layer, batch, bin]                sum of cos(h_l, h_(l+1)) over each bin
    blocks.i.kda.g           [batch, token, head, channel]      log decay (alpha = exp(g)); the window
    blocks.i.kda.g.bins      [batch, bin, head, channel]        mean log decay per position bin (every position)
    blocks.i.kda.beta        [batch, token, head]
    blocks.i.kda.gate.mean   [batch, token, head]               output-gate mean over channels
    blocks.i.kda.chunk_state.norm  [batch, step, head]          Frobenius norm of S at chunk ends (the forward's
                                                                own states: hook point kda.chunk_state)
    blocks.i.kda.chunk_state.rank  [batch, step, head]          effective rank exp(H(sigma / sum sigma)) of S there
    blocks.i.kda.chunk_state.token [step]                       token position of each step
    blocks.i.kda.state       [batch, head, key, value]          the final state
    blocks.i.mla.attn        [batch, head, query, key]          only with "attn_probs"; the query window
                                                                (meta["attn_window"]; keys: the same range)
    blocks.i.mla.attn.entropy|sink|received  [batch, head, token]  per query: entropy (nats), mass on token 0;
                                                                per key: attention received (sum over queries)
    blocks.i.mla.gate.mean   [batch, token, head]               output-gate mean (gated MLA)
    blocks.i.attn_res.weights  [batch, token, source]           depth weights; source names: meta["attnres_sources"]
    blocks.i.mlp_res.weights   [batch, token, source]
    output_res.weights         [batch, token, source]
    blocks.i.attn_res.query_norm  []                            pseudo-query norms (scalars)
    blocks.i.mlp_res.query_norm   []
    output_res.query_norm         []
    blocks.i.attn_res.scale|bias  [hidden]                      scale/bias residual mode
    blocks.i.mlp_res.scale|bias   [hidden]
    blocks.i.moe.scores      [batch, token, expert]             sigmoid router scores
    blocks.i.moe.experts     [batch, token, rank]               chosen experts (by weight rank)
    blocks.i.moe.weights     [batch, token, rank]               their routing weights
    blocks.i.moe.latent      [batch, token, latent]             z = W_down x (LatentMoE; x itself for plain MoE); window
    blocks.i.moe.experts.load  [expert]                         assignments over the whole batch
    blocks.i.moe.selection_bias  [expert]                       selection bias e_bias
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..ops.kda import kda_recurrent
from .attention_stats import DEFAULT_BLOCK, blocked_attention_stats, position_bins
from .catalogue import POINTS, source_label
from .hooks import active, hooks
from .trace import Trace, TraceNames

WHAT_ALL = ("hidden", "kda", "mla", "attn_probs", "attnres", "moe", "latent", "loss")
WHAT_DEFAULT = tuple(w for w in WHAT_ALL if w != "attn_probs")

_RECORDER = "recorder"  # the hook context's owner key of the active recorder


def _point(local: str, layer: int | None = None) -> str:
    """The full name of a declared hook point (KeyError for an undeclared one)."""
    return POINTS[local].at(layer)


def current() -> Recorder | None:
    """The recorder active in this thread/context, or None (the common, free case)."""
    ctx = active()
    return None if ctx is None else ctx.owners.get(_RECORDER)


class Recorder:
    """Turns what the model's hook points show into a Trace (read hooks only). Created by ``record``."""

    def __init__(
        self,
        what: Iterable[str],
        max_tokens: int | None,
        max_batch: int,
        max_attn_len: int,
        model: torch.nn.Module | None = None,
        window: int | None = None,
        attn_window: tuple[int, int] | None = None,
        attn_block: int = DEFAULT_BLOCK,
    ):
        self.what = frozenset(what)
        unknown = self.what - set(WHAT_ALL)
        if unknown:
            raise ValueError(f"unknown trace items {sorted(unknown)}; choose from {WHAT_ALL}")
        for label, n in (("max_tokens", max_tokens), ("window", window)):
            if n is not None and n < 1:
                raise ValueError(f"{label} must be a positive number of tokens or None, got {n}")
        if attn_window is not None and not 0 <= int(attn_window[0]) < int(attn_window[1]):
            raise ValueError(f"attn_window must be (start, stop) with 0 <= start < stop, got {attn_window}")
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_attn_len = max_attn_len
        self.window = window
        self.attn_window = (0, max_attn_len) if attn_window is None else (int(attn_window[0]), int(attn_window[1]))
        self.attn_block = attn_block
        self.model = model
        self.trace = Trace()
        self._hidden: list[torch.Tensor] = []
        self._held: dict[str, Any] = {}  # per layer q, k, ... until the point that needs them
        self._bins: list[int] = [0, 1]

    def wants(self, item: str) -> bool:
        return item in self.what

    def _limit(self, T: int) -> int:
        """How many positions of a T-token forward are recorded."""
        return T if self.max_tokens is None else min(T, self.max_tokens)

    def clip(self, x: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """First max_batch sequences, first max_tokens positions (all of them when max_tokens is None)."""
        x = x[: self.max_batch]
        return x.narrow(token_dim, 0, self._limit(x.shape[token_dim]))

    def clip_window(self, x: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """A bulky per-token item: the first ``window`` recorded positions."""
        x = self.clip(x, token_dim)
        n = x.shape[token_dim] if self.window is None else min(self.window, x.shape[token_dim])
        return x.narrow(token_dim, 0, n)

    def put(self, name: str, value: torch.Tensor | np.ndarray, axes: Iterable[str]) -> None:
        self.trace.add(name, value, axes)

    def put_tokens(self, name: str, value: torch.Tensor, axes: Iterable[str]) -> None:
        self.trace.add(name, self.clip(value), axes)

    def put_binned_mean(self, name: str, value: torch.Tensor, axes: Iterable[str]) -> None:
        """[batch, token, ...] -> its mean over each position bin, [batch, bin, ...] (every recorded position)."""
        x = self.clip(value).detach().double()
        means = [x[:, s:e].mean(1) for s, e in zip(self._bins[:-1], self._bins[1:])]
        self.trace.add(name, torch.stack(means, 1), axes)

    def start_forward(self, input_ids: torch.Tensor) -> None:
        """A new forward begins: earlier per-forward data is dropped (the last forward wins)."""
        self._hidden = []
        self._held = {}
        self.trace.arrays.clear()
        self.trace.axes.clear()
        self.trace.meta.pop(TraceNames.ATTNRES_SOURCES_META, None)
        self._bins = position_bins(self._limit(input_ids.shape[1]))
        self.put_tokens(TraceNames.TOKENS, input_ids, ("batch", "token"))
        self.put(TraceNames.POSITION_BINS, torch.tensor(self._bins), ("edge",))
        if "attnres" in self.what and self.model is not None:
            self._residual_parameters()

    @torch.no_grad()
    def hidden(self, h: torch.Tensor) -> None:
        if "hidden" not in self.what:
            return
        x = self.clip(h).detach()
        self._held.setdefault("hidden_rms", []).append(x.float().pow(2).mean(-1).sqrt().cpu())
        self._hidden.append(self.clip_window(x).float().cpu())
        self._hidden_moments(x.double().cpu())

    def _hidden_moments(self, x: torch.Tensor) -> None:
        """Per position bin: sum h, sum h h^T, sum h / ||h|| of this depth, and with the previous depth the
        cross sum h_l h_(l+1)^T and sum cos(h_l, h_(l+1)) (the moments analysis.metrics.hidden_states reads)."""
        unit = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        prev = self._held.get("hidden_prev")
        parts: dict[str, list[torch.Tensor]] = {"sum": [], "unit_sum": [], "gram": [], "cross_gram": [], "cos_sum": []}
        for s, e in zip(self._bins[:-1], self._bins[1:]):
            xb = x[:, s:e]
            parts["sum"].append(xb.sum(1))
            parts["unit_sum"].append(unit[:, s:e].sum(1))
            parts["gram"].append(xb.transpose(1, 2) @ xb)
            if prev is not None:
                parts["cross_gram"].append(prev[0][:, s:e].transpose(1, 2) @ xb)
                parts["cos_sum"].append((prev[1][:, s:e] * unit[:, s:e]).sum(-1).sum(1))
        moments = self._held.setdefault("hidden_moments", {})
        for kind, values in parts.items():
            if values:
                moments.setdefault(kind, []).append(torch.stack(values, 1))
        self._held["hidden_prev"] = (x, unit)

    def finish(self) -> None:
        N = TraceNames
        if self._hidden:
            self.trace.add(N.HIDDEN, torch.stack(self._hidden), ("depth", "batch", "token", "hidden"))
            self.trace.add(N.HIDDEN_RMS, torch.stack(self._held.pop("hidden_rms")), ("depth", "batch", "token"))
            self._hidden = []
            moments = self._held.pop("hidden_moments", {})
            edges = np.asarray(self._bins)
            self.put(N.hidden_bins("count"), np.diff(edges), ("bin",))
            axes = {
                "sum": ("depth", "batch", "bin", "hidden"),
                "unit_sum": ("depth", "batch", "bin", "hidden"),
                "gram": ("depth", "batch", "bin", "hidden", "hidden2"),
                "cross_gram": ("layer", "batch", "bin", "hidden", "hidden2"),
                "cos_sum": ("layer", "batch", "bin"),
            }
            for kind, values in moments.items():
                # float64 numpy, not the Trace's fp32: a Gram sum over 64K tokens needs the precision
                self.put(N.hidden_bins(kind), torch.stack(values).numpy(), axes[kind])
        self._held = {}
        self.trace.meta["coverage"] = self._coverage()

    def _coverage(self) -> dict[str, list[int]]:
        """{array name: [start, stop)} positions each positional array covers (whole-text summaries: [0, T))."""
        T = self._bins[-1]
        cover: dict[str, list[int]] = {}
        for name, axes in self.trace.axes.items():
            shape = self.trace.arrays[name].shape
            if "query" in axes:
                start = self.trace.meta.get("attn_window", [0, 0])[0]
                cover[name] = [int(start), int(start + shape[axes.index("query")])]
            elif "token" in axes:
                cover[name] = [0, int(shape[axes.index("token")])]
            elif "bin" in axes or "step" in axes:
                cover[name] = [0, int(T)]
        return cover

    # ------------------------------------------------------------------ hook consumers
    def read_hooks(self, config: Any) -> dict[str, Any]:
        """{hook point: read hook} for the items of ``self.what`` on a model of this config."""
        N = TraceNames
        table: dict[str, Any] = {_point("tokens"): lambda v, n, info: self.start_forward(v)}
        if "hidden" in self.what:
            for i in range(config.num_hidden_layers):
                table[_point("resid_in", i)] = lambda v, n, info: self.hidden(v)
            table[_point("final_resid")] = lambda v, n, info: self.hidden(v)
        if "loss" in self.what:
            table[_point("token_nll")] = lambda v, n, info: self.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
        for i in range(config.num_hidden_layers):
            if config.is_mla_layer(i):
                self._mla_hooks(table, i, config)
            elif "kda" in self.what:
                self._kda_hooks(table, i, config)
            if config.is_moe_layer(i) and "moe" in self.what:
                self._moe_hooks(table, i, config)
        if "attnres" in self.what and config.uses_attnres:
            sites = [N.attnres_site(i, side) for i in range(config.num_hidden_layers) for side in ("attn", "mlp")]
            for site in [*sites, N.OUTPUT_SITE]:
                table[N.attnres_point(site, "weights")] = self._attnres_weights
        return table

    def _hold(self, key: str) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> None:
            self._held[key] = value

        return hook

    def _kda_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        # A recorded prefix ending inside a chunk: that chunk's first recorded tokens, to step the state
        # from the chunk start to the prefix end (fewer than a chunk of tokens, only then).
        hold = {p: self._hold_partial_chunk(i, p, config.kda_chunk_size) for p in ("q", "k", "v", "g", "beta")}
        table.update({_point(f"kda.{p}", i): hold[p] for p in ("q", "k", "v")})

        def decay(value, name, info):
            self.put(N.kda_g(i), self.clip_window(value), ("batch", "token", "head", "channel"))
            self.put_binned_mean(N.kda_g_bins(i), value, ("batch", "bin", "head", "channel"))

        table[_point("kda.g", i)] = [decay, hold["g"]]
        table[_point("kda.beta", i)] = [
            lambda v, n, info: self.put_tokens(N.kda_beta(i), v, ("batch", "token", "head")),
            hold["beta"],
        ]
        table[_point("kda.gate", i)] = lambda v, n, info: self.put_tokens(
            N.kda_gate(i), v.float().mean(-1), ("batch", "token", "head")
        )
        table[_point("kda.chunk_state", i)] = lambda v, n, info: self._kda_chunk_state(i, v, info)
        table[_point("kda.state", i)] = lambda v, n, info: self._kda_state(i, v, info)

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
            table[_point("mla.gate", i)] = lambda v, n, info: self.put_tokens(
                N.mla_gate(i), v.float().mean(-1), ("batch", "token", "head")
            )
        if "mla" not in self.what and "attn_probs" not in self.what:
            return
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        table[_point("mla.q", i)] = self._hold(f"{i}.mla.q")
        table[_point("mla.k", i)] = self._hold(f"{i}.mla.k")
        # A key mask is a hook point only when an edit writes it (one query block at a time); the statistics follow it.
        table[_point("mla.key_mask", i)] = lambda v, n, info: self._held.setdefault(f"{i}.mla.key_mask", []).append(
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

        table[_point("mla.o", i)] = statistics

    def _moe_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        E = config.num_experts
        table[_point("moe.scores", i)] = lambda v, n, info: self.put_tokens(
            N.moe_scores(i), v, ("batch", "token", "expert")
        )
        table[_point("moe.selection_bias", i)] = lambda v, n, info: self.put(N.moe_bias(i), v, ("expert",))

        def experts(value, name, info):
            self.put_tokens(N.moe_experts(i), value, ("batch", "token", "rank"))
            self.put(N.moe_load(i), torch.bincount(value.reshape(-1), minlength=E), ("expert",))

        table[_point("moe.experts", i)] = experts
        table[_point("moe.weights", i)] = lambda v, n, info: self.put_tokens(
            N.moe_weights(i), v, ("batch", "token", "rank")
        )
        if "latent" in self.what:
            table[_point("moe.latent", i)] = lambda v, n, info: self.put(
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
            owner = inner if site == TraceNames.OUTPUT_SITE else inner.layers[int(site.split(".")[0])]
            proj = owner.output_attn_res_proj if site == TraceNames.OUTPUT_SITE else (
                owner.self_attention_res_proj if site.endswith(".attn") else owner.mlp_res_proj
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


def _rows_of(blocks: list[tuple[int, torch.Tensor]], n: int):
    """``visible(start, stop)``: the rows of queries [start, stop) of a key mask held as query blocks (first query,
    rows [..., block, S]), on the first ``n`` keys, never stacked into the whole [T, S] mask."""

    def visible(start: int, stop: int) -> torch.Tensor:
        parts = [r[..., max(start - s, 0) : stop - s, :n] for s, r in blocks if s < stop and s + r.shape[-2] > start]
        lead = torch.broadcast_shapes(*(p.shape[:-2] for p in parts))
        return torch.cat([p.expand(*lead, *p.shape[-2:]) for p in parts], -2)

    return visible


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) over the visible keys, in fp32: q [..., T, d], k [..., S, d], visible [T, S]
    (True = seen). A query that sees no key gets all zeros."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs.nan_to_num(0.0)


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


@contextlib.contextmanager
def record(
    model: torch.nn.Module | None = None,
    what: Iterable[str] | str | None = None,
    max_tokens: int | None = None,
    max_batch: int = 1,
    max_attn_len: int = 1024,
    window: int | None = 1024,
    attn_window: tuple[int, int] | None = None,
    attn_block: int = DEFAULT_BLOCK,
) -> Iterator[Trace]:
    """Record the internals of every forward run inside the block into one Trace.

    ``what`` picks items from WHAT_ALL ("all" for everything, default: everything but the MLA
    attention matrices, which are quadratic in length). If several forwards run inside the block,
    the last one wins. The recorder is bound to the calling thread/context only: forwards run by
    other threads meanwhile are not recorded, and they may record their own models concurrently.
    ``model`` gives the hook points to read (its config) and the parameters some arrays copy; without
    it only the tokens and the loss are recorded.

    Positions: ``max_tokens`` (None: all) cuts every array to a prefix; ``window`` (None: all) bounds the bulky
    per-token arrays (hidden, blocks.i.kda.g, blocks.i.moe.latent), which are summarised over every position by bins;
    ``attn_window`` (default ``(0, max_attn_len)``) is the query range of the attention maps; ``attn_block``
    queries at a time go into the blocked attention statistics.
    """
    if current() is not None:
        raise RuntimeError("record() blocks cannot be nested")
    if what is None:
        what = WHAT_DEFAULT
    elif what == "all":
        what = WHAT_ALL
    elif isinstance(what, str):
        what = (what,)
    config = getattr(model, "config", None)
    rec = Recorder(
        what, max_tokens=max_tokens, max_batch=max_batch, max_attn_len=max_attn_len,
        model=model if config is not None else None, window=window, attn_window=attn_window, attn_block=attn_block,
    )  # fmt: skip
    if config is not None:
        rec.trace.meta["config"] = config.to_dict()
        rec.trace.meta["layer_types"] = config.layer_types()
    rec.trace.meta.update(what=sorted(rec.what), max_tokens=max_tokens, max_batch=max_batch, window=window)
    table = rec.read_hooks(config) if config is not None else _model_free_hooks(rec)
    try:
        with hooks(read=table, owner=(_RECORDER, rec)):
            yield rec.trace
    finally:
        rec.finish()


def _model_free_hooks(rec: Recorder) -> dict[str, Any]:
    """Without a model (no config): tokens, the final hidden state and the loss."""
    N = TraceNames
    table: dict[str, Any] = {_point("tokens"): lambda v, n, info: rec.start_forward(v)}
    if "loss" in rec.what:
        table[_point("token_nll")] = lambda v, n, info: rec.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
    return table
