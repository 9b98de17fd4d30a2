"""Hook points: every named activation of the forward pass, read or replaced from outside.

    >>> import torch
    >>> from k3core.modeling.presets import from_preset
    >>> from k3core.modeling.model import K3ForCausalLM
    >>> model = K3ForCausalLM.from_config(from_preset("k3-nano"))
    >>> ids = torch.tensor([[1, 2, 3, 4]])
    >>> seen = {}
    >>> look = lambda value, name, info: seen.setdefault(name, tuple(value.shape))
    >>> drop = lambda value, name, info: value * 0
    >>> with torch.no_grad(), hooks(read={"blocks.0.kda.g": look}, write={"blocks.1.mixer_out": drop}):
    ...     _ = model(ids)
    >>> seen["blocks.0.kda.g"]
    (1, 4, 2, 16)

A hook is called as ``hook(value, name, info)``: a write hook returns the replacement (same shape; None keeps
the value), a read hook's return is ignored. ``info`` carries what a hook needs beyond the tensor (AttnRes
source names, a KDA chunk index).

Every point is declared once, as a ``HookPoint`` (name, axes, one-line meaning), in the module that produces it
(``k3core.modeling.layers.kda``, ``mla``, ``moe``, ``residual``, ``k3core.modeling.model``);
``k3core.interp.catalogue`` collects the declarations (``hook_points(config)``, ``POINT_AXES``, the table in
docs/ARCHITECTURE.md). The model passes a value through a point with ``point(ctx, name, value, **info)`` (the one
way to call hooks), where ``ctx`` is ``active()``, read once per module forward: with no hook context active nothing
else happens, so the plain forward runs at full speed. Inside a context the write hooks of that name run first, in
the order they were added, then the read hooks see the final value. Points marked ``on_request`` are produced only
when a hook asks for them (``wants``), because producing them costs work the plain forward does not do.

The context lives in a ``contextvars`` variable, so each thread (each app session) hooks its own forwards.
Contexts nest: an inner one holds the outer one's hooks plus its own. ``k3core.interp.recorder.record`` and
``k3core.interp.interventions.intervene`` are both built on this module.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: A hook: (value, name, info) -> replacement or None (keep).
Hook = Callable[..., Any]

_ACTIVE: contextvars.ContextVar[HookContext | None] = contextvars.ContextVar("k3lab_hooks", default=None)


def active() -> HookContext | None:
    """The hook context of this thread/context, or None (the common, free case).

    Always None inside ``torch.compile``: Dynamo cannot trace a ``ContextVar`` read (it broke the graph at
    every module), so a compiled forward has no hook points; hooks run on the eager model, which shares its
    parameters (``k3lab train --compile`` validates and records eagerly)."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


@dataclass(frozen=True)
class HookPoint:
    """One named activation, declared where it is produced.

    ``name`` is local ("kda.g"; a point of every decoder layer i is ``blocks.{i}.{name}``) or model-wide
    ("logits", ``per_layer=False``); ``axes`` name the value's dimensions; ``meaning`` is one line for the docs
    table. ``on_request``: produced only when a hook asks for it (``HookContext.wants``)."""

    name: str
    axes: tuple[str, ...]
    meaning: str
    per_layer: bool = True
    on_request: bool = False

    def at(self, layer: int | None = None) -> str:
        """The full hook name: ``blocks.{layer}.{name}`` for a per-layer point, else ``name``."""
        if self.per_layer:
            if layer is None:
                raise ValueError(f"hook point {self.name!r} is per layer: give the layer")
            return HookNames.block(layer, self.name)
        return self.name


_SUBLAYERS = ("attn", "mlp")
_SITE_POINT = re.compile(r"blocks\.(\d+)\.(attn|mlp)_res\.")


@dataclass(frozen=True)
class AttnResSite:
    """Where an AttnRes mix happens: before the attention (``"attn"``) or the MLP (``"mlp"``) sub-layer of decoder
    layer ``layer``, or the final mix before the output norm (``OUTPUT``: layer None, sublayer ``"output"``).

    Written ``"3.attn"``, ``"3.mlp"`` or ``"output"`` (``str(site)``; the edit kinds', the recorder's and the
    trace meta's form) and read back by ``parse``, the one reader of that form."""

    layer: int | None
    sublayer: str

    def __post_init__(self) -> None:
        ok = (self.layer is None and self.sublayer == "output") or (
            isinstance(self.layer, int) and self.layer >= 0 and self.sublayer in _SUBLAYERS
        )
        if not ok:
            raise ValueError(f"AttnRes site must be layer >= 0 with 'attn' or 'mlp', or the output, got {self!r}")

    @classmethod
    def parse(cls, text: str) -> AttnResSite:
        """``"3.attn"`` -> AttnResSite(3, "attn"); ``"output"`` -> OUTPUT. Raises ValueError."""
        if text == "output":
            return cls(None, "output")
        layer, _, side = str(text).partition(".")
        if not layer.isdigit() or side not in _SUBLAYERS:
            raise ValueError(f"AttnRes site must be 'i.attn', 'i.mlp' or 'output', got {text!r}")
        return cls(int(layer), side)

    @classmethod
    def of_point(cls, name: str) -> AttnResSite | None:
        """The site of a hook name made by ``point`` ("blocks.3.mlp_res.weights" -> 3.mlp), else None."""
        if name.startswith("output_res."):
            return cls(None, "output")
        m = _SITE_POINT.match(name)
        return cls(int(m.group(1)), m.group(2)) if m else None

    @property
    def is_output(self) -> bool:
        return self.layer is None

    def point(self, what: str) -> str:
        """The hook name of ``what`` at this site: "weights" (depth weights), "mix" (mixed output), or a quantity
        recorded beside them ("query_norm", "scale", "bias")."""
        if not what.replace("_", "").isalpha():
            raise ValueError(f"AttnRes item must be a word, got {what!r}")
        if self.layer is None:
            return f"output_res.{what}"
        return HookNames.block(self.layer, f"{self.sublayer}_res.{what}")

    def __str__(self) -> str:
        return "output" if self.layer is None else f"{self.layer}.{self.sublayer}"


class HookNames:
    """Hook point names from their parts (``i``: 0-based layer index); the one place they are spelt.

    AttnRes sites are ``AttnResSite`` values, written ``"{i}.attn"``, ``"{i}.mlp"`` and ``"output"`` (the edit
    kinds' and the recorder's site names); the string forms below go through it."""

    OUTPUT_SITE = "output"

    @staticmethod
    def block(i: int, point: str) -> str:
        """``blocks.{i}.{point}``, e.g. block(3, "kda.g")."""
        return f"blocks.{i}.{point}"

    @staticmethod
    def attnres_site(i: int, side: str) -> str:
        """The AttnRes site of decoder layer ``i``; ``side`` is "attn" or "mlp"."""
        if side not in _SUBLAYERS:
            raise ValueError(f"AttnRes side must be 'attn' or 'mlp', got {side!r}")
        return str(AttnResSite(i, side))

    @staticmethod
    def attnres_point(site: str | AttnResSite, what: str) -> str:
        """The hook point of an AttnRes site (``AttnResSite.point``)."""
        return (site if isinstance(site, AttnResSite) else AttnResSite.parse(site)).point(what)

    @staticmethod
    def site_of(name: str) -> str | None:
        """The AttnRes site of a name made by ``attnres_point`` ("blocks.3.mlp_res.weights" -> "3.mlp",
        "output_res.mix" -> "output"), else None."""
        site = AttnResSite.of_point(name)
        return None if site is None else str(site)

    @staticmethod
    def layer_of(name: str) -> int | None:
        """The layer index of a ``blocks.i.*`` name, else None."""
        m = re.match(r"blocks\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    @staticmethod
    def point_of(name: str) -> str:
        """The name without its ``blocks.i.`` prefix ("blocks.3.kda.g" -> "kda.g")."""
        return re.sub(r"^blocks\.\d+\.", "", name)


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

    def run(self, name: str, value: Any, info: dict[str, Any]) -> Any:
        """The hooks of ``name`` on a value: writers may replace it, then readers see it (called by ``point``)."""
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


def point(ctx: HookContext | None, name: str, value: Any, **info: Any) -> Any:
    """The one way the model calls hooks: ``value`` through the hooks of ``name`` when a context is active
    (writers, then readers), else unchanged."""
    return value if ctx is None else ctx.run(name, value, info)
