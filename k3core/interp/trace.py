"""The Trace data type and its names: what a recording produces, without the recorder.

``Trace`` holds plain numpy arrays by name, the axis names of each (``trace.axes``) and a JSON-able
``meta``; ``Trace.save`` / ``Trace.load`` write and read one .npz file (header as JSON, no pickles;
``TraceError`` for a missing, corrupt or foreign file). ``TraceNames`` (alias ``names``) builds every
array name in one place. The arrays a recording holds and their axes are listed in ``k3core.interp.recorder``,
the recorder (these are imported from here: ``from k3core.interp.trace import Trace, names``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..utils.files import open_for_reading, parse_json
from .hooks import HookNames
from .trace_npz import NpzLimits, TraceError, read_npz

MAX_HEADER_BYTES = 64 * 1024**2  # a trace's JSON header (meta + axes)


class TraceNames(HookNames):
    """Every trace array name, built in one place (``i`` is a 0-based layer index); the hook point
    names of ``k3core.interp.hooks.HookNames`` are part of it (``names.block(3, "kda.g")``).

    AttnRes sites are ``"{i}.attn"``, ``"{i}.mlp"`` (decoder layer ``i``) and ``"output"`` (the final
    mix); build them with ``attnres_site``. Use as ``from k3core.interp.recorder import names``.
    """

    TOKENS = "tokens"
    TOKEN_NLL = "token_nll"
    HIDDEN = "hidden"
    HIDDEN_RMS = "hidden_rms"
    POSITION_BINS = "position_bins"
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
    def mla_stat(i: int, kind: str) -> str:
        """Blocked attention statistics of MLA layer ``i`` over every position: kind "entropy" | "sink" |
        "received" ([batch, head, token]; ``k3core.interp.attention_stats``)."""
        if kind not in ("entropy", "sink", "received"):
            raise ValueError(f"MLA statistic must be entropy|sink|received, got {kind!r}")
        return f"mla.{i}.{kind}"

    @staticmethod
    def kda_state_rank(i: int) -> str:
        return f"kda.{i}.state_rank"

    @staticmethod
    def kda_g_bins(i: int) -> str:
        return f"kda.{i}.g_bins"

    @staticmethod
    def hidden_bins(kind: str) -> str:
        """Whole-text moments of the hidden states per position bin: count, sum, unit_sum, gram, cross_gram,
        cos_sum (``k3core.interp.recorder``)."""
        if kind not in ("count", "sum", "unit_sum", "gram", "cross_gram", "cos_sum"):
            raise ValueError(f"unknown hidden-state moment {kind!r}")
        return f"hidden_bins.{kind}"

    @staticmethod
    def mla_gate(i: int) -> str:
        return f"mla.{i}.gate"

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
        header_bytes = stored.pop("__header__", None)
        if header_bytes is None or header_bytes.dtype != np.uint8 or header_bytes.ndim != 1:
            raise TraceError(f"{where}: not a k3lab trace (no header)")
        if header_bytes.size > MAX_HEADER_BYTES:
            raise TraceError(f"{where}: its header is {header_bytes.size:,} bytes, over {MAX_HEADER_BYTES:,}")
        header = parse_json(header_bytes.tobytes(), f"{where}: header", error=TraceError)
        if not isinstance(header, dict) or header.get("format") != "k3lab-trace/1":
            fmt = header.get("format") if isinstance(header, dict) else None
            raise TraceError(f"{where}: unknown trace format {fmt!r}")
        arrays = {k[2:]: v for k, v in stored.items() if k.startswith("a/")}
        axes, meta = header.get("axes"), header.get("meta")
        if not isinstance(axes, dict) or not isinstance(meta, dict) or set(axes) != set(arrays):
            raise TraceError(f"{where}: corrupt trace header (axes do not match the stored arrays)")
        for name, names in axes.items():
            if (
                not isinstance(names, list)
                or len(names) != arrays[name].ndim
                or not all(isinstance(a, str) for a in names)
            ):
                raise TraceError(f"{where}: array {name[:80]!r}: its axes {str(names)[:80]} do not fit its shape")
        return cls(arrays=arrays, axes={k: tuple(v) for k, v in axes.items()}, meta=meta)
