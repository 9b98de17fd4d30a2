"""A checkpoint folder read from its headers first, then tensor by tensor.

``CheckpointFiles.open(path)`` reads only ``config.json``, the shard index and each safetensors
header (8 bytes of length + a JSON table of dtype, shape and byte offsets), so it answers for a
5 TB checkpoint in milliseconds. ``read(name)`` then reads exactly that tensor's bytes. The model
loader streams through it, the weight-only views read a few small tensors through it, and the
app's cache key comes from ``folder_fingerprint`` (headers, sizes, modification times) without hashing
terabytes.

Published checkpoints spell the same tensor in several ways; the variants are data, in
``k3core.loading.names.NAME_TABLE``, and every reader in k3lab goes through ``canonical_name``:

- the Kimi K3 repo is multimodal: the text model sits under ``language_model.``, beside
  ``vision_tower.*`` / ``mm_projector.*`` tensors that are not part of it (skipped and listed);
- transformers' ``KimiLinearForCausalLM.save_pretrained`` writes the dense first layer's MLP as
  ``block_sparse_moe.{gate,up,down}_proj`` where the original layout says ``mlp.``.

Pickle files (``pytorch_model.bin`` and friends) have no header; they are read whole, and only when
``torch.load(weights_only=True)`` accepts them (k3lab never unpickles arbitrary objects).

This module is the folder and its table; the parts live beside it:
``k3core.loading.safetensors_header`` (reading and checking a header, byte spans, sparse-file holes),
``k3core.loading.names`` (the name table, the keep-fp32 and parameter-count rules) and
``k3core.loading.pickle_weights`` (the safe pickle reader).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..modeling.config import ConfigError, K3Config
from ..modeling.hf_config import config_from_hf, is_hf_config
from ..utils.files import open_for_reading, parse_json, read_bytes_limited
from .names import canonical_name
from .pickle_weights import read_pickle_weights_only
from .safetensors_header import MAX_HEADER_BYTES, is_hole, read_safetensors_header, read_span
from .tensor_info import DTYPES, CheckpointError, TensorInfo, stored_dtype_name

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "PICKLE_NAMES",
    "PICKLE_SUFFIXES",
    "TOKENIZER_FILES",
    "WEIGHTS_NAME",
    "CheckpointFiles",
    "config_from_json",
    "folder_fingerprint",
    "read_config",
    "read_quantization_config",
    "weight_files",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.bin", "pytorch_model.pt")
PICKLE_SUFFIXES = (".pt", ".bin", ".pth", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "tokenizer.model")
MAX_CONFIG_BYTES = 16 * 1024**2  # config.json (Kimi K3's: 5 KB)
MAX_INDEX_BYTES = 256 * 1024**2  # the shard index (one line per tensor name)


def read_quantization_config(folder: Path) -> dict | None:
    """config.json's ``quantization_config`` (inside ``text_config`` in the Kimi K3 repo), or None."""
    try:
        data = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    quant = data.get("quantization_config") or text.get("quantization_config")
    return quant if quant else None


def config_from_json(data: Any) -> K3Config:
    """A parsed config.json as a K3Config: a Hugging Face Kimi K3 / Kimi Linear one, or k3lab's own."""
    return config_from_hf(data) if is_hf_config(data) else K3Config.from_dict(data)


def read_config(folder: Path) -> K3Config:
    """The K3Config of a checkpoint folder's config.json (k3lab's own or a Hugging Face one)."""
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{folder.name}: config.json is missing (a checkpoint is a folder with config.json and model.safetensors)"
        )
    try:
        raw = read_bytes_limited(cfg_path, MAX_CONFIG_BYTES)
    except ValueError as exc:
        raise CheckpointError(f"{folder.name}/{exc}") from exc
    data = parse_json(raw, f"{folder.name}/config.json", CheckpointError)
    try:
        return config_from_json(data)
    except (ConfigError, KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"{folder.name}/config.json: invalid config: {str(exc)[:300]}") from exc


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, model.safetensors, any *.safetensors, or a pickle."""
    if path.is_file():
        return [path]
    if (path / INDEX_NAME).is_file():
        try:
            index = parse_json(read_bytes_limited(path / INDEX_NAME, MAX_INDEX_BYTES), INDEX_NAME)
            names = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path.name}/{INDEX_NAME}: invalid shard index ({str(exc)[:300]})") from exc
        if not all(isinstance(n, str) and "/" not in n and "\\" not in n and n not in ("", ".", "..") for n in names):
            raise CheckpointError(f"{path.name}/{INDEX_NAME}: shard names must be plain file names in the folder")
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path.name}: shard files listed in the index are missing: {missing[:8]}")
        return files
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    pickles = [path / n for n in PICKLE_NAMES if (path / n).is_file()]
    if pickles:
        return pickles[:1]
    gguf = sorted(p.name for p in path.glob("*.gguf"))
    if gguf:
        raise CheckpointError(
            f"{path.name}: GGUF files ({', '.join(gguf[:3])}) are a llama.cpp format k3lab does not read; it reads "
            f"safetensors checkpoints (unquantised or compressed-tensors)"
        )
    raise CheckpointError(f"{path.name}: no weights found (expected {WEIGHTS_NAME} or {INDEX_NAME})")


@dataclass
class CheckpointFiles:
    """A checkpoint folder's table of tensors (canonical name -> TensorInfo), read from headers only."""

    folder: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    skipped: list[str] = field(default_factory=list)  # stored names that are not part of the text model
    config: K3Config | None = None
    metadata: dict[str, dict] = field(default_factory=dict)  # per-file __metadata__
    bytes_read: int = 0
    quantization: dict | None = None  # config.json's quantization_config (top level or in text_config)
    foreign_quantised: dict[str, list[TensorInfo]] = field(default_factory=dict)  # format -> undecodable tensors
    _pickled: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path, require_config: bool = True) -> CheckpointFiles:
        """Read config.json (when ``require_config`` or present), the index and every header. Raises CheckpointError."""
        # Kimi K3 has 497k stored tensors: a million small objects without reference cycles, which the cyclic
        # garbage collector would otherwise rescan again and again while they are built (about half the time).
        enabled = gc.isenabled()
        gc.disable()
        try:
            return cls._open(path, require_config)
        finally:
            if enabled:
                gc.enable()

    @classmethod
    def _open(cls, path: str | Path, require_config: bool) -> CheckpointFiles:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path.name or path}: no such checkpoint")
        folder = path if path.is_dir() else path.parent
        config = None
        if require_config or (folder / CONFIG_NAME).is_file():
            config = read_config(folder)
        files = weight_files(path)
        table: dict[str, TensorInfo] = {}
        skipped: list[str] = []
        metadata: dict[str, dict] = {}
        pickled: dict[str, torch.Tensor] = {}
        for file in files:
            if file.suffix in PICKLE_SUFFIXES:
                entries = {}
                for raw, tensor in read_pickle_weights_only(file).items():
                    dtype = stored_dtype_name(tensor.dtype)
                    entries[raw] = (dtype, tuple(tensor.shape), -1, -1)
                    pickled[raw] = tensor
            else:
                header, start = read_safetensors_header(file)
                meta = header.pop("__metadata__", None)
                if isinstance(meta, dict):
                    metadata[file.name] = meta
                entries = {
                    raw: (e["dtype"], tuple(e["shape"]), start + e["data_offsets"][0], start + e["data_offsets"][1])
                    for raw, e in header.items()
                }
            for raw, (dtype, shape, begin, end) in entries.items():
                name = canonical_name(raw)
                if name is None:
                    skipped.append(raw)
                    continue
                if name in table:
                    raise CheckpointError(
                        f"{folder.name}: tensor {name!r} is stored twice ({table[name].file.name}: "
                        f"{table[name].raw_name!r} and {file.name}: {raw!r})"
                    )
                table[name] = TensorInfo(name, raw, file, dtype, shape, begin, end)
        from .quantized import group_quantised

        quantization = read_quantization_config(folder)
        table, foreign = group_quantised(table, quantization)
        out = cls(folder, files, table, sorted(skipped), config, metadata, quantization=quantization)
        out.foreign_quantised = foreign
        out._pickled = {name: t for raw, t in pickled.items() if (name := canonical_name(raw)) is not None}
        return out

    @property
    def bytes_total(self) -> int:
        """Declared bytes of the text model's tensors (headers only)."""
        return sum(t.nbytes for t in self.tensors.values()) + sum(
            t.numel() * t.element_size() for t in self._pickled.values()
        )

    def bytes_by_format(self) -> dict[str, int]:
        """Declared bytes per storage format (``MXFP4``, ``BF16``, ``F32``, ...), largest first."""
        out: dict[str, int] = {}
        for info in self.tensors.values():
            out[info.dtype] = out.get(info.dtype, 0) + info.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (canonical), reading only its own bytes; a CPU tensor of the stored dtype."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder.name}: no tensor {name!r} in this checkpoint")
        if name in self._pickled:
            return self._pickled[name]
        if info.parts:
            return self.read_quantised(info)
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{info.file.name}: tensor {info.raw_name!r} has dtype {info.dtype}, which k3lab cannot read"
            )
        expected = info.numel * torch.empty((), dtype=dtype).element_size()
        if expected != info.nbytes:
            raise CheckpointError(
                f"{info.file.name}: tensor {info.raw_name!r}: {info.nbytes} bytes stored for shape "
                f"{list(info.shape)} of {info.dtype} ({expected} expected)"
            )
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        with os.fdopen(open_for_reading(info.file), "rb") as fh:
            fh.seek(info.begin)
            data = bytearray(fh.read(info.nbytes))
        if len(data) != info.nbytes:
            raise CheckpointError(f"{info.file.name}: truncated while reading {info.raw_name!r}")
        self.bytes_read += info.nbytes
        return torch.frombuffer(data, dtype=dtype).reshape(info.shape)

    def read_quantised(
        self, info: TensorInfo, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """A quantised weight decoded to ``dtype`` on ``device`` (its parts read in one go when they lie
        back to back, the bytes moved to ``device`` before decoding)."""
        from .quantized import decode, read_parts

        def read(file: Path, begin: int, end: int, what: str) -> torch.Tensor:
            self.bytes_read += end - begin
            return read_span(file, begin, end, what)

        return decode(info, read_parts(info, read, device), dtype)

    def sum_squares(self, name: str) -> float | None:
        """sum(W^2) of an MXFP4 weight straight from its stored bytes (``quantized.mxfp4_sum_squares``: no
        decoded copy, exact in float64), or None for any other tensor (read it and sum)."""
        info = self.tensors.get(name)
        if info is None or info.dtype != "MXFP4":
            return None
        from .quantized import contiguous, mxfp4_sum_squares, read_parts

        if contiguous(info):
            with open(info.file, "rb", buffering=0) as fh:
                if info.end <= os.fstat(fh.fileno()).st_size and is_hole(fh.fileno(), info.begin, info.end):
                    self.bytes_read += info.nbytes
                    return 0.0  # a hole of a sparse file: zero bytes, zero values

        def read(file: Path, begin: int, end: int, what: str) -> torch.Tensor:
            self.bytes_read += end - begin
            return read_span(file, begin, end, what)

        parts = read_parts(info, read)
        return mxfp4_sum_squares(parts["weight_packed"], parts["weight_scale"])


def folder_fingerprint(path: Path) -> str:
    """SHA-256 over config, index, tokenizer files and each weight file's name, size, mtime and header.

    Weight files are not hashed byte by byte (terabytes); a pickle file, which has no header, is
    hashed whole (so two different ``pytorch_model.bin`` uploads never share a cache entry). Nothing is
    validated here: a broken checkpoint still gets a key, and its error when it is loaded."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    try:
        files = weight_files(path)
    except CheckpointError:
        files = (
            sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", *PICKLE_SUFFIXES))
            if folder.is_dir()
            else []
        )
    return _fingerprint(folder, files)


def _fingerprint(folder: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_NAME, INDEX_NAME, *TOKENIZER_FILES):
        file = folder / name
        if file.is_file():
            with os.fdopen(open_for_reading(file), "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    for file in files:
        if not file.is_file():
            continue
        with os.fdopen(open_for_reading(file), "rb") as fh:
            st = os.fstat(fh.fileno())
            h.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if file.suffix in PICKLE_SUFFIXES:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            else:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, MAX_HEADER_BYTES)))
    return h.hexdigest()
