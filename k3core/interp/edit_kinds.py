"""The edit kinds: each a dataclass of plain data that validates itself and turns into write hooks.

``ValueEdit``, ``AttnResEdit``, ``KDAEdit``, ``MoEEdit`` and ``MLAEdit`` (what each does:
``k3core.interp.interventions``' docstring), their ``EditError``, and the helpers they share (token ranges,
index lists, masks along named axes, the layers that have a hook point). ``k3core.interp.interventions``
reads them from JSON or the short form and applies them to a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..modeling.hooks import HookNames
from ..utils import input_limits as limits
from .catalogue import POINT_AXES, hook_points, source_label

# A g far below the chunked kernel's floor: exp(g) is 0 in the recurrent path and ~1e-26 in the chunked one.
RESET_G = -1.0e4


class EditError(ValueError):
    """An edit that names something the model does not have, or bad edit data."""


Range = tuple[int, int] | None  # [start, stop) positions; None: all


def _range(value: Any, what: str) -> Range:
    """[start, stop) positions from one position or a pair (``k3core.utils.input_limits``: no negatives, bounded)."""
    if value is None:
        return None
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            start = limits.index(value, what)
            return (start, start + 1)
        try:
            start, stop = value
        except (TypeError, ValueError):
            raise EditError(f"{what} must be [start, stop) or one position, got {limits.shown(value)}") from None
        start, stop = limits.index(start, f"{what} start"), limits.index(stop, f"{what} stop")
    except limits.InputLimitError as exc:
        raise EditError(str(exc)) from None
    if stop <= start:
        raise EditError(f"{what} must be a non-empty range [start, stop) of positions >= 0, got {limits.shown(value)}")
    return (start, stop)


def _ints(value: Any, what: str) -> list[int] | None:
    """A list of 0-based indices (``k3core.utils.input_limits.indices``: negatives refused, never counted from the
    end)."""
    if value is None:
        return None
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise EditError(f"{what} must be a list of integers, got {limits.shown(value)}")
    try:
        return limits.indices(values, what)
    except limits.InputLimitError as exc:
        raise EditError(str(exc)) from None


@dataclass
class _Edit:
    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data, with ``kind``; ``edit_from_dict`` reads it back."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def describe(self) -> str:
        """One line for tables and menus, e.g. "moe ban layer=3 experts=[5]"."""
        parts = [self.kind] + [
            f"{k}={v}" if k != "op" else str(v) for k, v in self.to_dict().items() if k != "kind" and v is not None
        ]
        return " ".join(parts)

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:  # pragma: no cover - every kind overrides
        raise NotImplementedError


def _mask_along(value: torch.Tensor, axes: tuple[str, ...], picks: dict[str, Any]) -> torch.Tensor | None:
    """A bool mask broadcastable to ``value``: True where every picked axis is in its selection."""
    mask = None
    for axis, pick in picks.items():
        dim = axes.index(axis)
        size = value.shape[dim]
        sel = torch.zeros(size, dtype=torch.bool, device=value.device)
        if isinstance(pick, tuple):
            if pick[0] >= size:
                raise EditError(f"{axis} range {pick[0]}:{pick[1]} is out of range: {axis} 0..{size - 1} exist")
            sel[pick[0] : min(pick[1], size)] = True
        else:
            wrong = [p for p in pick if p >= size]
            if wrong:
                raise EditError(
                    f"{axis} {limits.shown(wrong[:8])} out of range: this point has {size} ({axis} 0..{size - 1})"
                )
            sel[pick] = True
        shape = [1] * value.dim()
        shape[dim] = size
        sel = sel.view(shape)
        mask = sel if mask is None else mask & sel
    return mask


def _layers_with(config: Any, point: str) -> list[int]:
    names = set(hook_points(config))
    return [i for i in range(config.num_hidden_layers) if HookNames.block(i, point) in names]


def _check_layer(config: Any, layer: int | None, point: str, what: str) -> list[int]:
    """The layers an edit applies to (None: every layer with the point); EditError names the valid ones."""
    having = _layers_with(config, point)
    if not having:
        raise EditError(f"this model has no {what} layer (no hook point {point!r})")
    if layer is None:
        return having
    if layer not in having:
        raise EditError(f"layer {layer} has no {what} (hook point {point!r}); layers with it: {having}")
    return [layer]


@dataclass
class ValueEdit(_Edit):
    """zero / scale / replace / add at a hook point. ``point``: a name without the ``blocks.i.`` prefix
    ("mixer_out", "kda.g", "embed", "logits") or a full name ("blocks.3.kda.g"); ``layers``: None for
    every layer with the point; ``value``: the factor (scale) or a number / vector over the last axis
    (replace, add); ``tokens``: [start, stop) on the token axis (the key axis for MLA k and v)."""

    kind: ClassVar[str] = "value"
    OPS: ClassVar[tuple[str, ...]] = ("zero", "scale", "replace", "add")
    point: str = "mixer_out"
    op: str = "zero"
    value: float | list[float] | None = None
    layers: list[int] | None = None
    tokens: Range = None
    heads: list[int] | None = None
    channels: list[int] | None = None

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise EditError(f"value edit op must be one of {self.OPS}, got {limits.shown(self.op)}")
        if self.op != "zero" and self.value is None:
            raise EditError(f"value edit {limits.shown(self.op)} needs a value")
        self.tokens = _range(self.tokens, "tokens")
        self.layers, self.heads, self.channels = (
            _ints(self.layers, "layers"),
            _ints(self.heads, "heads"),
            _ints(self.channels, "channels"),
        )

    def names(self, config: Any) -> list[str]:
        available = hook_points(config)
        if self.point in available:
            return [self.point]
        local = HookNames.point_of(self.point)
        if local not in POINT_AXES or self.point.startswith("blocks.") and self.point not in available:
            points = sorted({HookNames.point_of(n) for n in available})
            raise EditError(f"unknown hook point {limits.shown(self.point)}; this model has: {', '.join(points)}")
        layers = _layers_with(config, local)
        if not layers:
            raise EditError(f"hook point {limits.shown(local)} is not in this model (residual {config.residual!r})")
        if self.layers is None:
            return [HookNames.block(i, local) for i in layers]
        wrong = [i for i in self.layers if i not in layers]
        if wrong:
            raise EditError(
                f"layers {limits.shown(wrong)} have no hook point {limits.shown(local)}; layers with it: {layers}"
            )
        return [HookNames.block(i, local) for i in self.layers]

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:
        out = []
        for name in self.names(config):
            axes = POINT_AXES[HookNames.point_of(name)]
            picks: dict[str, Any] = {}
            # MLA k and v have a key (token) axis; a KDA state's "key" axis is channels, not tokens
            token_axis = "token" if "token" in axes else "key" if ".mla." in name and "key" in axes else None
            for what, axis_options in (
                ("tokens", (token_axis,)),
                ("heads", ("head",)),
                ("channels", ("channel", "hidden", "latent", "expert", "vocab", "source", "value")),
            ):
                pick = getattr(self, what)
                if pick is None:
                    continue
                axis = next((a for a in axis_options if a in axes), None)
                if axis is None:
                    raise EditError(f"{what} cannot be picked at {name!r} (axes {axes})")
                picks[axis] = pick
            out.append((name, self._hook(axes, picks)))
        return out

    def _hook(self, axes: tuple[str, ...], picks: dict[str, Any]) -> Callable:
        def hook(value: torch.Tensor, name: str, info: dict) -> torch.Tensor:
            if self.op == "scale":
                new = value * self.value
            elif self.op == "zero":
                new = torch.zeros_like(value)
            else:
                vec = torch.as_tensor(self.value, dtype=value.dtype, device=value.device)
                if vec.dim() == 1 and vec.shape[0] != value.shape[-1]:
                    raise EditError(f"{name}: the vector has {vec.shape[0]} numbers, the last axis {value.shape[-1]}")
                new = value + vec if self.op == "add" else vec.expand_as(value).clone()
            mask = _mask_along(value, axes, picks)
            return new if mask is None else torch.where(mask, new, value)

        return hook


@dataclass
class AttnResEdit(_Edit):
    """Depth weights of an AttnRes site ("3.attn", "3.mlp", "output"): ``mode`` "uniform", "one_hot"
    (on ``sources[0]``) or "mask" (``sources`` get weight 0, the others are renormalised). Sources by
    index (negative from the end) or by name."""

    kind: ClassVar[str] = "attnres"
    MODES: ClassVar[tuple[str, ...]] = ("uniform", "one_hot", "mask")
    site: str = "output"
    mode: str = "uniform"
    sources: list[int | str] = field(default_factory=list)
    tokens: Range = None

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise EditError(f"AttnRes edit mode must be one of {self.MODES}, got {limits.shown(self.mode)}")
        if self.mode != "uniform" and not self.sources:
            raise EditError(f"AttnRes {self.mode} needs sources (indices or names)")
        if self.mode == "one_hot" and len(self.sources) != 1:
            raise EditError(f"AttnRes one_hot takes exactly one source, got {limits.shown(self.sources)}")
        self.sources = list(self.sources)
        self.tokens = _range(self.tokens, "tokens")

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:
        if not config.uses_attnres:
            raise EditError(f"AttnRes edits need an AttnRes model; this one's residual is {config.residual!r}")
        available = hook_points(config)
        try:
            name = HookNames.attnres_point(self.site, "weights")
        except ValueError as exc:
            raise EditError(str(exc)) from None
        if name not in available:
            sites = [HookNames.OUTPUT_SITE] + [
                f"{n.split('.')[1]}.{n.split('.')[2].split('_')[0]}"
                for n in available
                if n.endswith("_res.weights") and n.startswith("blocks.")
            ]
            raise EditError(f"no AttnRes site {limits.shown(self.site)}; sites: {', '.join(sorted(sites))}")
        return [(name, self._hook)]

    def _indices(self, names: list[str]) -> list[int]:
        out = []
        for s in self.sources:
            if isinstance(s, str) and not s.lstrip("-").isdigit():
                if s not in names:
                    raise EditError(f"site {self.site}: no source {limits.shown(s)}; sources: {names}")
                out.append(names.index(s))
            else:
                j = int(s)
                if not -len(names) <= j < len(names):
                    raise EditError(f"site {self.site}: source {j} out of range; sources: {names}")
                out.append(j % len(names))
        return out

    def _hook(self, value: torch.Tensor, name: str, info: dict) -> torch.Tensor:
        n = value.shape[-1]
        if self.mode == "uniform":
            new = torch.full_like(value, 1.0 / n)
        else:
            picked = torch.zeros(n, dtype=torch.bool, device=value.device)
            picked[self._indices([source_label(s) for s in info["sources"]])] = True
            if self.mode == "one_hot":
                new = picked.to(value.dtype).expand_as(value).clone()
            else:
                if bool(picked.all()):
                    raise EditError(f"site {self.site}: masking every source leaves nothing to mix")
                kept = value.masked_fill(picked, 0.0)
                new = kept / kept.sum(-1, keepdim=True)
        mask = _mask_along(value, POINT_AXES["attn_res.weights"], {"token": self.tokens} if self.tokens else {})
        return new if mask is None else torch.where(mask, new, value)


@dataclass
class KDAEdit(_Edit):
    """A KDA layer's gates and state: ``op`` "pin_g" (g := value), "scale_g" (g *= value: forget faster
    for value > 1), "scale_beta" (beta *= value), "reset_state" (the state is forgotten before each token
    of ``tokens``: alpha := 0 there), "gate_off" (output gate := 1), "reset_chunk_state" (the state at the
    end of each chunk of ``chunks`` := 0: the next chunk starts with an empty memory) and
    "scale_chunk_state" (that state *= value), both on the ``kda.chunk_state`` hook point (chunk n ends
    after token min((n + 1) C, T) of the forward, C = kda_chunk_size; a decoding step with a cache is
    chunk 0 of its own forward). ``layer`` None: every KDA layer; ``heads`` None: every head."""

    kind: ClassVar[str] = "kda"
    OPS: ClassVar[tuple[str, ...]] = (
        "pin_g", "scale_g", "scale_beta", "reset_state", "gate_off", "reset_chunk_state", "scale_chunk_state"
    )  # fmt: skip
    op: str = "gate_off"
    layer: int | None = None
    value: float | None = None
    tokens: Range = None
    heads: list[int] | None = None
    chunks: list[int] | None = None

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise EditError(f"KDA edit op must be one of {self.OPS}, got {limits.shown(self.op)}")
        if self.op in ("pin_g", "scale_g", "scale_beta", "scale_chunk_state") and self.value is None:
            raise EditError(f"KDA {self.op} needs a value")
        if self.op == "pin_g" and self.value > 0:
            raise EditError(f"the log decay g must be <= 0, got {self.value}")
        self.tokens = _range(self.tokens, "tokens")
        if self.op == "reset_state" and self.tokens is None:
            raise EditError("KDA reset_state needs the position(s) (tokens) before which the state is forgotten")
        self.heads = _ints(self.heads, "heads")
        self.chunks = _ints(self.chunks, "chunks")
        on_chunks = self.op in ("reset_chunk_state", "scale_chunk_state")
        if on_chunks and not self.chunks:
            raise EditError(f"KDA {self.op} needs chunks (indices 0, 1, ... of the chunks whose end state it edits)")
        if on_chunks and min(self.chunks) < 0:
            raise EditError(f"KDA chunks are numbered from 0, got {limits.shown(self.chunks)}")
        if on_chunks and self.tokens is not None:
            raise EditError(f"KDA {self.op} picks chunks, not tokens")
        if not on_chunks and self.chunks is not None:
            raise EditError(f"KDA {self.op} takes no chunks (only reset_chunk_state and scale_chunk_state do)")

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:
        if self.heads and max(self.heads) >= config.kda_num_heads:
            raise EditError(f"KDA heads are 0..{config.kda_num_heads - 1}, got {limits.shown(self.heads)}")
        if self.chunks is not None:
            layers = _check_layer(config, self.layer, "kda.chunk_state", "KDA")
            return [(HookNames.block(i, "kda.chunk_state"), self._chunk_state_hook) for i in layers]
        point, op, value = {
            "pin_g": ("kda.g", "replace", self.value),
            "scale_g": ("kda.g", "scale", self.value),
            "scale_beta": ("kda.beta", "scale", self.value),
            "reset_state": ("kda.g", "replace", RESET_G),
            "gate_off": ("kda.gate", "replace", 1.0),
        }[self.op]
        layers = _check_layer(config, self.layer, point, "KDA")
        return ValueEdit(point, op, value, layers=layers, tokens=self.tokens, heads=self.heads).hooks(config)

    def _chunk_state_hook(self, state: torch.Tensor, name: str, info: dict) -> torch.Tensor | None:
        if info["chunk"] == 0:  # every forward passes chunk 0 first: check the indices against this one
            missing = [c for c in self.chunks if c >= info["chunks"]]
            if missing:
                ends = [min((n + 1) * info["chunk_size"], info["length"]) for n in range(info["chunks"])]
                shown = ", ".join(f"{n} (ends at token {e})" for n, e in list(enumerate(ends))[:16])
                more = f", ... {len(ends) - 16} more" if len(ends) > 16 else ""
                raise EditError(f"{name}: no chunk {limits.shown(missing)} in this forward; chunks: {shown}{more}")
        if info["chunk"] not in self.chunks:
            return None
        new = torch.zeros_like(state) if self.op == "reset_chunk_state" else state * self.value
        mask = _mask_along(state, POINT_AXES["kda.chunk_state"], {"head": self.heads} if self.heads else {})
        return new if mask is None else torch.where(mask, new, state)


@dataclass
class MoEEdit(_Edit):
    """Routing of an MoE layer (``layer`` None: every MoE layer): ``op`` "ban" (``experts`` never
    selected), "force" (always selected; at most k of them), "uniform" (the chosen experts weighted
    equally), "bias_off" (selection bias := 0), "shared_off" (shared experts' output := 0)."""

    kind: ClassVar[str] = "moe"
    OPS: ClassVar[tuple[str, ...]] = ("ban", "force", "uniform", "bias_off", "shared_off")
    op: str = "ban"
    layer: int | None = None
    experts: list[int] = field(default_factory=list)
    tokens: Range = None

    def __post_init__(self) -> None:
        if self.op not in self.OPS:
            raise EditError(f"MoE edit op must be one of {self.OPS}, got {limits.shown(self.op)}")
        self.experts = _ints(self.experts, "experts") or []
        if self.op in ("ban", "force") and not self.experts:
            raise EditError(f"MoE {self.op} needs experts")
        self.tokens = _range(self.tokens, "tokens")

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:
        E, k = config.num_experts, config.num_experts_per_token
        bad = [e for e in self.experts if not 0 <= e < E]
        if bad:
            raise EditError(f"experts {limits.shown(bad)} do not exist; this model has experts 0..{E - 1}")
        if self.op == "force" and len(self.experts) > k:
            raise EditError(f"can force at most k = {k} experts, got {len(self.experts)}")
        if self.op == "ban" and E - len(set(self.experts)) < k:
            raise EditError(f"banning {len(set(self.experts))} of {E} experts leaves fewer than k = {k}")
        if self.op == "shared_off":
            layers = _check_layer(config, self.layer, "moe.shared_out", "shared experts")
            return ValueEdit("moe.shared_out", "zero", layers=layers, tokens=self.tokens).hooks(config)
        layers = _check_layer(config, self.layer, "moe.selection", "MoE")
        if self.op == "bias_off":
            return [(HookNames.block(i, "moe.selection_bias"), lambda v, n, info: torch.zeros_like(v)) for i in layers]
        if self.op == "uniform":
            weight = config.routed_scaling_factor / k
            return ValueEdit("moe.weights", "replace", weight, layers=layers, tokens=self.tokens).hooks(config)
        fill = float("-inf") if self.op == "ban" else float("inf")
        return ValueEdit(
            "moe.selection", "replace", fill, layers=layers, tokens=self.tokens, channels=self.experts
        ).hooks(config)


@dataclass
class MLAEdit(_Edit):
    """Mask keys [start, stop) of an MLA layer (``layer`` None: every MLA layer), for every query or the
    ``queries`` range, every head or ``heads``: those keys get no attention (the rest renormalised)."""

    kind: ClassVar[str] = "mla"
    op: str = "mask_keys"
    layer: int | None = None
    keys: Range = (0, 1)
    queries: Range = None
    heads: list[int] | None = None

    def __post_init__(self) -> None:
        if self.op != "mask_keys":
            raise EditError(f"MLA edit op must be 'mask_keys', got {limits.shown(self.op)}")
        self.keys = _range(self.keys, "keys")
        self.queries = _range(self.queries, "queries")
        self.heads = _ints(self.heads, "heads")

    def hooks(self, config: Any) -> list[tuple[str, Callable]]:
        layers = _check_layer(config, self.layer, "mla.key_mask", "MLA")
        H = config.num_attention_heads
        if self.heads and max(self.heads) >= H:
            raise EditError(f"MLA heads are 0..{H - 1}, got {limits.shown(self.heads)}")

        def hook(rows: torch.Tensor, name: str, info: dict) -> torch.Tensor:
            """The visible keys of queries [start, stop) of the forward ([n, S]; [H, n, S] for some heads)."""
            hidden = torch.zeros_like(rows)
            hidden[..., self.keys[0] : self.keys[1]] = True
            if self.queries is not None:
                query = torch.arange(info["start"], info["stop"], device=rows.device)[:, None]
                hidden &= (query >= self.queries[0]) & (query < self.queries[1])
            if self.heads is None:
                return rows & ~hidden
            per_head = torch.zeros(H, 1, 1, dtype=torch.bool, device=rows.device)
            per_head[self.heads] = True
            return rows & ~(hidden & per_head)  # [H, n, S]

        return [(HookNames.block(i, "mla.key_mask"), hook) for i in layers]


EDIT_KINDS: dict[str, type[_Edit]] = {cls.kind: cls for cls in (ValueEdit, AttnResEdit, KDAEdit, MoEEdit, MLAEdit)}
Edit = ValueEdit | AttnResEdit | KDAEdit | MoEEdit | MLAEdit
