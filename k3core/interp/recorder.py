"""Recording a forward pass into a plain, serialisable Trace.

    with record(model, what={"kda", "moe"}) as trace:
        model(input_ids)
    trace["blocks.0.kda.g"]          # numpy array
    trace.axes["blocks.0.kda.g"]     # ("batch", "token", "head", "channel")
    trace.save("run.trace.npz"); Trace.load("run.trace.npz")

The recorder is one consumer of the model's hook points (``k3core.modeling.hooks``): ``record`` adds read hooks
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
    hidden_bins.gram         [depth, batch, bin, hidden, hidden2]   sum of h h^T over each bin (width <= 1,024, or
                                                                "hidden_gram" in what)
    hidden_bins.cross_gram   [layer, batch, bin, hidden, hidden2]   sum of h_l h_(l+1)^T (depth l to l + 1)
    hidden_bins.sq_sum|sketch_sum|sketch_gram|sketch_cross_gram     wider states: sum ||h||^2 [depth, batch, bin]
                             and a seeded random-projection sketch R^T s, R^T G R, R^T C R (k x k, k = 256;
                             meta["hidden_sketch"]; ``k3core.interp.hidden_moments``)
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
    blocks.i.kda.attn        [batch, head, query, key]          only with "attn_probs": KDA's implicit attention A
                                                                (signed; o = A v), the query window over its keys
    blocks.i.kda.attn.before [batch, head, query]               each window query's signed mass before the window
    blocks.i.kda.attn.entropy|sink|received|negative|row_sum|half_distance  [batch, head, token]  with "kda_attn":
                                                                per position on |A| normalised per query (nats,
                                                                first-token share, column sum, negative share;
                                                                signed row sum; distance holding half the mass)
    blocks.i.kda.attn.distance  [batch, head, bin, distance]    |A| share by distance bin, summed per position bin
    blocks.i.kda.attn.distance_edges  [edge]                    distance bin edges 0, 1, 2, 4, ... T
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

from ..modeling.hooks import active, hooks
from .attention_stats import DEFAULT_BLOCK, position_bins
from .catalogue import point_name
from .hidden_moments import (
    MOMENT_AXES,
    SKETCH_META,
    depth_moments,
    sketch_meta,
    sketch_projection,
    uses_sketch,
)
from .layer_reads import KDAReads, MLAReads, MoEReads, ResidualReads
from .trace import Trace, TraceNames
from .trace_size import WHAT_ALL, WHAT_ON_REQUEST, resolve_what

_RECORDER = "recorder"  # the hook context's owner key of the active recorder


def current() -> Recorder | None:
    """The recorder active in this thread/context, or None (the common, free case)."""
    ctx = active()
    return None if ctx is None else ctx.owners.get(_RECORDER)


class Recorder:
    """Turns what the model's hook points show into a Trace (read hooks only). Created by ``record``; the
    per-layer read hooks (KDA, MLA, MoE, AttnRes) are ``k3core.interp.layer_reads``' readers, one per kind, each
    using the recorder's public part (``RecordingTarget``: ``what``, ``held``, ``limit``, ``put``, ...)."""

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
        unknown = self.what - set(WHAT_ALL) - set(WHAT_ON_REQUEST)
        if unknown:
            raise ValueError(f"unknown trace items {sorted(unknown)}; choose from {WHAT_ALL + WHAT_ON_REQUEST}")
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
        self.held: dict[str, Any] = {}  # per layer q, k, ... until the point that needs them
        self._bins: list[int] = [0, 1]
        self._projection: torch.Tensor | None = None  # the hidden-state sketch's R (k3core.interp.hidden_moments)

    def wants(self, item: str) -> bool:
        return item in self.what

    def limit(self, T: int) -> int:
        """How many positions of a T-token forward are recorded."""
        return T if self.max_tokens is None else min(T, self.max_tokens)

    def clip(self, x: torch.Tensor, token_dim: int = 1) -> torch.Tensor:
        """First max_batch sequences, first max_tokens positions (all of them when max_tokens is None)."""
        x = x[: self.max_batch]
        return x.narrow(token_dim, 0, self.limit(x.shape[token_dim]))

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
        self.held = {}
        self.trace.arrays.clear()
        self.trace.axes.clear()
        self.trace.meta.pop(TraceNames.ATTNRES_SOURCES_META, None)
        self.trace.meta.pop(SKETCH_META, None)
        self._bins = position_bins(self.limit(input_ids.shape[1]))
        self.put_tokens(TraceNames.TOKENS, input_ids, ("batch", "token"))
        self.put(TraceNames.POSITION_BINS, torch.tensor(self._bins), ("edge",))
        if "attnres" in self.what and self.model is not None:
            ResidualReads(self).residual_parameters()

    @torch.no_grad()
    def hidden(self, h: torch.Tensor) -> None:
        if "hidden" not in self.what:
            return
        x = self.clip(h).detach()
        self.held.setdefault("hidden_rms", []).append(x.float().pow(2).mean(-1).sqrt().cpu())
        self._hidden.append(self.clip_window(x).float().cpu())
        self._hidden_moments(x.double().cpu())

    def _hidden_moments(self, x: torch.Tensor) -> None:
        """This depth's moments per position bin (``k3core.interp.hidden_moments.depth_moments``: exact Gram matrices
        up to a width, a seeded random-projection sketch above it), with the previous depth's pair moments."""
        if uses_sketch(x.shape[-1], self.what):
            if self._projection is None:  # made once per recorder (seeded: the same R in every process)
                self._projection = sketch_projection(x.shape[-1])
            self.trace.meta[SKETCH_META] = sketch_meta()
        moments, carry = depth_moments(x, self.held.get("hidden_prev"), self._bins, self._projection)
        held = self.held.setdefault("hidden_moments", {})
        for kind, value in moments.items():
            held.setdefault(kind, []).append(value)
        self.held["hidden_prev"] = carry

    def finish(self) -> None:
        N = TraceNames
        if self._hidden:
            self.trace.add(N.HIDDEN, torch.stack(self._hidden), ("depth", "batch", "token", "hidden"))
            self.trace.add(N.HIDDEN_RMS, torch.stack(self.held.pop("hidden_rms")), ("depth", "batch", "token"))
            self._hidden = []
            moments = self.held.pop("hidden_moments", {})
            edges = np.asarray(self._bins)
            self.put(N.hidden_bins("count"), np.diff(edges), ("bin",))
            for kind, values in moments.items():
                # float64 numpy, not the Trace's fp32: a Gram sum over 64K tokens needs the precision
                self.put(N.hidden_bins(kind), torch.stack(values).numpy(), MOMENT_AXES[kind])
        self.held = {}
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
        table: dict[str, Any] = {point_name("tokens"): lambda v, n, info: self.start_forward(v)}
        if "hidden" in self.what:
            for i in range(config.num_hidden_layers):
                table[point_name("resid_in", i)] = lambda v, n, info: self.hidden(v)
            table[point_name("final_resid")] = lambda v, n, info: self.hidden(v)
        if "loss" in self.what:
            table[point_name("token_nll")] = lambda v, n, info: self.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
        kda, mla, moe, residual = KDAReads(self), MLAReads(self), MoEReads(self), ResidualReads(self)
        for i in range(config.num_hidden_layers):
            (mla if config.is_mla_layer(i) else kda).hooks(table, i, config)
            if config.is_moe_layer(i) and "moe" in self.what:
                moe.hooks(table, i, config)
        if "attnres" in self.what and config.uses_attnres:
            sites = [N.attnres_site(i, side) for i in range(config.num_hidden_layers) for side in ("attn", "mlp")]
            for site in [*sites, N.OUTPUT_SITE]:
                table[N.attnres_point(site, "weights")] = residual.attnres_weights
        return table


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

    ``what`` picks items from WHAT_ALL ("all" for everything, default or "default": everything but the MLA
    attention matrices, which are quadratic in length), plus WHAT_ON_REQUEST by name ("hidden_gram": the exact
    D x D hidden-state Gram matrices at any width; above 1,024 channels they are sketched otherwise). The bytes a
    recording holds are estimated before any forward by ``k3core.interp.trace_size.record_bytes``. If several
    forwards run inside the block, the last one wins. The recorder is bound to the calling thread/context only:
    forwards run by other threads meanwhile are not recorded, and they may record their own models concurrently.
    ``model`` gives the hook points to read (its config) and the parameters some arrays copy; without
    it only the tokens and the loss are recorded.

    Positions: ``max_tokens`` (None: all) cuts every array to a prefix; ``window`` (None: all) bounds the bulky
    per-token arrays (hidden, blocks.i.kda.g, blocks.i.moe.latent), which are summarised over every position by bins;
    ``attn_window`` (default ``(0, max_attn_len)``) is the query range of the attention maps; ``attn_block``
    queries at a time go into the blocked attention statistics.
    """
    if current() is not None:
        raise RuntimeError("record() blocks cannot be nested")
    what = resolve_what(what)
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
    table: dict[str, Any] = {point_name("tokens"): lambda v, n, info: rec.start_forward(v)}
    if "loss" in rec.what:
        table[point_name("token_nll")] = lambda v, n, info: rec.put_tokens(N.TOKEN_NLL, v, ("batch", "token"))
    return table
