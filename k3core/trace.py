"""Recording a forward pass into a plain, serialisable Trace.

    with record(model, what={"kda", "moe"}) as trace:
        model(input_ids)
    trace["kda.0.g"]          # numpy array
    trace.axes["kda.0.g"]     # ("batch", "token", "head", "channel")
    trace.save("run.trace.npz"); Trace.load("run.trace.npz")

The recorder is one consumer of the model's hook points (``k3core.hooks``): ``record`` adds read hooks
for the items asked for and turns what they see into these arrays; with no hook context active the
forward runs at full speed. The hook context lives in a ``contextvars`` variable, so each thread (each
app session) records its own model without seeing another's. Recording inside ``intervene`` shows the
edited forward. What
is recorded is bounded: the first ``max_batch`` sequences and the first ``max_tokens`` positions of
each (a contiguous prefix, so that causal and next-token statistics stay meaningful); MLA attention
probabilities only when asked and only up to ``max_attn_len`` positions (computed here from the
layer's q and k; the model's attention path is the same with or without recording). Whole-batch aggregates (MoE
load counts) use every token. KDA state norms are read from the forward's own chunk-end states (hook
point ``kda.chunk_state``, read only): on the torch path from its state loop, on CUDA with fla's Triton
kernel (which cannot hand its states out) from ``kda_chunk_end_states`` after it, so recording keeps the fast
kernel.

This module is the recorder. The ``Trace`` data type, its file format and ``TraceNames`` live in
``k3core.trace_data`` and are re-exported here (``from k3core.trace import Trace, TraceNames, names``).

Array names (``i`` is a 0-based layer index; every array carries its axis names in ``trace.axes``;
build names with ``TraceNames`` (alias ``names``) rather than by hand, e.g. ``names.kda_g(0)``):

    tokens                   [batch, token]                     input ids
    token_nll                [batch, token]                     next-token loss (when labels are given)
    hidden                   [depth, batch, token, hidden]      state entering each layer, then the final one
    hidden_rms               [depth, batch, token]
    kda.i.g                  [batch, token, head, channel]      log decay (alpha = exp(g))
    kda.i.beta               [batch, token, head]
    kda.i.gate               [batch, token, head]               output-gate mean over channels
    kda.i.state_norm         [batch, step, head]                Frobenius norm of S at chunk ends (the forward's
                                                                own states: hook point kda.chunk_state)
    kda.i.state_steps        [step]                             token position of each state_norm step
    kda.i.final_state        [batch, head, key, value]
    mla.i.attn               [batch, head, query, key]          only with "attn_probs"
    mla.i.gate               [batch, token, head]               output-gate mean (gated MLA)
    attnres.i.attn|mlp       [batch, token, source]             depth weights; source names: meta["attnres_sources"]
    attnres.output           [batch, token, source]
    attnres.i.attn_query_norm|mlp_query_norm  []                 pseudo-query norms (scalars)
    attnres.output_query_norm  []
    residual.i.attn_scale|attn_bias|mlp_scale|mlp_bias [hidden] scale/bias residual mode
    moe.i.scores             [batch, token, expert]             sigmoid router scores
    moe.i.experts            [batch, token, rank]               chosen experts (by weight rank)
    moe.i.weights            [batch, token, rank]               their routing weights
    moe.i.latent             [batch, token, latent]             z = W_down x (LatentMoE; x itself for plain MoE)
    moe.i.load               [expert]                           assignments over the whole batch
    moe.i.bias               [expert]                           selection bias e_bias
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .hooks import active, hooks
from .ops.kda import kda_recurrent
from .trace_data import Trace, TraceError, TraceNames, names  # noqa: F401  (TraceError, names: re-exported)

WHAT_ALL = ("hidden", "kda", "mla", "attn_probs", "attnres", "moe", "latent", "loss")
WHAT_DEFAULT = tuple(w for w in WHAT_ALL if w != "attn_probs")

_RECORDER = "recorder"  # the hook context's owner key of the active recorder


def current() -> Recorder | None:
    """The recorder active in this thread/context, or None (the common, free case)."""
    ctx = active()
    return None if ctx is None else ctx.owners.get(_RECORDER)


class Recorder:
    """Turns what the model's hook points show into a Trace (read hooks only). Created by ``record``."""

    def __init__(
        self,
        what: Iterable[str],
        max_tokens: int,
        max_batch: int,
        max_attn_len: int,
        model: torch.nn.Module | None = None,
    ):
        self.what = frozenset(what)
        unknown = self.what - set(WHAT_ALL)
        if unknown:
            raise ValueError(f"unknown trace items {sorted(unknown)}; choose from {WHAT_ALL}")
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_attn_len = max_attn_len
        self.model = model
        self.trace = Trace()
        self._hidden: list[torch.Tensor] = []
        self._held: dict[str, torch.Tensor] = {}  # per layer q, k, ... until the point that needs them

    def wants(self, item: str) -> bool:
        return item in self.what

    def clip(self, x: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """First max_batch sequences, first max_tokens positions."""
        x = x[: self.max_batch]
        return x.narrow(token_dim, 0, min(self.max_tokens, x.shape[token_dim]))

    def put(self, name: str, value: torch.Tensor | np.ndarray, axes: Iterable[str]) -> None:
        self.trace.add(name, value, axes)

    def put_tokens(self, name: str, value: torch.Tensor, axes: Iterable[str]) -> None:
        self.trace.add(name, self.clip(value), axes)

    def start_forward(self, input_ids: torch.Tensor) -> None:
        """A new forward begins: earlier per-forward data is dropped (the last forward wins)."""
        self._hidden = []
        self._held = {}
        self.trace.arrays.clear()
        self.trace.axes.clear()
        self.trace.meta.pop(TraceNames.ATTNRES_SOURCES_META, None)
        self.put_tokens(TraceNames.TOKENS, input_ids, ("batch", "token"))
        if "attnres" in self.what and self.model is not None:
            self._residual_parameters()

    def hidden(self, h: torch.Tensor) -> None:
        if "hidden" in self.what:
            self._hidden.append(self.clip(h).detach().float().cpu())

    def finish(self) -> None:
        if self._hidden:
            stacked = torch.stack(self._hidden)
            self.trace.add(TraceNames.HIDDEN, stacked, ("depth", "batch", "token", "hidden"))
            self.trace.add(TraceNames.HIDDEN_RMS, stacked.pow(2).mean(-1).sqrt(), ("depth", "batch", "token"))
            self._hidden = []
        self._held = {}

    # ------------------------------------------------------------------ hook consumers
    def read_hooks(self, config: Any) -> dict[str, Any]:
        """{hook point: read hook} for the items of ``self.what`` on a model of this config."""
        N = TraceNames
        table: dict[str, Any] = {N.TOKENS: lambda v, n, info: self.start_forward(v)}
        if "hidden" in self.what:
            for i in range(config.num_hidden_layers):
                table[N.block(i, "resid_in")] = lambda v, n, info: self.hidden(v)
            table[N.FINAL_RESID] = lambda v, n, info: self.hidden(v)
        if "loss" in self.what:
            table[N.TOKEN_NLL_POINT] = lambda v, n, info: self.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
        for i in range(config.num_hidden_layers):
            if config.is_mla_layer(i):
                self._mla_hooks(table, i, config)
            elif "kda" in self.what:
                self._kda_hooks(table, i, config)
            if config.is_moe_layer(i) and "moe" in self.what:
                self._moe_hooks(table, i, config)
        if "attnres" in self.what and config.residual in ("block_attnres", "full_attnres"):
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
        table.update({N.block(i, f"kda.{p}"): hold[p] for p in ("q", "k", "v")})
        table[N.block(i, "kda.g")] = [
            lambda v, n, info: self.put_tokens(N.kda_g(i), v, ("batch", "token", "head", "channel")),
            hold["g"],
        ]
        table[N.block(i, "kda.beta")] = [
            lambda v, n, info: self.put_tokens(N.kda_beta(i), v, ("batch", "token", "head")),
            hold["beta"],
        ]
        table[N.block(i, "kda.gate")] = lambda v, n, info: self.put_tokens(
            N.kda_gate(i), v.float().mean(-1), ("batch", "token", "head")
        )
        table[N.block(i, "kda.chunk_state")] = lambda v, n, info: self._kda_chunk_state(i, v, info)
        table[N.block(i, "kda.state")] = lambda v, n, info: self._kda_state(i, v, info)

    def _partial_chunk(self, T: int, chunk_size: int) -> tuple[int, int] | None:
        """[chunk start, prefix end) when the recorded prefix of T tokens ends inside a chunk, else None."""
        end = min(T, self.max_tokens)
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
        """The norm of S at a chunk end inside the recorded prefix (the forward's own state loop)."""
        token = info["token"]
        if token <= self.max_tokens:
            self._held.setdefault(f"{i}.norms", []).append(state[: self.max_batch].float().flatten(-2).norm(dim=-1))
            self._held.setdefault(f"{i}.steps", []).append(token)
            self._held[f"{i}.last"] = state[: self.max_batch]

    @torch.no_grad()
    def _kda_state(self, i: int, final_state: torch.Tensor, info: dict) -> None:
        N = TraceNames
        self.put(N.kda_final_state(i), final_state[: self.max_batch], ("batch", "head", "key", "value"))
        norms, steps = self._held.pop(f"{i}.norms", []), self._held.pop(f"{i}.steps", [])
        last = self._held.pop(f"{i}.last", None)
        partial = [self._held.pop(f"{i}.{p}", None) for p in ("q", "k", "v", "g", "beta")]
        if partial[0] is not None:  # the prefix ends inside a chunk: step on from the last chunk end
            q, k, v, g, beta = partial
            start = last if steps else info.get("initial")
            start = None if start is None else start[: self.max_batch]
            _, state = kda_recurrent(q, k, v, g, beta, initial_state=start, output_final_state=True)
            norms.append(state.float().flatten(-2).norm(dim=-1))
            steps.append(steps[-1] + q.shape[1] if steps else q.shape[1])
        if steps:
            self.put(N.kda_state_norm(i), torch.stack(norms, 1), ("batch", "step", "head"))
            self.put(N.kda_state_steps(i), torch.tensor(steps), ("step",))

    def _mla_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        if "mla" in self.what and config.mla_output_gate:
            table[N.block(i, "mla.gate")] = lambda v, n, info: self.put_tokens(
                N.mla_gate(i), v.float().mean(-1), ("batch", "token", "head")
            )
        if "attn_probs" not in self.what:
            return
        scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        table[N.block(i, "mla.q")] = self._hold(f"{i}.mla.q")

        def probs(value, name, info, mask=None):
            q = self._held[f"{i}.mla.q"]
            k = value if mask is None else self._held[f"{i}.mla.k"]
            self._held[f"{i}.mla.k"] = k
            T, S = q.shape[2], k.shape[2]
            if T != S:  # decoding with a cache: not recorded
                return
            n = min(T, self.max_attn_len)
            q, k = q[: self.max_batch, :, :n], k[: self.max_batch, :, :n]
            visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if mask is None else mask[..., :n, :n]
            self.put(N.mla_attn(i), attention_probabilities(q, k, visible, scale), ("batch", "head", "query", "key"))

        table[N.block(i, "mla.k")] = probs
        # A key mask is a hook point only when an edit writes it; then the probabilities follow it.
        table[N.block(i, "mla.key_mask")] = lambda v, n, info: probs(None, n, info, mask=v)

        def release(value, name, info):  # the attention output: this layer's q and k are not needed any more
            self._held.pop(f"{i}.mla.q", None)
            self._held.pop(f"{i}.mla.k", None)

        table[N.block(i, "mla.o")] = release

    def _moe_hooks(self, table: dict[str, Any], i: int, config: Any) -> None:
        N = TraceNames
        E = config.num_experts
        table[N.block(i, "moe.scores")] = lambda v, n, info: self.put_tokens(
            N.moe_scores(i), v, ("batch", "token", "expert")
        )
        table[N.block(i, "moe.selection_bias")] = lambda v, n, info: self.put(N.moe_bias(i), v, ("expert",))

        def experts(value, name, info):
            self.put_tokens(N.moe_experts(i), value, ("batch", "token", "rank"))
            self.put(N.moe_load(i), torch.bincount(value.reshape(-1), minlength=E), ("expert",))

        table[N.block(i, "moe.experts")] = experts
        table[N.block(i, "moe.weights")] = lambda v, n, info: self.put_tokens(
            N.moe_weights(i), v, ("batch", "token", "rank")
        )
        if "latent" in self.what:
            table[N.block(i, "moe.latent")] = lambda v, n, info: self.put_tokens(
                N.moe_latent(i), v, ("batch", "token", "latent")
            )

    def _attnres_weights(self, value: torch.Tensor, name: str, info: dict) -> None:
        site = info["site"]
        self.put_tokens(TraceNames.attnres(site), value, ("batch", "token", "source"))
        self.trace.meta.setdefault(TraceNames.ATTNRES_SOURCES_META, {})[site] = list(info["sources"])
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
                    if value.is_meta:  # a layer another pipeline rank holds (k3core.pipeline)
                        continue
                    self.put(TraceNames.residual(i, side, kind), value, ("hidden",))


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) over the visible keys, in fp32: q [..., T, d], k [..., S, d], visible [T, S]
    (True = seen). A query that sees no key gets all zeros."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs.nan_to_num(0.0)


@contextlib.contextmanager
def record(
    model: torch.nn.Module | None = None,
    what: Iterable[str] | str | None = None,
    max_tokens: int = 1024,
    max_batch: int = 1,
    max_attn_len: int = 1024,
) -> Iterator[Trace]:
    """Record the internals of every forward run inside the block into one Trace.

    ``what`` picks items from WHAT_ALL ("all" for everything, default: everything but the MLA
    attention matrices, which are quadratic in length). If several forwards run inside the block,
    the last one wins. The recorder is bound to the calling thread/context only: forwards run by
    other threads meanwhile are not recorded, and they may record their own models concurrently.
    ``model`` gives the hook points to read (its config) and the parameters some arrays copy; without
    it only the tokens and the loss are recorded.
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
        model=model if config is not None else None,
    )  # fmt: skip
    if config is not None:
        rec.trace.meta["config"] = config.to_dict()
        rec.trace.meta["layer_types"] = config.layer_types()
    rec.trace.meta.update(what=sorted(rec.what), max_tokens=max_tokens, max_batch=max_batch)
    table = rec.read_hooks(config) if config is not None else _model_free_hooks(rec)
    try:
        with hooks(read=table, owner=(_RECORDER, rec)):
            yield rec.trace
    finally:
        rec.finish()


def _model_free_hooks(rec: Recorder) -> dict[str, Any]:
    """Without a model (no config): tokens, the final hidden state and the loss."""
    N = TraceNames
    table: dict[str, Any] = {N.TOKENS: lambda v, n, info: rec.start_forward(v)}
    if "loss" in rec.what:
        table[N.TOKEN_NLL_POINT] = lambda v, n, info: rec.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
    return table
