"""The Trace data type and its names: what a recording produces, without the recorder.

``Trace`` holds plain numpy arrays by name, the axis names of each (``trace.axes``) and a JSON-able
``meta``; ``Trace.save`` / ``Trace.load`` write and read one .npz file (header as JSON, no pickles;
``TraceError`` for a missing, corrupt or foreign file; names an older version wrote are mapped by ``RENAMED``).
``TraceNames`` (alias ``names``) builds every array name in one place, in the hook points' namespace. The
arrays a recording holds and their axes are listed in ``k3core.interp.recorder``, the recorder (these are
imported from here: ``from k3core.interp.trace import Trace, names``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..modeling.hooks import HookNames
from ..utils.files import open_for_reading, parse_json
from .catalogue import POINTS
from .hidden_moments import MOMENT_AXES
from .kda_attention_stats import KDA_STATS
from .trace_npz import NpzLimits, TraceError, npz_layout, read_npz

MAX_HEADER_BYTES = 64 * 1024**2  # a trace's JSON header (meta + axes)


class TraceNames(HookNames):
    """Every trace array name, built in one place (``i`` is a 0-based layer index): the hook point names of the
    declarations (``k3core.interp.catalogue``) are the one namespace. An array holding a point's value is named
    after the point (``blocks.3.kda.g``, ``blocks.3.moe.experts``); a quantity derived from it is the point's name
    plus a suffix (``blocks.3.kda.g.bins``, ``blocks.3.moe.experts.load``). Whole-model items (``hidden``,
    ``position_bins``, ...) have plain names. Older traces' names are mapped on load (``RENAMED``).

    AttnRes sites are ``"{i}.attn"``, ``"{i}.mlp"`` (decoder layer ``i``) and ``"output"`` (the final mix); build
    them with ``attnres_site``.
    """

    TOKENS = POINTS["tokens"].name
    TOKEN_NLL = POINTS["token_nll"].name
    HIDDEN = "hidden"
    HIDDEN_RMS = "hidden_rms"
    POSITION_BINS = "position_bins"
    #: ``trace.meta`` key: {site: [source name per position of the site's source axis]}
    ATTNRES_SOURCES_META = "attnres_sources"

    @staticmethod
    def _at(point: str, i: int, suffix: str = "") -> str:
        return POINTS[point].at(i) + (f".{suffix}" if suffix else "")

    @staticmethod
    def kda_g(i: int) -> str:
        return TraceNames._at("kda.g", i)

    @staticmethod
    def kda_g_bins(i: int) -> str:
        """Mean log decay per position bin."""
        return TraceNames._at("kda.g", i, "bins")

    @staticmethod
    def kda_beta(i: int) -> str:
        return TraceNames._at("kda.beta", i)

    @staticmethod
    def kda_gate(i: int) -> str:
        """Output-gate mean over channels."""
        return TraceNames._at("kda.gate", i, "mean")

    @staticmethod
    def kda_state_norm(i: int) -> str:
        return TraceNames._at("kda.chunk_state", i, "norm")

    @staticmethod
    def kda_state_rank(i: int) -> str:
        return TraceNames._at("kda.chunk_state", i, "rank")

    @staticmethod
    def kda_state_steps(i: int) -> str:
        """The token position of each chunk-end state."""
        return TraceNames._at("kda.chunk_state", i, "token")

    @staticmethod
    def kda_final_state(i: int) -> str:
        return TraceNames._at("kda.state", i)

    @staticmethod
    def kda_attn(i: int) -> str:
        """KDA's implicit attention map of the query window (signed A; ``k3core.ops.kda.implicit_attention``)."""
        return TraceNames.block(i, "kda.attn")

    @staticmethod
    def kda_attn_stat(i: int, kind: str) -> str:
        """KDA implicit-attention statistics of layer ``i``: "entropy" | "sink" | "received" | "negative" | "row_sum" |
        "half_distance" ([batch, head, token]; ``k3core.interp.kda_attention_stats``), "distance" ([batch, head, bin,
        distance]), "distance_edges" ([edge]) or "before" ([batch, head, query]: each window query's signed mass
        before the window)."""
        if kind not in (*KDA_STATS, "distance", "distance_edges", "before"):
            raise ValueError(f"KDA attention statistic {kind!r} is not one of {KDA_STATS} or distance|before")
        return f"{TraceNames.kda_attn(i)}.{kind}"

    @staticmethod
    def mla_attn(i: int) -> str:
        """The attention map of a query window (computed from the layer's q and k)."""
        return TraceNames.block(i, "mla.attn")

    @staticmethod
    def mla_stat(i: int, kind: str) -> str:
        """Blocked attention statistics of MLA layer ``i`` over every position: kind "entropy" | "sink" |
        "received" ([batch, head, token]; ``k3core.interp.attention_stats``)."""
        if kind not in ("entropy", "sink", "received"):
            raise ValueError(f"MLA statistic must be entropy|sink|received, got {kind!r}")
        return f"{TraceNames.mla_attn(i)}.{kind}"

    @staticmethod
    def mla_gate(i: int) -> str:
        """Output-gate mean over channels."""
        return TraceNames._at("mla.gate", i, "mean")

    @staticmethod
    def hidden_bins(kind: str) -> str:
        """Whole-text moments of the hidden states per position bin: count, sum, unit_sum, gram, cross_gram,
        cos_sum; above a width sq_sum, sketch_sum, sketch_gram, sketch_cross_gram in place of the Gram matrices
        (``k3core.interp.hidden_moments``)."""
        if kind != "count" and kind not in MOMENT_AXES:
            raise ValueError(f"unknown hidden-state moment {kind!r}")
        return f"hidden_bins.{kind}"

    @staticmethod
    def attnres(site: str) -> str:
        """Depth weights [batch, token, source] at a site ("0.attn", "0.mlp", ..., "output")."""
        return HookNames.attnres_point(site, "weights")

    @staticmethod
    def attnres_query_norm(site: str) -> str:
        return HookNames.attnres_point(site, "query_norm")

    @staticmethod
    def attnres_site_of(name: str) -> str | None:
        """The site of a depth-weight array name ("blocks.3.mlp_res.weights" -> "3.mlp"); None for other names
        (query norms included)."""
        return HookNames.site_of(name) if name.endswith("_res.weights") else None

    @staticmethod
    def residual(i: int, side: str, kind: str) -> str:
        """Scale/bias residual parameter of layer ``i``: side "attn"|"mlp", kind "scale"|"bias"."""
        if side not in ("attn", "mlp") or kind not in ("scale", "bias"):
            raise ValueError(f"residual side/kind must be attn|mlp and scale|bias, got {side!r}, {kind!r}")
        return HookNames.attnres_point(HookNames.attnres_site(i, side), kind)

    @staticmethod
    def moe_scores(i: int) -> str:
        return TraceNames._at("moe.scores", i)

    @staticmethod
    def moe_experts(i: int) -> str:
        return TraceNames._at("moe.experts", i)

    @staticmethod
    def moe_weights(i: int) -> str:
        return TraceNames._at("moe.weights", i)

    @staticmethod
    def moe_latent(i: int) -> str:
        return TraceNames._at("moe.latent", i)

    @staticmethod
    def moe_load(i: int) -> str:
        """Assignments per expert over the whole batch."""
        return TraceNames._at("moe.experts", i, "load")

    @staticmethod
    def moe_bias(i: int) -> str:
        return TraceNames._at("moe.selection_bias", i)


#: The names traces written before the hook-point namespace used (``kda.3.g``, ``attnres.3.mlp``, ...), as
#: (pattern, replacement) pairs; ``Trace.load`` renames them, so older trace files and folders still open.
RENAMED: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"^kda\.(\d+)\.g$", r"blocks.\1.kda.g"),
        (r"^kda\.(\d+)\.g_bins$", r"blocks.\1.kda.g.bins"),
        (r"^kda\.(\d+)\.beta$", r"blocks.\1.kda.beta"),
        (r"^kda\.(\d+)\.gate$", r"blocks.\1.kda.gate.mean"),
        (r"^kda\.(\d+)\.state_norm$", r"blocks.\1.kda.chunk_state.norm"),
        (r"^kda\.(\d+)\.state_rank$", r"blocks.\1.kda.chunk_state.rank"),
        (r"^kda\.(\d+)\.state_steps$", r"blocks.\1.kda.chunk_state.token"),
        (r"^kda\.(\d+)\.final_state$", r"blocks.\1.kda.state"),
        (r"^mla\.(\d+)\.attn$", r"blocks.\1.mla.attn"),
        (r"^mla\.(\d+)\.(entropy|sink|received)$", r"blocks.\1.mla.attn.\2"),
        (r"^mla\.(\d+)\.gate$", r"blocks.\1.mla.gate.mean"),
        (r"^attnres\.(\d+)\.(attn|mlp)$", r"blocks.\1.\2_res.weights"),
        (r"^attnres\.(\d+)\.(attn|mlp)_query_norm$", r"blocks.\1.\2_res.query_norm"),
        (r"^attnres\.output$", r"output_res.weights"),
        (r"^attnres\.output_query_norm$", r"output_res.query_norm"),
        (r"^residual\.(\d+)\.(attn|mlp)_(scale|bias)$", r"blocks.\1.\2_res.\3"),
        (r"^moe\.(\d+)\.(scores|experts|weights|latent)$", r"blocks.\1.moe.\2"),
        (r"^moe\.(\d+)\.load$", r"blocks.\1.moe.experts.load"),
        (r"^moe\.(\d+)\.bias$", r"blocks.\1.moe.selection_bias"),
    )
)


def current_name(name: str) -> str:
    """A trace array name in today's namespace: an older name (``RENAMED``) mapped, any other unchanged."""
    for pattern, replacement in RENAMED:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name


names = TraceNames


@dataclass(frozen=True)
class TraceLayout:
    """A trace file's arrays as declared, before any is inflated (``Trace.layout``): axes and shape by (current)
    name, and ``nbytes``, the bytes its members inflate to (what reading the file allocates)."""

    axes: dict[str, tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    nbytes: int


def _header_of(header_bytes: np.ndarray | None, where: str) -> tuple[dict, dict]:
    """(axes, meta) of a trace's JSON header array; TraceError when it is missing, too large or foreign."""
    if header_bytes is None or header_bytes.dtype != np.uint8 or header_bytes.ndim != 1:
        raise TraceError(f"{where}: not a k3lab trace (no header)")
    if header_bytes.size > MAX_HEADER_BYTES:
        raise TraceError(f"{where}: its header is {header_bytes.size:,} bytes, over {MAX_HEADER_BYTES:,}")
    header = parse_json(header_bytes.tobytes(), f"{where}: header", error=TraceError)
    if not isinstance(header, dict) or header.get("format") != "k3lab-trace/1":
        fmt = header.get("format") if isinstance(header, dict) else None
        raise TraceError(f"{where}: unknown trace format {fmt!r}")
    axes, meta = header.get("axes"), header.get("meta")
    if not isinstance(axes, dict) or not isinstance(meta, dict):
        raise TraceError(f"{where}: corrupt trace header (axes do not match the stored arrays)")
    return axes, meta


def _check_axes(axes: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """TraceError unless every stored array has a list of axis names, one per dimension of its shape."""
    if set(axes) != set(shapes):
        raise TraceError(f"{where}: corrupt trace header (axes do not match the stored arrays)")
    for name, axis_names in axes.items():
        if (
            not isinstance(axis_names, list)
            or len(axis_names) != len(shapes[name])
            or not all(isinstance(a, str) for a in axis_names)
        ):
            raise TraceError(f"{where}: array {name[:80]!r}: its axes {str(axis_names)[:80]} do not fit its shape")


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
        """Layers with data of a kind ("kda", "mla", "moe"; "attnres": either AttnRes site): ``blocks.<i>.<kind>.*``
        arrays, in depth order."""
        kinds = ("attn_res", "mlp_res") if kind == "attnres" else (kind,)
        found = set()
        for name in self.arrays:
            parts = name.split(".")
            if len(parts) > 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in kinds:
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
    def load(cls, source: str | Path | BinaryIO, limits: NpzLimits | None = None, where: str | None = None) -> Trace:
        """A trace from a path (opened through ``k3core.utils.files.open_for_reading``: a server's descriptor checks
        apply) or an open binary file, its arrays read within ``limits`` (``k3core.interp.trace_npz``). Raises
        TraceError."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            try:
                fd = open_for_reading(path)
            except FileNotFoundError as exc:
                raise TraceError(f"{path}: no such trace file") from exc
            except OSError as exc:
                raise TraceError(f"{path}: cannot open the trace file ({exc.strerror})") from exc
            with os.fdopen(fd, "rb") as fh:
                if not fh.seekable():
                    raise TraceError(f"{path}: not a regular file")
                return cls.load(fh, limits, where or str(path))
        where = where or "trace"
        stored = read_npz(source, where, limits)
        axes, meta = _header_of(stored.pop("__header__", None), where)
        arrays = {k[2:]: v for k, v in stored.items() if k.startswith("a/")}
        _check_axes(axes, {name: array.shape for name, array in arrays.items()}, where)
        return cls._renamed(arrays, {k: tuple(v) for k, v in axes.items()}, meta)

    @staticmethod
    def layout(fh: BinaryIO, limits: NpzLimits | None = None, where: str = "trace") -> TraceLayout:
        """What ``Trace.load(fh)`` would hold, from the zip directory, the .npy headers and the trace's JSON header
        alone (no array inflated): each array's axes and shape (current names) and the bytes the arrays inflate to.
        Raises TraceError as ``load`` does; ``fh`` is left at its start."""
        found = npz_layout(fh, where, limits)
        header_shape = found.shapes.get("__header__")
        if header_shape is not None and len(header_shape) == 1 and header_shape[0] > MAX_HEADER_BYTES:
            raise TraceError(f"{where}: its header is {header_shape[0]:,} bytes, over {MAX_HEADER_BYTES:,}")
        try:
            stored = read_npz(fh, where, limits, only={"__header__"})
        finally:
            fh.seek(0)
        axes, _ = _header_of(stored.get("__header__"), where)
        shapes = {k[2:]: v for k, v in found.shapes.items() if k.startswith("a/")}
        _check_axes(axes, shapes, where)
        return TraceLayout(
            axes={current_name(k): tuple(v) for k, v in axes.items()},
            shapes={current_name(k): v for k, v in shapes.items()},
            nbytes=found.nbytes,
        )

    @classmethod
    def _renamed(cls, arrays: dict[str, np.ndarray], axes: dict[str, tuple[str, ...]], meta: dict[str, Any]) -> Trace:
        """A loaded trace with older array names (``RENAMED``) mapped, in its arrays, axes and coverage."""
        if not any(current_name(n) != n for n in arrays):
            return cls(arrays=arrays, axes=axes, meta=meta)
        coverage = meta.get("coverage")
        if isinstance(coverage, dict):
            meta = {**meta, "coverage": {current_name(k): v for k, v in coverage.items()}}
        return cls(
            arrays={current_name(k): v for k, v in arrays.items()},
            axes={current_name(k): v for k, v in axes.items()},
            meta=meta,
        )
