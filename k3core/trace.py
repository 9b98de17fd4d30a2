"""Recording a forward pass into a plain, serialisable Trace.

    with record(model, what={"kda", "moe"}) as trace:
        model(input_ids)
    trace["kda.0.g"]          # numpy array
    trace.axes["kda.0.g"]     # ("batch", "token", "head", "channel")
    trace.save("run.trace.npz"); Trace.load("run.trace.npz")

Layers call ``current()`` (one context-variable read) and do nothing more when no recorder is
active, so a model with tracing off runs at full speed. The recorder lives in a ``contextvars``
variable, so each thread (each app session) records its own model without seeing another's. What
is recorded is bounded: the first ``max_batch`` sequences and the first ``max_tokens`` positions of
each (a contiguous prefix, so that causal and next-token statistics stay meaningful); MLA attention
probabilities only when asked and only up to ``max_attn_len`` positions. Whole-batch aggregates (MoE
load counts) use every token.

Array names (``i`` is a 0-based layer index; every array carries its axis names in ``trace.axes``;
build names with ``TraceNames`` (alias ``names``) rather than by hand, e.g. ``names.kda_g(0)``):

    tokens                   [batch, token]                     input ids
    token_nll                [batch, token]                     next-token loss (when labels are given)
    hidden                   [depth, batch, token, hidden]      state entering each layer, then the final one
    hidden_rms               [depth, batch, token]
    kda.i.g                  [batch, token, head, channel]      log decay (alpha = exp(g))
    kda.i.beta               [batch, token, head]
    kda.i.gate               [batch, token, head]               output-gate mean over channels
    kda.i.state_norm         [batch, step, head]                Frobenius norm of S at chunk ends
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
import contextvars
import json
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

WHAT_ALL = ("hidden", "kda", "mla", "attn_probs", "attnres", "moe", "latent", "loss")
WHAT_DEFAULT = tuple(w for w in WHAT_ALL if w != "attn_probs")

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("k3lab_trace_recorder", default=None)


def current() -> Recorder | None:
    """The recorder active in this thread/context, or None (the common, free case)."""
    return _ACTIVE.get()


class TraceNames:
    """Every trace array name, built in one place (``i`` is a 0-based layer index).

    AttnRes sites are ``"{i}.attn"``, ``"{i}.mlp"`` (decoder layer ``i``) and ``"output"`` (the final
    mix); build them with ``attnres_site``. Use as ``from k3core.trace import names``.
    """

    TOKENS = "tokens"
    TOKEN_NLL = "token_nll"
    HIDDEN = "hidden"
    HIDDEN_RMS = "hidden_rms"
    KDA_PREFIX = "kda."
    MLA_PREFIX = "mla."
    MOE_PREFIX = "moe."
    ATTNRES_PREFIX = "attnres."
    RESIDUAL_PREFIX = "residual."
    QUERY_NORM_SUFFIX = "_query_norm"
    OUTPUT_SITE = "output"
    ATTNRES_OUTPUT = "attnres.output"
    ATTNRES_OUTPUT_QUERY_NORM = "attnres.output_query_norm"
    #: ``trace.meta`` key: {site: [source name per position of the site's source axis]}
    ATTNRES_SOURCES_META = "attnres_sources"

    @staticmethod
    def kda_g(i: int) -> str:
        return f"kda.{i}.g"

    @staticmethod
    def kda_beta(i: int) -> str:
        return f"kda.{i}.beta"

    @staticmethod
    def kda_gate(i: int) -> str:
        return f"kda.{i}.gate"

    @staticmethod
    def kda_state_norm(i: int) -> str:
        return f"kda.{i}.state_norm"

    @staticmethod
    def kda_state_steps(i: int) -> str:
        return f"kda.{i}.state_steps"

    @staticmethod
    def kda_final_state(i: int) -> str:
        return f"kda.{i}.final_state"

    @staticmethod
    def mla_attn(i: int) -> str:
        return f"mla.{i}.attn"

    @staticmethod
    def mla_gate(i: int) -> str:
        return f"mla.{i}.gate"

    @staticmethod
    def attnres_site(i: int, side: str) -> str:
        """The site of decoder layer ``i``; ``side`` is "attn" or "mlp"."""
        if side not in ("attn", "mlp"):
            raise ValueError(f"AttnRes side must be 'attn' or 'mlp', got {side!r}")
        return f"{i}.{side}"

    @staticmethod
    def attnres(site: str) -> str:
        """Depth weights [batch, token, source] at a site ("0.attn", "0.mlp", ..., "output")."""
        return f"attnres.{site}"

    @staticmethod
    def attnres_query_norm(site: str) -> str:
        return f"attnres.{site}_query_norm"

    @staticmethod
    def attnres_site_of(name: str) -> str | None:
        """The site of a depth-weight array name ("attnres.3.mlp" -> "3.mlp"); None for other names
        (query norms included)."""
        if not name.startswith("attnres.") or name.endswith("_query_norm"):
            return None
        return name[len("attnres.") :]

    @staticmethod
    def residual(i: int, side: str, kind: str) -> str:
        """Scale/bias residual parameter of layer ``i``: side "attn"|"mlp", kind "scale"|"bias"."""
        if side not in ("attn", "mlp") or kind not in ("scale", "bias"):
            raise ValueError(f"residual side/kind must be attn|mlp and scale|bias, got {side!r}, {kind!r}")
        return f"residual.{i}.{side}_{kind}"

    @staticmethod
    def moe_scores(i: int) -> str:
        return f"moe.{i}.scores"

    @staticmethod
    def moe_experts(i: int) -> str:
        return f"moe.{i}.experts"

    @staticmethod
    def moe_weights(i: int) -> str:
        return f"moe.{i}.weights"

    @staticmethod
    def moe_latent(i: int) -> str:
        return f"moe.{i}.latent"

    @staticmethod
    def moe_load(i: int) -> str:
        return f"moe.{i}.load"

    @staticmethod
    def moe_bias(i: int) -> str:
        return f"moe.{i}.bias"


names = TraceNames


class TraceError(ValueError):
    """A trace file is missing, corrupt or not a k3lab trace."""


@dataclass
class Trace:
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    def get(self, name: str, default: Any = None) -> Any:
        return self.arrays.get(name, default)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.arrays if n.startswith(prefix))

    def layer_indices(self, kind: str) -> list[int]:
        """Layers with data of a kind ("kda", "mla", "moe", "attnres"), in depth order."""
        found = set()
        for name in self.arrays:
            parts = name.split(".")
            if parts[0] == kind and len(parts) > 2 and parts[1].isdigit():
                found.add(int(parts[1]))
        return sorted(found)

    @property
    def config(self) -> dict[str, Any]:
        return self.meta.get("config", {})

    def add(self, name: str, value: np.ndarray | torch.Tensor, axes: Iterable[str]) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu")
            if value.is_floating_point():
                value = value.float()
            value = value.numpy()
        value = np.asarray(value)
        axes = tuple(axes)
        if value.ndim != len(axes):
            raise ValueError(f"{name}: array has {value.ndim} dims but axes {axes}")
        self.arrays[name] = value
        self.axes[name] = axes

    def save(self, path: str | Path) -> Path:
        """One .npz file; the header (meta + axes) is JSON inside it. No pickles."""
        path = Path(path)
        header = json.dumps(
            {"format": "k3lab-trace/1", "meta": self.meta, "axes": {k: list(v) for k, v in self.axes.items()}}
        )
        payload = {f"a/{k}": v for k, v in self.arrays.items()}
        payload["__header__"] = np.frombuffer(header.encode(), dtype=np.uint8)
        with open(path, "wb") as fh:
            np.savez_compressed(fh, **payload)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"{path}: no such trace file")
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(bytes(data["__header__"]).decode())
                arrays = {k[2:]: data[k] for k in data.files if k.startswith("a/")}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise TraceError(f"{path}: not a readable k3lab trace ({type(exc).__name__}: {exc})") from exc
        if not isinstance(header, dict) or header.get("format") != "k3lab-trace/1":
            fmt = header.get("format") if isinstance(header, dict) else None
            raise TraceError(f"{path}: unknown trace format {fmt!r}")
        axes, meta = header.get("axes"), header.get("meta")
        if not isinstance(axes, dict) or not isinstance(meta, dict) or set(axes) != set(arrays):
            raise TraceError(f"{path}: corrupt trace header (axes do not match the stored arrays)")
        return cls(arrays=arrays, axes={k: tuple(v) for k, v in axes.items()}, meta=meta)


class Recorder:
    """Collects tensors from layer hooks into a Trace. Created by ``record``."""

    def __init__(self, what: Iterable[str], max_tokens: int, max_batch: int, max_attn_len: int):
        self.what = frozenset(what)
        unknown = self.what - set(WHAT_ALL)
        if unknown:
            raise ValueError(f"unknown trace items {sorted(unknown)}; choose from {WHAT_ALL}")
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_attn_len = max_attn_len
        self.trace = Trace()
        self._hidden: list[torch.Tensor] = []

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
        self.trace.arrays.clear()
        self.trace.axes.clear()
        self.trace.meta.pop(TraceNames.ATTNRES_SOURCES_META, None)
        self.put_tokens(TraceNames.TOKENS, input_ids, ("batch", "token"))

    def hidden(self, h: torch.Tensor) -> None:
        if "hidden" in self.what:
            self._hidden.append(self.clip(h).detach().float().cpu())

    def finish(self) -> None:
        if self._hidden:
            stacked = torch.stack(self._hidden)
            self.trace.add(TraceNames.HIDDEN, stacked, ("depth", "batch", "token", "hidden"))
            self.trace.add(TraceNames.HIDDEN_RMS, stacked.pow(2).mean(-1).sqrt(), ("depth", "batch", "token"))
            self._hidden = []


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
    """
    if _ACTIVE.get() is not None:
        raise RuntimeError("record() blocks cannot be nested")
    if what is None:
        what = WHAT_DEFAULT
    elif what == "all":
        what = WHAT_ALL
    elif isinstance(what, str):
        what = (what,)
    rec = Recorder(what, max_tokens=max_tokens, max_batch=max_batch, max_attn_len=max_attn_len)
    if model is not None and hasattr(model, "config"):
        cfg = model.config
        rec.trace.meta["config"] = cfg.to_dict()
        rec.trace.meta["layer_types"] = cfg.layer_types()
    rec.trace.meta.update(what=sorted(rec.what), max_tokens=max_tokens, max_batch=max_batch)
    token = _ACTIVE.set(rec)
    try:
        yield rec.trace
    finally:
        _ACTIVE.reset(token)
        rec.finish()
