"""Checkpoint I/O: a directory with ``config.json`` and ``model.safetensors`` (sharded with
``model.safetensors.index.json`` when large), Hugging Face conventions and key names.

Loading checks everything and raises one error type, ``CheckpointError``, whose message names
the file, the tensor and what was expected: missing or invalid config, not a safetensors file,
truncated or corrupt data, missing / unexpected / mis-shaped tensors, NaN or Inf values. Pickle
files (``.pt``, ``.bin``) are never unpickled; they are read only when
``torch.load(weights_only=True)`` accepts them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch

from .checkpoint_files import CheckpointError
from .config import ConfigError, K3Config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.bin", "pytorch_model.pt")
HF_PREFIXES = ("language_model.",)
# transformers' own KimiLinearForCausalLM.save_pretrained names a dense layer's MLP like an MoE block.
_DENSE_AS_MOE = re.compile(r"(\.layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.)")




# ---------------------------------------------------------------------------------------- save
def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with published key names, as independent contiguous CPU tensors (no shared storage)."""
    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_bytes: int = 2 * 1024**3,
                    extra_metadata: dict[str, str] | None = None, config_format: str = "auto") -> Path:
    """Write config.json + model.safetensors (or shards + index), each file atomically.

    ``config_format``: "hf" writes transformers' ``kimi_linear`` config.json (and Kimi Linear's
    [1, 1, H, 1] ``A_log``), so that ``transformers.AutoModelForCausalLM.from_pretrained`` loads it;
    "k3lab" writes k3lab's own config; "auto" (default) picks "hf" whenever the architecture is Kimi Linear.
    """
    from safetensors.torch import save

    if config_format not in ("auto", "hf", "k3lab"):
        raise ValueError(f"config_format must be 'auto', 'hf' or 'k3lab', got {config_format!r}")
    config = model.config
    hf = config_format == "hf" or (config_format == "auto" and config.hf_incompatibility() is None)
    config_text = json.dumps(config.to_hf_dict(), indent=2) if hf else config.to_json()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = export_state_dict(model)
    if hf:
        for key in [k for k in tensors if k.endswith("self_attn.A_log")]:
            tensors[key] = tensors[key].reshape(1, 1, -1, 1)
    metadata = {"format": "pt", "producer": "k3lab", **(extra_metadata or {})}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    # Remove files of an earlier save so a directory never mixes layouts.
    for old in list(path.glob("model-*-of-*.safetensors")) + [path / INDEX_NAME, path / WEIGHTS_NAME]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        _atomic_write_bytes(path / WEIGHTS_NAME, save(shards[0], metadata=metadata))
    else:
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            _atomic_write_bytes(path / name, save(shard, metadata=metadata))
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_write_bytes(path / INDEX_NAME, json.dumps(index, indent=2).encode())
    _atomic_write_bytes(path / CONFIG_NAME, (config_text + "\n").encode())
    return path


# ---------------------------------------------------------------------------------------- load
def load_config(path: str | Path) -> K3Config:
    path = Path(path)
    cfg_path = path / CONFIG_NAME if path.is_dir() else path.parent / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: config.json is missing (a checkpoint is a folder with "
                              f"config.json and model.safetensors)")
    try:
        data = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: config.json is not valid JSON ({exc})") from exc
    try:
        return K3Config.from_dict(data)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: invalid config: {exc}") from exc


def _header_data_end(file: Path, header: object) -> int:
    """Check the structure of a parsed safetensors header; return the end offset of its data section.

    A header is a JSON object mapping each tensor name to {"dtype": str, "shape": [int, ...],
    "data_offsets": [begin, end]} with 0 <= begin <= end (plus an optional "__metadata__" entry).
    """
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (a JSON {type(header).__name__}, "
                              f"expected an object of tensor entries)")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        ok = (
            isinstance(entry.get("dtype") if isinstance(entry, dict) else None, str)
            and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        )
        if not ok:
            raise CheckpointError(f"{file}: corrupt safetensors header: entry {key!r} is not "
                                  f"{{dtype, shape, data_offsets}} ({str(entry)[:120]})")
        end = max(end, offsets[1])
    return end


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    size = file.stat().st_size
    if size < 8:
        raise CheckpointError(f"{file}: not a safetensors file (only {size} bytes)")
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little")
        if n <= 0 or n > size - 8:
            if head[:2] == b"PK" or head[:1] == b"\x80":
                raise CheckpointError(f"{file}: this is a pickle/zip (torch.save) file, not safetensors; "
                                      f"k3lab never unpickles untrusted files")
            raise CheckpointError(f"{file}: not a safetensors file (header length {n} does not fit in {size} bytes)")
        header_bytes = fh.read(n)
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from exc
    end = _header_data_end(file, header)
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: truncated: the header describes {8 + n + end} bytes but the file has {size}")
    try:
        out = {}
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
        return out
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors data ({exc})") from exc


def _read_pickle_weights_only(file: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means we refuse the file
        raise CheckpointError(f"{file}: refusing to load this pickle file: torch.load(weights_only=True) "
                              f"rejected it ({type(exc).__name__}); convert it to safetensors") from exc
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{file}: the pickle file does not hold a plain dict of tensors")
    return obj


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (or a single weights file), with HF prefixes stripped."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    folder = path if path.is_dir() else path.parent
    if path.is_file():
        files = [path]
    elif (folder / INDEX_NAME).is_file():
        try:
            index = json.loads((folder / INDEX_NAME).read_text())
            files = [folder / name for name in sorted(set(index["weight_map"].values()))]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{folder / INDEX_NAME}: invalid shard index ({exc})") from exc
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard files listed in the index are missing: {missing}")
    elif (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    else:
        pickles = [folder / n for n in PICKLE_NAMES if (folder / n).is_file()]
        if not pickles:
            raise CheckpointError(f"{folder}: no weights found (expected {WEIGHTS_NAME} or {INDEX_NAME})")
        files = pickles[:1]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix in (".pt", ".bin", ".pth", ".ckpt"):
            part = _read_pickle_weights_only(file)
        else:
            part = _read_safetensors(file)
        for key, value in part.items():
            for prefix in HF_PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
            tensors[_DENSE_AS_MOE.sub(r"\1mlp.\2", key)] = value
    return tensors


def _adapt_published_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """The real K3 checkpoint pads A_log to 128 entries with zeros after the live heads; Kimi Linear
    ships A_log as [1, 1, H, 1]. Both become our [H]."""
    for key, value in tensors.items():
        want = expected.get(key)
        if key.endswith("self_attn.A_log") and want is not None and value.dim() > 1 \
                and value.numel() == want.numel():
            tensors[key] = value = value.reshape(want)
        if key.endswith("self_attn.A_log") and want is not None and value.dim() == 1 and value.shape[0] > want[0]:
            if torch.count_nonzero(value[want[0]:]) == 0:
                tensors[key] = value[: want[0]]


def validate_state_dict(tensors: dict[str, torch.Tensor], model: torch.nn.Module, where: str) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    _adapt_published_shapes(tensors, expected)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    shapes = [f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(expected[k])}"
              for k in sorted(set(tensors) & set(expected)) if tuple(tensors[k].shape) != tuple(expected[k])]
    if shapes:
        problems.append(f"{len(shapes)} mis-shaped tensor(s): {shapes[:6]}")
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        problems.append(f"NaN or Inf values in {len(bad)} tensor(s): {sorted(bad)[:8]}")
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not match its config: " + "; ".join(problems))


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None):
    """Load a checkpoint folder into a K3ForCausalLM (eval mode). Raises CheckpointError."""
    from .model import K3ForCausalLM

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    config = load_config(path)
    tensors = read_weights(path)
    model = K3ForCausalLM(config)
    validate_state_dict(tensors, model, str(path))
    model.load_state_dict(tensors, strict=not config.tie_word_embeddings)
    model = model.to(device=device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.eval()


def checkpoint_fingerprint(path: str | Path) -> str:
    """SHA-256 over config.json and every weights file: a cache key that changes with the content."""
    path = Path(path)
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name == CONFIG_NAME or p.suffix in (".safetensors", ".json"))
    for file in files:
        h.update(file.name.encode())
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
