"""Where the weight summary's tensors come from: a checkpoint folder opened header-only (``open_source``), or
a loaded model / dict of tensors (``StateDictSource``). Both offer ``tensors`` (name -> meta), ``read(name)``,
``bytes_read``, ``bytes_total``, ``config`` and ``skipped``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3core.loading.folder import CheckpointFiles
from k3core.loading.tensor_info import stored_dtype_name
from k3core.modeling.config import K3Config


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype (safetensors spelling: "BF16", "F32", ...), shape and byte size of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    numel: int


class OffloadedWeights(ValueError):
    """A loaded model's tensor holds no values here (meta device: offloaded to disk, or shapes only)."""


class StateDictSource:
    """A loaded model (or a plain dict of tensors) seen through the reader's interface: ``tensors``
    (name -> meta), ``read(name)``, ``bytes_read``, ``bytes_total``, ``config``, ``skipped``.

    A tied LM head is left out, as ``save_pretrained`` leaves it out of the files."""

    def __init__(self, state: Any, config: K3Config | None = None) -> None:
        if hasattr(state, "state_dict"):
            config = config if config is not None else getattr(state, "config", None)
            state = state.state_dict()
        self._state = dict(state)
        if config is not None and config.tie_word_embeddings:
            self._state.pop("lm_head.weight", None)
        self.config = config
        self.skipped: list[str] = []
        self.tensors = {
            k: TensorMeta(
                k,
                stored_dtype_name(v.dtype),
                tuple(v.shape),
                v.numel() * v.element_size(),
                v.numel(),
            )
            for k, v in self._state.items()
        }
        self.bytes_total = sum(m.nbytes for m in self.tensors.values())
        self.bytes_read = 0

    def read(self, name: str) -> Any:
        t = self._state[name].detach()
        if t.is_meta:
            raise OffloadedWeights(
                f"{name} has no values in memory (offloaded or shapes only): read the weights "
                f"from the checkpoint folder instead (read_weight_summary)"
            )
        self.bytes_read += self.tensors[name].nbytes
        return t.to("cpu")


def open_source(path: str | Path) -> Any:
    """A checkpoint folder (or one .safetensors file) opened header-only (``k3core.loading.folder``);
    config.json is read when present (without it the KDA gate form is unknown, everything else works).

    Raises ``k3core.loading.tensor_info.CheckpointError`` for anything wrong with it."""
    return CheckpointFiles.open(path, require_config=False)
