"""Quantised weights in a checkpoint: which stored tensors form one logical weight, and how to decode it.

The published Kimi K3 checkpoint is a compressed-tensors checkpoint: every routed expert matrix is
stored as two U8 tensors, ``<module>.weight_packed`` [out, in/2] and ``<module>.weight_scale``
[out, in/32] (``mxfp4-pack-quantized``), while everything else is BF16/F32. What is quantised is decided
by the suffixes present in the headers (the config's ``ignore`` regexes do not describe the router or the
latent projections, which are stored BF16 anyway); :func:`group_quantised` folds each set of parts into
one logical ``<module>.weight`` entry with its logical shape [out, in], so parameter counts, names and
shape checks see the model as it computes, and bytes are counted as stored.

Formats read (``STORAGE_FORMATS``):

- ``MXFP4`` (compressed-tensors ``mxfp4-pack-quantized``): decoded here (:func:`mxfp4_to_float`), on the
  device that computes: byte k of a row holds column 2k in its low nibble and 2k+1 in its high nibble;
  nibble bit 3 is the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}; scale byte s means 2^(s-127);
  W[o, i] = value(nibble) * 2^(S[o, i // 32] - 127). Every such product is exact in fp32 and bf16.
- ``INT<b>`` (``pack-quantized``, int32 words holding 32/b values, group/channel scales, optional packed
  zero points) and ``FP8`` / ``INT8`` (``float-quantized`` / ``naive-quantized``: the weight stored in
  the narrow dtype next to its scale): decoded by compressed-tensors' own decompressors (imported on
  first use), with quantisation arguments read off the stored shapes.

Anything else (NVFP4, GPTQ/AWQ, gpt-oss ``*_blocks``/``*_scales``, block FP8 ``weight_scale_inv``,
bitsandbytes, GGUF) is recognised and refused by :func:`check_quantised` naming format and tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from .tensor_info import DTYPES, CheckpointError, TensorInfo

# Suffixes of the stored parts of one compressed-tensors weight (role = the suffix without its dot).
PART_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_global_scale", ".weight_shape")
# Stored names of quantisation formats k3lab recognises but does not decode: suffix -> format.
FOREIGN_SUFFIXES = {
    ".qweight": "GPTQ/AWQ (qweight/qzeros/scales)",
    ".qzeros": "GPTQ/AWQ (qweight/qzeros/scales)",
    ".scales": "GPTQ/AWQ (qweight/qzeros/scales)",
    ".g_idx": "GPTQ/AWQ (qweight/qzeros/scales)",
    "_blocks": "MXFP4 in the gpt-oss layout (*_blocks/*_scales, transformers quant_method mxfp4)",
    "_scales": "MXFP4 in the gpt-oss layout (*_blocks/*_scales, transformers quant_method mxfp4)",
    ".weight_scale_inv": "block-scaled FP8 (weight_scale_inv, quant_method fp8)",
    ".SCB": "bitsandbytes",
    ".absmax": "bitsandbytes",
    ".quant_map": "bitsandbytes",
    ".input_scale": "FP8 with static activation scales (input_scale)",
}
STORAGE_FORMATS = ("MXFP4", "INT4", "INT8", "FP8")
SUPPORTED_CONFIG_FORMATS = (
    "mxfp4-pack-quantized",
    "pack-quantized",
    "float-quantized",
    "naive-quantized",
    "int-quantized",
    "dense",
    "mixed-precision",
)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32


# ------------------------------------------------------------------------------------ grouping
def group_quantised(
    raw: dict[str, TensorInfo], quant_config: dict | None = None
) -> tuple[dict[str, TensorInfo], dict[str, list[TensorInfo]]]:
    """Fold compressed-tensors parts into logical weights. ``raw``: canonical name -> stored tensor.

    Returns (table, foreign): the table with each quantised weight as one entry ``<module>.weight`` (dtype
    the storage format, logical shape, ``parts`` the stored tensors), and {format: stored names} of
    quantised tensors in formats k3lab does not decode (left in the table as stored). Raises
    CheckpointError when parts disagree (a scale of the wrong shape, a part without its weight)."""
    table = dict(raw)
    foreign: dict[str, list[str]] = {}
    bases: dict[str, dict[str, TensorInfo]] = {}
    roles = {suffix[1:] for suffix in PART_SUFFIXES}
    foreign_suffixes = tuple(FOREIGN_SUFFIXES)
    for name, info in raw.items():  # 500k names for Kimi K3: one rpartition each
        head, _, leaf = name.rpartition(".")
        if leaf in roles:
            bases.setdefault(head, {})[leaf] = info
        elif name.endswith(foreign_suffixes):
            suffix = next(s for s in foreign_suffixes if name.endswith(s))
            weight = raw.get(name[: -len(suffix)] + ".weight") if suffix.startswith(".") else None
            foreign.setdefault(FOREIGN_SUFFIXES[suffix], []).extend([info] + ([weight] if weight is not None else []))
    num_bits = _config_num_bits(quant_config)
    for base, parts in bases.items():
        dense = raw.get(base + ".weight")
        logical = _logical(base, parts, dense, num_bits, foreign)
        if logical is None:
            continue
        for role in parts:
            table.pop(f"{base}.{role}", None)
        table[logical.name] = logical
    return table, {k: sorted(v, key=lambda i: i.raw_name) for k, v in foreign.items()}


def _config_num_bits(quant_config: dict | None) -> int:
    for group in ((quant_config or {}).get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits") if isinstance(group, dict) else None
        if isinstance(bits, int) and 1 <= bits <= 8:
            return bits
    return 4


def _logical(
    base: str, parts: dict[str, TensorInfo], dense: TensorInfo | None, num_bits: int, foreign: dict
) -> TensorInfo | None:
    """The logical weight of one module's parts, or None (parts recorded in ``foreign``)."""
    packed, scale = parts.get("weight_packed"), parts.get("weight_scale")
    if packed is None:
        if dense is None or scale is None:
            names = sorted(p.raw_name for p in parts.values())
            raise CheckpointError(
                f"{next(iter(parts.values())).file.name}: quantisation parameters {names} without their weight "
                f"({base}.weight or {base}.weight_packed)"
            )
        if dense.dtype in ("F8_E4M3", "F8_E5M2"):
            fmt = "FP8"
        elif dense.dtype == "I8":
            fmt = "INT8"
        elif dense.dtype in ("F32", "BF16", "F16"):
            fmt = None  # a dense weight next to a leftover scale: compressed-tensors' dense format
        else:
            foreign.setdefault(f"{dense.dtype} weights with weight_scale", []).extend((dense, *parts.values()))
            return None
        if fmt is None:
            return None
        return replace(dense, dtype=fmt, parts=(("weight", dense), *sorted(parts.items())))
    if scale is None:
        raise CheckpointError(f"{packed.file.name}: {packed.raw_name!r} has no weight_scale beside it")
    if len(packed.shape) != 2:
        raise CheckpointError(f"{packed.file.name}: {packed.raw_name!r} has shape {list(packed.shape)}, expected 2-D")
    out, cols = packed.shape
    if packed.dtype == "U8":
        if "weight_global_scale" in parts or scale.dtype in ("F8_E4M3", "F8_E5M2"):
            foreign.setdefault("NVFP4 (FP4 with FP8 group scales and a global scale)", []).extend(parts.values())
            return None
        if scale.dtype != "U8" or "weight_zero_point" in parts:
            foreign.setdefault(f"FP4 with {scale.dtype} scales", []).extend(parts.values())
            return None
        logical = (out, 2 * cols)
        want = (out, logical[1] // MXFP4_GROUP)
        if logical[1] % MXFP4_GROUP or tuple(scale.shape) != want:
            raise CheckpointError(
                f"{scale.file.name}: MXFP4 scale tensor {scale.raw_name!r} has shape {list(scale.shape)}; "
                f"{packed.raw_name!r} {list(packed.shape)} needs {list(want)} (one scale per 32 inputs)"
            )
        return _merged(base, "MXFP4", logical, parts)
    if packed.dtype == "I32":
        logical = (out, cols * 32 // num_bits)
        if len(scale.shape) != 2 or scale.shape[0] != out or logical[1] % scale.shape[1]:
            raise CheckpointError(
                f"{scale.file.name}: scale tensor {scale.raw_name!r} has shape {list(scale.shape)}, which does not "
                f"fit {packed.raw_name!r} {list(packed.shape)} ({num_bits}-bit values, [{out}, {logical[1]}])"
            )
        return _merged(base, f"INT{num_bits}", logical, parts)
    foreign.setdefault(f"weight_packed of dtype {packed.dtype}", []).extend(parts.values())
    return None


def _merged(base: str, fmt: str, shape: tuple[int, ...], parts: dict[str, TensorInfo]) -> TensorInfo:
    packed = parts["weight_packed"]
    begin, end = packed.begin, packed.end
    for part in parts.values():
        if part.file == packed.file:
            begin, end = min(begin, part.begin), max(end, part.end)
    return TensorInfo(base + ".weight", packed.raw_name, packed.file, fmt, shape, begin, end, tuple(parts.items()))


def check_quantised(files: Any) -> None:
    """CheckpointError for quantised tensors in a format k3lab cannot decode, naming format and tensors."""
    foreign = getattr(files, "foreign_quantised", {}) or {}
    if not foreign:
        return
    where = files.folder.name or str(files.folder)
    parts = []
    for fmt, infos in foreign.items():
        names = [i.raw_name for i in infos]
        dtypes = sorted({i.dtype for i in infos})
        more = " ..." if len(names) > 8 else ""
        parts.append(f"{fmt}: {len(names)} tensor(s) (dtypes {dtypes}): {names[:8]}{more}")
    raise CheckpointError(
        f"{where}: quantised tensors in a format k3lab cannot decode (it reads compressed-tensors MXFP4, "
        f"pack-quantized INT and FP8/INT8 weights): " + "; ".join(parts)
    )


def check_quant_config(quant: Any, where: str) -> None:
    """CheckpointError for a ``quantization_config`` k3lab does not read (method or format named)."""
    if not quant:
        return
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method", "?")
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{where}: a quantised checkpoint (quantization_config: quant_method {method!r}); k3lab reads "
            f"unquantised weights and compressed-tensors checkpoints ({', '.join(SUPPORTED_CONFIG_FORMATS[:4])})"
        )
    formats = {quant.get("format")} | {
        g.get("format") for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)
    }
    unknown = sorted(f for f in formats - {None} if f not in SUPPORTED_CONFIG_FORMATS)
    if unknown:
        raise CheckpointError(
            f"{where}: compressed-tensors format {unknown[0]!r} is not supported (k3lab decodes "
            f"{', '.join(SUPPORTED_CONFIG_FORMATS[:5])})"
        )


# ------------------------------------------------------------------------------------ decoding
@functools.cache
def _mxfp4_tables(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per byte the two values it holds ([256, 2], low nibble first) and the sum of their squares ([256]);
    per scale byte s the power 2^(s - 127) ([256, 1]; s = 255 gives inf, as compressed-tensors computes it)."""
    values = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack((values[byte & 15], values[byte >> 4]), dim=-1)
    powers = torch.ldexp(torch.ones(256), byte - 127).unsqueeze(1)
    return pairs.to(device), pairs.square().sum(-1).to(device), powers.to(device)


def mxfp4_to_float(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 [out, in/2] bytes + [out, in/32] E8M0 scale bytes -> W [out, in] in ``dtype``, on their device.

    W[o, 2k] = v(packed[o, k] & 15), W[o, 2k+1] = v(packed[o, k] >> 4), times 2^(scale[o, i // 32] - 127),
    with v(n) = (-1)^(n >> 3) * FP4_VALUES[n & 7]; computed in fp32 (exact: a 2-bit mantissa times a power
    of two), then cast. Two table lookups (byte -> value pair, scale byte -> power) and one multiply."""
    out, half = packed.shape
    pairs, _, powers = _mxfp4_tables(str(packed.device))
    values = F.embedding(packed.to(torch.int32), pairs).view(out, -1, MXFP4_GROUP)
    values.mul_(F.embedding(scale.to(torch.int32), powers))
    return values.view(out, 2 * half).to(dtype)


def mxfp4_sum_squares(packed: torch.Tensor, scale: torch.Tensor) -> float:
    """sum(W^2) of an MXFP4 matrix without decoding it: per group of 32, the sum of the squared values (table
    per byte, exact in fp32) times 4^(s - 127), summed in float64 (exact: every term is a multiple of a power
    of two within 53 bits of the largest). An all-zero matrix costs one scan."""
    if not bool(packed.any()) and int(scale.max()) < 255:
        return 0.0
    out = packed.shape[0]
    _, squares, powers = _mxfp4_tables(str(packed.device))
    group = F.embedding(packed.to(torch.int32), squares.unsqueeze(1)).view(out, -1, MXFP4_GROUP // 2).sum(-1)
    weight = F.embedding(scale.to(torch.int32), powers).view(out, -1).double().square()
    return float((group.double() * weight).sum())


def decode(info: TensorInfo, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The logical weight of a quantised entry from its stored parts (role -> tensor of the stored dtype)."""
    if info.dtype == "MXFP4":
        return mxfp4_to_float(parts["weight_packed"], parts["weight_scale"], dtype)
    return _decode_compressed_tensors(info, parts).to(dtype)


def _decode_compressed_tensors(info: TensorInfo, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """INT (pack-quantized) and FP8/INT8 (float-/naive-quantized) through compressed-tensors' decompressors,
    with quantisation arguments read off the stored shapes."""
    try:
        from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    except ImportError as exc:
        raise CheckpointError(
            f"{info.file.name}: {info.raw_name!r} is {info.dtype}; decoding it needs the compressed-tensors "
            f"package (pip install compressed-tensors)"
        ) from exc
    scale = parts["weight_scale"]
    out, cols = info.shape
    kind = "float" if info.dtype == "FP8" else "int"
    bits = 8 if info.dtype in ("FP8", "INT8") else int(info.dtype[3:])
    args: dict[str, Any] = {"num_bits": bits, "type": kind, "symmetric": "weight_zero_point" not in parts}
    if scale.numel() == 1:
        args["strategy"] = "tensor"
    elif tuple(scale.shape) in ((out, 1), (out,)):
        args["strategy"] = "channel"
    elif scale.dim() == 2 and scale.shape[0] == out:
        args.update(strategy="group", group_size=cols // scale.shape[1])
    elif scale.dim() == 2:
        args.update(
            strategy="block", block_structure=[math.ceil(out / scale.shape[0]), math.ceil(cols / scale.shape[1])]
        )
    else:
        raise CheckpointError(
            f"{info.file.name}: scale of {info.raw_name!r} has an unreadable shape {list(scale.shape)}"
        )
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args))
    state = dict(parts)
    if info.dtype.startswith("INT") and "weight_packed" in parts:
        shape = parts.get("weight_shape")
        if shape is not None and tuple(int(v) for v in shape.tolist()) != tuple(info.shape):
            raise CheckpointError(
                f"{info.file.name}: {info.raw_name!r}: weight_shape says {shape.tolist()}, the packed data "
                f"{list(info.shape)}"
            )
        state["weight_shape"] = torch.tensor(info.shape)
        return PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return NaiveQuantizationCompressor.decompress(state, scheme)["weight"]


def part_view(part: TensorInfo, span: torch.Tensor, begin: int) -> torch.Tensor:
    """The stored tensor ``part`` as a typed view into ``span`` (raw bytes of its file from offset ``begin``)."""
    dtype = DTYPES[part.dtype]
    size = torch.empty((), dtype=dtype).element_size()
    if part.nbytes != math.prod(part.shape) * size:
        raise CheckpointError(
            f"{part.file.name}: tensor {part.raw_name!r} has {part.nbytes} bytes for shape {list(part.shape)} "
            f"of {part.dtype} ({math.prod(part.shape) * size} expected)"
        )
    raw = span[part.begin - begin : part.end - begin]
    if (part.begin - begin) % size:
        raw = raw.clone()  # a view of another element size needs aligned storage
    return raw.view(dtype).reshape(part.shape)


def read_parts(info: TensorInfo, read: Any, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The stored parts of a quantised entry, role -> typed tensor on ``device``: one read of its span when the
    parts lie back to back, else one per part. ``read(file, begin, end, what)`` returns uint8 bytes."""
    spans = (
        [(info.file, info.begin, info.end)] if contiguous(info) else [(p.file, p.begin, p.end) for _, p in info.parts]
    )
    parts: dict[str, torch.Tensor] = {}
    for file, begin, end in spans:
        raw = read(file, begin, end, info.raw_name).to(device)
        for role, part in info.parts:
            if part.file == file and begin <= part.begin and part.end <= end:
                parts[role] = part_view(part, raw, begin)
    return parts


def contiguous(info: TensorInfo) -> bool:
    """Whether every part of ``info`` lies in one file, back to back: one read fetches it."""
    parts = [p for _, p in info.parts]
    return all(p.file == info.file for p in parts) and info.end - info.begin == sum(p.nbytes for p in parts)


def stored_parts(infos: Iterable[TensorInfo]) -> list[TensorInfo]:
    """Stored tensors behind table entries (a quantised entry's parts, a plain entry itself)."""
    out = []
    for info in infos:
        out.extend([p for _, p in info.parts] if info.parts else [info])
    return out
