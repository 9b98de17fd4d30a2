"""The two things every checkpoint reader shares: where one stored tensor lies (``TensorInfo``), the dtypes of
the safetensors format (``DTYPES``), and the one error type (``CheckpointError``). Kept apart from
``checkpoint_files`` so that ``quantized`` (which ``checkpoint_files`` uses) can use them too."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """Anything a user can get wrong with a checkpoint. The message says what and where."""


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def stored_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (the inverse of ``DTYPES``; ``str(dtype)`` for one it lacks)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    return str(dtype)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``file`` bytes [begin, end) hold it (begin = end = -1 for pickle files).

    A quantised weight (k3core.loading.quantized) is one entry with its logical shape, ``dtype`` its storage
    format ("MXFP4", "INT4", "FP8", ...) and ``parts`` the stored tensors ((role, TensorInfo), ...);
    ``nbytes`` is then what is stored, [begin, end) the span of its parts in ``file``."""

    name: str
    raw_name: str
    file: Path
    dtype: str  # safetensors spelling: "BF16", "F32", ...; a storage format for quantised weights
    shape: tuple[int, ...]
    begin: int
    end: int
    parts: tuple = field(default=(), compare=False)

    @property
    def nbytes(self) -> int:
        if self.parts:
            return sum(p.nbytes for _, p in self.parts)
        return max(self.end - self.begin, 0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
