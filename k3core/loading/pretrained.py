"""Checkpoint I/O: a folder with ``config.json`` and ``model.safetensors`` (sharded with
``model.safetensors.index.json`` when large), Hugging Face conventions and key names.

Loading streams, so that it works for any size (see :func:`load_pretrained`):

1. ``CheckpointFiles.open`` reads config.json, the shard index and every safetensors header
   (k3core/loading/folder.py; name variants, skipped multimodal tensors, the keep-fp32 rule: names.py);
2. the model is built on the meta device (shapes only, no storage), tensors named by the keep-fp32
   rule switched to fp32;
3. every check that headers can answer runs before any data is read: quantised tensors, missing /
   unexpected / mis-shaped tensors, byte counts;
4. storage is allocated on the target device(s) and the tensors are read (k3core/loading/into_parameters.py) file
   by file in offset order by a few threads (``os.preadv``), each straight into its parameter, and
   checked for NaN/Inf as it lands. A large CPU tensor already stored in the parameter's dtype is not copied at all: the
   parameter becomes a copy-on-write map of the file. Peak host memory: what the model occupies on
   the CPU plus one tensor per reading thread (a GPU target: only the latter).

Everything a user can get wrong raises one error type, ``CheckpointError``, whose message names the
file, the tensor and what was expected. Pickle files (``.pt``, ``.bin``) are never unpickled; they are
read only when ``torch.load(weights_only=True)`` accepts them.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..modeling.config import K3Config
from ..modeling.hf_config import config_to_hf, hf_incompatibility
from ..modeling.loading_state import LoadingState
from ..utils.files import atomic_write_bytes
from .folder import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, CheckpointFiles, read_config, read_quantization_config
from .into_parameters import ProgressFn, materialise, published_tensors, stream_weights, tqdm_progress
from .names import keep_fp32
from .quantized import check_quant_config, check_quantised, stored_parts
from .tensor_info import DTYPES, CheckpointError

__all__ = ["export_state_dict", "load_config", "load_pretrained", "save_pretrained"]

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Stored names that only quantised checkpoints have (MXFP4 blocks/scales, FP8 scales, GPTQ/AWQ packs).
QUANTISED_SUFFIXES = (
    "_blocks",
    "_scales",
    ".weight_scale",
    ".weight_scale_inv",
    ".input_scale",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
)


# ---------------------------------------------------------------------------------------- save
def export_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with published key names, as independent contiguous CPU tensors (no shared storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in published_tensors(model).items()}


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
    extra_metadata: dict[str, str] | None = None,
    config_format: str = "auto",
) -> Path:
    """Write config.json + model.safetensors (or shards + index), each file atomically.

    One shard is copied to host memory at a time. ``config_format``: "hf" writes transformers'
    ``kimi_linear`` config.json (and Kimi Linear's [1, 1, H, 1] ``A_log``), so that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads it; "k3lab" writes k3lab's own config;
    "auto" (default) picks "hf" whenever the architecture is Kimi Linear.
    """
    from safetensors.torch import save

    if config_format not in ("auto", "hf", "k3lab"):
        raise ValueError(f"config_format must be 'auto', 'hf' or 'k3lab', got {config_format!r}")
    config = model.config
    hf = config_format == "hf" or (config_format == "auto" and hf_incompatibility(config) is None)
    config_text = json.dumps(config_to_hf(config), indent=2) if hf else config.to_json()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    live = published_tensors(model)
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(live):
        nbytes = live[key].numel() * live[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes

    def shard_bytes(keys: list[str]) -> bytes:
        tensors = {k: live[k].detach().to("cpu").contiguous().clone() for k in keys}
        if hf:
            for key in [k for k in tensors if k.endswith("self_attn.A_log")]:
                tensors[key] = tensors[key].reshape(1, 1, -1, 1)
        return save(tensors, metadata=metadata)

    metadata = {"format": "pt", "producer": "k3lab", **(extra_metadata or {})}
    # Remove files of an earlier save so a directory never mixes layouts.
    for old in list(path.glob("model-*-of-*.safetensors")) + [path / INDEX_NAME, path / WEIGHTS_NAME]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        atomic_write_bytes(path / WEIGHTS_NAME, shard_bytes(shards[0]))
    else:
        weight_map = {}
        for n, keys in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            atomic_write_bytes(path / name, shard_bytes(keys))
            weight_map.update({k: name for k in keys})
        total = sum(t.numel() * t.element_size() for t in live.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_bytes(path / INDEX_NAME, json.dumps(index, indent=2).encode())
    atomic_write_bytes(path / CONFIG_NAME, (config_text + "\n").encode())
    return path


# ---------------------------------------------------------------------------------------- load
def load_config(path: str | Path) -> K3Config:
    """The K3Config of a checkpoint folder (or of the folder of a weights file). Raises CheckpointError."""
    path = Path(path)
    return read_config(path if path.is_dir() else path.parent)


def keep_fp32_parameters(model: nn.Module) -> list[str]:
    """Switch the model's keep-fp32 tensors (``k3core.loading.names.keep_fp32``) to fp32, in place; their names.

    Meant for a model on the meta device, before storage is allocated (costs nothing there)."""
    names = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for table in (module._parameters, module._buffers):
            for leaf, tensor in list(table.items()):
                if tensor is None or not tensor.is_floating_point() or not keep_fp32(prefix + leaf):
                    continue
                names.append(prefix + leaf)
                if tensor.dtype == torch.float32:
                    continue
                if isinstance(tensor, nn.Parameter):
                    table[leaf] = nn.Parameter(tensor.detach().float(), requires_grad=tensor.requires_grad)
                else:
                    table[leaf] = tensor.float()
    return names


def published_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Published tensor name -> shape, as ``streaming.published_tensors`` but without building 250K expert views
    (stacked experts [E, ...] expand to E names ``experts.e.wN.weight``); tied LM head left out."""
    out: dict[str, tuple[int, ...]] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        head, _, leaf = name.rpartition(".")
        if head.endswith(".experts") and leaf in ("w1", "w2", "w3"):
            shape = tuple(t.shape[1:])
            out.update({f"{head}.{e}.{leaf}.weight": shape for e in range(t.shape[0])})
        else:
            out[name] = tuple(t.shape)
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def stored_shape_ok(name: str, stored: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether a stored shape fits the model's ``want``: equal, or a published layout that differs from
    k3core's: Kimi Linear's A_log [1, 1, H, 1]; the K3 repo's A_log padded with zeros to more entries
    than heads (the padding is checked when it is read)."""
    if stored == want:
        return True
    if not name.endswith("self_attn.A_log"):
        return False
    return math.prod(stored) == math.prod(want) or (len(stored) == 1 and len(want) == 1 and stored[0] > want[0])


def check_headers(files: CheckpointFiles, expected: dict[str, torch.Tensor]) -> None:
    """Every check the headers can answer, before any data is read. Raises CheckpointError."""
    where = files.folder.name or str(files.folder)
    check_quantised(files)
    quantised = sorted(
        (info.raw_name, info.dtype)
        for name, info in files.tensors.items()
        if not info.parts
        and (
            info.raw_name.endswith(QUANTISED_SUFFIXES)
            or info.dtype not in FLOAT_DTYPES
            and (name not in expected or expected[name].is_floating_point())
        )
    )
    if quantised:
        kinds = sorted({dtype for _, dtype in quantised})
        names = [raw for raw, _ in quantised]
        raise CheckpointError(
            f"{where}: {len(names)} quantised tensor(s) (dtypes {kinds}) that k3lab cannot use; it computes in "
            f"fp32/bf16/fp16 and needs unquantised weights: {names[:8]}{' ...' if len(names) > 8 else ''}"
        )
    for info in stored_parts(files.tensors.values()):
        if info.begin < 0:
            continue  # pickle: the tensor itself is already in memory
        size = torch.empty((), dtype=DTYPES[info.dtype]).element_size()
        if info.numel * size != info.nbytes:
            raise CheckpointError(
                f"{info.file.name}: corrupt safetensors data: tensor {info.raw_name!r} has {info.nbytes} bytes "
                f"for shape {list(info.shape)} of {info.dtype} ({info.numel * size} expected)"
            )
    problems = []
    missing = sorted(set(expected) - set(files.tensors))
    unexpected = sorted(set(files.tensors) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensor(s): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    shapes = [
        f"{k}: checkpoint {files.tensors[k].shape} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(files.tensors) & set(expected))
        if not stored_shape_ok(k, files.tensors[k].shape, tuple(expected[k].shape))
    ]
    if shapes:
        problems.append(f"{len(shapes)} mis-shaped tensor(s): {shapes[:6]}")
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not match its config: " + "; ".join(problems))


def refuse_quantised_config(folder: Path) -> None:
    """CheckpointError for a ``quantization_config`` k3lab cannot read (anything but compressed-tensors'
    MXFP4 / pack-quantized / FP8 / INT8 formats; k3core.loading.quantized)."""
    check_quant_config(read_quantization_config(folder), f"{folder.name}/config.json")


@contextlib.contextmanager
def _meta_init_is_free() -> Iterator[None]:
    """nn.Embedding's constructor draws normal_ values; on the meta device torch runs that through a
    Python decomposition whose first call costs over a second of imports. Shapes need no values."""
    original = nn.init.normal_

    def normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if tensor.is_meta else original(tensor, *args, **kwargs)

    nn.init.normal_ = normal_
    try:
        yield
    finally:
        nn.init.normal_ = original


def build_meta_model(model_cls: type[nn.Module], config: K3Config, dtype: torch.dtype | None) -> nn.Module:
    """``model_cls`` on the meta device in ``dtype`` (default fp32), keep-fp32 tensors switched to fp32."""
    with _meta_init_is_free():
        model = model_cls.from_config(config, device="meta", dtype=dtype or torch.float32)
    keep_fp32_parameters(model)
    return model


def load_pretrained(
    path: str | Path,
    model_cls: type[nn.Module],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    progress: ProgressFn | bool | None = None,
) -> nn.Module:
    """Stream a checkpoint folder into ``model_cls`` on one device (eval mode). Raises CheckpointError.

    ``dtype`` (default fp32) applies to every tensor but those of the keep-fp32 rule, which stay fp32.
    ``progress``: a callback (bytes done, bytes total) or True for a tqdm bar. Several devices / offload:
    ``k3core.loading.placement.load_placed`` (what ``K3ForCausalLM.from_pretrained(device="auto")`` calls).
    """
    files = CheckpointFiles.open(path)
    refuse_quantised_config(files.folder)
    model = build_meta_model(model_cls, files.config, dtype)
    check_headers(files, published_tensors(model))
    close = None
    if progress is True:
        progress, close = tqdm_progress(f"loading {files.folder.name}")
    elif progress is False:
        progress = None
    try:
        materialise(model, device)
        stream_weights(model, files, progress=progress)
    finally:
        if close is not None:
            close()
    model.loading = LoadingState(skipped_tensors=list(files.skipped))  # stored tensors not of the text model
    return model.eval()
