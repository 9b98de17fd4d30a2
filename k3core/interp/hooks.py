"""Hook points: every named activation of the forward pass, read or replaced from outside.

    with hooks(read={"blocks.3.kda.g": look}, write={"blocks.3.mixer_out": lambda v, point: v * 0}):
        model(input_ids)

The model calls ``active()`` once per module forward (one context-variable read); with no hook context
active it does nothing else, so the plain forward runs at full speed. Inside a context, each named value
passes ``HookContext.point(name, value, **info)``: the write hooks of that name run first, in the order
they were added, each returning a replacement (or None to keep the value), then the read hooks see the
final value. ``info`` carries what a hook needs beyond the tensor (AttnRes source names, a KDA initial
state). A few points are offered only when a hook asks for them, because producing them costs work the
plain forward does not do (``ON_REQUEST``: the KDA final state and chunk-end states, the MLA key mask,
the depth stream).

The context lives in a ``contextvars`` variable, so each thread (each app session) hooks its own
forwards. Contexts nest: an inner one holds the outer one's hooks plus its own. ``k3core.interp.recorder.record``
and ``k3core.interp.interventions.intervene`` are both built on this module.

Hook point names (``i`` is a 0-based layer index; build them with ``HookNames``; ``hook_points(config)``
lists a model's points with their axes):

    tokens                          [batch, token]                    input ids (read only)
    embed                           [batch, token, hidden]            embedding output
    blocks.i.stream                 [source, batch, token, hidden]    depth state entering layer i (on request):
                                                                      plain/scale_bias: [h]; AttnRes: its sources
    blocks.i.resid_in               [batch, token, hidden]            the attention sub-layer's input (pre-norm)
    blocks.i.mixer_in|mixer_out     [batch, token, hidden]            KDA/MLA input (after RMSNorm) and output
    blocks.i.ffn_in                 [batch, token, hidden]            the FFN sub-layer's input (pre-norm)
    blocks.i.ffn_out                [batch, token, hidden]            dense FFN or MoE output
    blocks.i.kda.q|k|v              [batch, token, head, channel]     after conv, SiLU (q, k: L2-normalised)
    blocks.i.kda.g                  [batch, token, head, channel]     log decay (alpha = exp(g))
    blocks.i.kda.beta               [batch, token, head]              write strength
    blocks.i.kda.o                  [batch, token, head, channel]     delta-rule output, before the gated norm
    blocks.i.kda.gate               [batch, token, head, channel]     sigmoid output gate
    blocks.i.kda.state              [batch, head, key, value]         final recurrent state (on request)
    blocks.i.kda.chunk_state        [batch, head, key, value]         state at each chunk end (on request; once
                                                                      per chunk, from the forward's own state
                                                                      loop; info: chunk, chunks, token = the
                                                                      end position in this call, length,
                                                                      start (cached tokens before), axes;
                                                                      a write is the state the next chunk
                                                                      starts from; forces the torch KDA path;
                                                                      a decoding step is one 1-token chunk)
    blocks.i.mla.q                  [batch, head, query, channel]     query (nope + rope parts)
    blocks.i.mla.k|v                [batch, head, key, channel]
    blocks.i.mla.key_mask           [query, key]                      bool, True = visible (on request)
    blocks.i.mla.o                  [batch, query, head, channel]     attention output, before the gate
    blocks.i.mla.gate               [batch, query, head, channel]     sigmoid output gate (gated MLA)
    blocks.i.moe.scores             [batch, token, expert]            sigmoid router scores
    blocks.i.moe.selection_bias     [expert]                          e_bias (steers selection only)
    blocks.i.moe.selection          [batch, token, expert]            scores + e_bias, ranked by top-k
    blocks.i.moe.experts|weights    [batch, token, rank]              chosen experts, their routing weights
    blocks.i.moe.latent             [batch, token, latent]            z = W_down x (plain MoE: x)
    blocks.i.moe.routed_out         [batch, token, hidden]            routed experts' output (after W_up)
    blocks.i.moe.shared_out         [batch, token, hidden]            shared experts' output
    blocks.i.attn_res.weights       [batch, token, source]            AttnRes depth weights, attention input site
    blocks.i.attn_res.mix           [batch, token, hidden]            its mixed output (= resid_in)
    blocks.i.mlp_res.weights        [batch, token, source]            depth weights, FFN input site
    blocks.i.mlp_res.mix            [batch, token, hidden]            its mixed output (= ffn_in)
    output_res.weights              [batch, token, source]            the final depth mix (AttnRes)
    output_res.mix                  [batch, token, hidden]
    final_stream                    [source, batch, token, hidden]    depth state before the output (on request)
    final_resid                     [batch, token, hidden]            the last hidden state, before the final norm
    final_norm                      [batch, token, hidden]            after the final RMSNorm
    logits                          [batch, token, vocab]
    token_nll                       [batch, token]                    next-token loss (with labels; read only)
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

#: A hook: (value, name, info) -> replacement or None (keep).
Hook = Callable[..., Any]

_ACTIVE: contextvars.ContextVar[HookContext | None] = contextvars.ContextVar("k3lab_hooks", default=None)


def active() -> HookContext | None:
    """The hook context of this thread/context, or None (the common, free case)."""
    return _ACTIVE.get()


class HookNames:
    """Every hook point name, built in one place (``i``: 0-based layer index).

    AttnRes sites are ``"{i}.attn"``, ``"{i}.mlp"`` and ``"output"`` (as in ``k3core.interp.recorder``)."""

    TOKENS = "tokens"
    EMBED = "embed"
    FINAL_STREAM = "final_stream"
    FINAL_RESID = "final_resid"
    FINAL_NORM = "final_norm"
    LOGITS = "logits"
    TOKEN_NLL_POINT = "token_nll"
    OUTPUT_SITE = "output"

    KDA_POINTS = ("q", "k", "v", "g", "beta", "o", "gate", "chunk_state", "state")
    MLA_POINTS = ("q", "k", "v", "key_mask", "o", "gate")
    MOE_POINTS = ("scores", "selection_bias", "selection", "experts", "weights", "latent", "routed_out", "shared_out")
    LAYER_POINTS = ("stream", "resid_in", "mixer_in", "mixer_out", "ffn_in", "ffn_out")
    #: produced only when a hook asks for them (they cost work the plain forward does not do)
    ON_REQUEST = ("stream", "kda.chunk_state", "kda.state", "mla.key_mask", "final_stream")

    @staticmethod
    def block(i: int, point: str) -> str:
        """``blocks.{i}.{point}``, e.g. block(3, "kda.g")."""
        return f"blocks.{i}.{point}"

    @staticmethod
    def attnres_site(i: int, side: str) -> str:
        """The AttnRes site of decoder layer ``i``; ``side`` is "attn" or "mlp"."""
        if side not in ("attn", "mlp"):
            raise ValueError(f"AttnRes side must be 'attn' or 'mlp', got {side!r}")
        return f"{i}.{side}"

    @staticmethod
    def attnres_point(site: str, what: str) -> str:
        """Depth weights (what="weights") or mixed output (what="mix") of an AttnRes site."""
        if what not in ("weights", "mix"):
            raise ValueError(f"AttnRes hook must be 'weights' or 'mix', got {what!r}")
        if site == "output":
            return f"output_res.{what}"
        layer, _, side = site.partition(".")
        if not layer.isdigit() or side not in ("attn", "mlp"):
            raise ValueError(f"AttnRes site must be 'i.attn', 'i.mlp' or 'output', got {site!r}")
        return f"blocks.{layer}.{side}_res.{what}"

    @staticmethod
    def layer_of(name: str) -> int | None:
        """The layer index of a ``blocks.i.*`` name, else None."""
        m = re.match(r"blocks\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    @staticmethod
    def point_of(name: str) -> str:
        """The name without its ``blocks.i.`` prefix ("blocks.3.kda.g" -> "kda.g")."""
        return re.sub(r"^blocks\.\d+\.", "", name)


_BTD = ("batch", "token", "hidden")
_BTHC = ("batch", "token", "head", "channel")

#: axes of every point, by its name without the ``blocks.i.`` prefix
POINT_AXES: dict[str, tuple[str, ...]] = {
    "tokens": ("batch", "token"),
    "embed": _BTD,
    "stream": ("source", "batch", "token", "hidden"),
    "resid_in": _BTD,
    "mixer_in": _BTD,
    "mixer_out": _BTD,
    "ffn_in": _BTD,
    "ffn_out": _BTD,
    "kda.q": _BTHC,
    "kda.k": _BTHC,
    "kda.v": _BTHC,
    "kda.g": _BTHC,
    "kda.beta": ("batch", "token", "head"),
    "kda.o": _BTHC,
    "kda.gate": _BTHC,
    "kda.state": ("batch", "head", "key", "value"),
    "kda.chunk_state": ("batch", "head", "key", "value"),
    "mla.q": ("batch", "head", "token", "channel"),
    "mla.k": ("batch", "head", "key", "channel"),
    "mla.v": ("batch", "head", "key", "channel"),
    "mla.key_mask": ("token", "key"),
    "mla.o": _BTHC,
    "mla.gate": _BTHC,
    "moe.scores": ("batch", "token", "expert"),
    "moe.selection_bias": ("expert",),
    "moe.selection": ("batch", "token", "expert"),
    "moe.experts": ("batch", "token", "rank"),
    "moe.weights": ("batch", "token", "rank"),
    "moe.latent": ("batch", "token", "latent"),
    "moe.routed_out": _BTD,
    "moe.shared_out": _BTD,
    "attn_res.weights": ("batch", "token", "source"),
    "attn_res.mix": _BTD,
    "mlp_res.weights": ("batch", "token", "source"),
    "mlp_res.mix": _BTD,
    "output_res.weights": ("batch", "token", "source"),
    "output_res.mix": _BTD,
    "final_stream": ("source", "batch", "token", "hidden"),
    "final_resid": _BTD,
    "final_norm": _BTD,
    "logits": ("batch", "token", "vocab"),
    "token_nll": ("batch", "token"),
}


def point_axes(name: str) -> tuple[str, ...]:
    """Axis names of a hook point's value."""
    return POINT_AXES[HookNames.point_of(name)]


def hook_points(config: Any) -> list[str]:
    """Every hook point a model of this config offers, in forward order."""
    attnres = config.uses_attnres
    out = [HookNames.TOKENS, HookNames.EMBED]
    for i in range(config.num_hidden_layers):
        local = ["stream"]
        if attnres_has_attn_site(config, i):
            local += ["attn_res.weights", "attn_res.mix"]
        local += ["resid_in", "mixer_in"]
        if config.is_mla_layer(i):
            local += [f"mla.{p}" for p in HookNames.MLA_POINTS if p != "gate" or config.mla_output_gate]
        else:
            local += [f"kda.{p}" for p in HookNames.KDA_POINTS]
        local += ["mixer_out"]
        if attnres:
            local += ["mlp_res.weights", "mlp_res.mix"]
        local += ["ffn_in"]
        if config.is_moe_layer(i):
            local += [f"moe.{p}" for p in HookNames.MOE_POINTS if p != "shared_out" or config.num_shared_experts]
        local += ["ffn_out"]
        out += [HookNames.block(i, p) for p in local]
    out.append(HookNames.FINAL_STREAM)
    if attnres:
        out += ["output_res.weights", "output_res.mix"]
    out += [HookNames.FINAL_RESID, HookNames.FINAL_NORM, HookNames.LOGITS, HookNames.TOKEN_NLL_POINT]
    return out


def attnres_has_attn_site(config: Any, layer: int) -> bool:
    """Whether layer ``layer``'s attention input is a depth mix (block AttnRes: not at layer 0)."""
    return config.uses_attnres and layer > 0


class HookContext:
    """Read and write hooks by point name (built by ``hooks``; nested contexts copy their parent's)."""

    def __init__(self, parent: HookContext | None = None):
        self.read: dict[str, list[Hook]] = {k: list(v) for k, v in parent.read.items()} if parent else {}
        self.write: dict[str, list[Hook]] = {k: list(v) for k, v in parent.write.items()} if parent else {}
        self.owners: dict[str, Any] = dict(parent.owners) if parent else {}

    def add(self, name: str, hook: Hook, write: bool = False) -> None:
        (self.write if write else self.read).setdefault(name, []).append(hook)

    def wants(self, name: str) -> bool:
        """Whether any hook reads or writes ``name`` (for the points offered on request)."""
        return name in self.read or name in self.write

    def writes(self, name: str) -> bool:
        return name in self.write

    def point(self, name: str, value: Any, **info: Any) -> Any:
        """Pass a value through the hooks of ``name``: writers may replace it, then readers see it."""
        for hook in self.write.get(name, ()):
            new = hook(value, name, info)
            if new is not None:
                value = new
        for hook in self.read.get(name, ()):
            hook(value, name, info)
        return value


@contextlib.contextmanager
def hooks(
    read: Mapping[str, Hook | list[Hook]] | None = None,
    write: Mapping[str, Hook | list[Hook]] | None = None,
    owner: tuple[str, Any] | None = None,
) -> Iterator[HookContext]:
    """Run forwards inside the block with extra read and write hooks (kept on top of any outer context).

    A hook is called as ``hook(value, name, info)``; a write hook returns the replacement value (same
    shape; None keeps the value). ``owner`` (key, object) tags the context, e.g. the active recorder."""
    ctx = HookContext(active())
    for table, write_flag in ((read or {}, False), (write or {}, True)):
        for name, fns in table.items():
            for fn in fns if isinstance(fns, list | tuple) else [fns]:
                ctx.add(name, fn, write=write_flag)
    if owner is not None:
        ctx.owners[owner[0]] = owner[1]
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


def point(ctx: HookContext | None, name: str, value: torch.Tensor, **info: Any) -> torch.Tensor:
    """``ctx.point(...)`` when a context is active, else the value unchanged."""
    return value if ctx is None else ctx.point(name, value, **info)
