"""Placing a model over several devices with accelerate's big-model inference.

``device="auto"``: accelerate's ``infer_auto_device_map`` fills every visible GPU in order, then the
CPU, then the disk, never splitting a decoder layer (``no_split_module_classes=["K3DecoderLayer"]``);
``dispatch_model`` then attaches the hooks that move activations between devices and bring
offloaded weights in for each forward. k3lab adds two things around it:

- :func:`plan_for_model` returns the plan (module -> device) and the bytes each device will hold
  before anything is loaded, so a caller (the app, the CLI) can show it;
- an offloaded decoder layer is split into its children: the attention and FFN blocks (nearly all of
  the bytes) stay offloaded, while the layer's norms, AttnRes pseudo-queries and residual scales
  (a few vectors) stay resident on the main device. The model reads those small tensors directly in
  its depth mix rather than through a module call, which an offload hook would never see.

Weights stream straight to their device (CPU/GPU) or, for disk-offloaded modules, to accelerate's
offload folder (``<name>.dat`` + ``index.json``) as soon as a module is complete.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..modeling.loading_state import LoadingState
from ..utils.files import OutputFolderError, check_output_folder
from .folder import CheckpointFiles
from .into_parameters import ProgressFn, published_tensors, stream_weights, tqdm_progress
from .pretrained import build_meta_model, check_headers, refuse_quantised_config
from .tensor_info import CheckpointError

NO_SPLIT_MODULE_CLASSES = ["K3DecoderLayer"]
# Modules that may be offloaded as a whole (used only through their forward); the rest stays resident.
# (The embedding stays resident: inputs are placed on the device of the model's first parameter.)
OFFLOADABLE = ("self_attn", "mlp", "block_sparse_moe", "lm_head")


@dataclass
class Plan:
    """Where each module goes (accelerate device map, devices as strings) and the bytes per device."""

    device_map: dict[str, str]
    bytes_by_device: dict[str, int]
    main_device: str
    layers_by_device: dict[str, list[int]] = field(default_factory=dict)
    # Planned from a checkpoint folder: its stored bytes by storage format (MXFP4 / BF16 / F32 ...) and
    # parameter count, from the headers (a quantised checkpoint is smaller on disk than in memory).
    stored_bytes_by_format: dict[str, int] = field(default_factory=dict)
    stored_parameters: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_device.values())

    @property
    def offloaded(self) -> bool:
        return "disk" in self.bytes_by_device or (self.main_device != "cpu" and "cpu" in self.bytes_by_device)

    def describe(self) -> str:
        """One line per device: bytes and decoder layers (e.g. ``cuda:0  61.2 GB  layers 0-15``)."""
        lines = []
        for dev, nbytes in self.bytes_by_device.items():
            layers = self.layers_by_device.get(dev, [])
            span = f"  layers {_ranges(layers)}" if layers else ""
            lines.append(f"{dev:<8} {nbytes / 1e9:8.2f} GB{span}")
        if self.stored_bytes_by_format:
            stored = ", ".join(f"{fmt} {n / 1e9:.2f} GB" for fmt, n in self.stored_bytes_by_format.items())
            lines.append(f"stored   {self.stored_parameters / 1e12:.2f}T parameters: {stored}")
        return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _device_name(device: Any) -> str:
    if isinstance(device, int):
        return f"cuda:{device}"
    return "disk" if device == "disk" else str(torch.device(device))


def _device_of(name: str, device_map: dict[str, str]) -> str:
    """The device of a parameter: its longest matching device-map prefix."""
    best, dev = -1, None
    for key, value in device_map.items():
        if (key == "" or name == key or name.startswith(key + ".")) and len(key) > best:
            best, dev = len(key), value
    if dev is None:
        raise ValueError(f"the device map places no module holding {name!r}")
    return dev


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by their module path (tied weights once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _refine(model: nn.Module, device_map: dict[str, str], main: str) -> dict[str, str]:
    """Split offloaded entries until only the big, forward-called blocks stay offloaded.

    An offloaded module's weights exist only inside its own forward call (accelerate's hook brings them
    in). The attention / FFN blocks and the LM head are used that way (the embedding too, but inputs go to
    the device of the first parameter, so it stays resident; a tied LM head stays with it); AttnRes
    pseudo-queries, their norms and residual scales are read directly by the depth mix, so they (a few
    vectors per layer) stay resident on the main device."""
    offload = {"disk"} | ({"cpu"} if main != "cpu" else set())
    tied = getattr(model.config, "tie_word_embeddings", False)
    out: dict[str, str] = {}

    def place(key: str, dev: str) -> None:
        if tied and key == "lm_head" and dev in offload:
            out[key] = main
            return
        if dev not in offload or key.rpartition(".")[2] in OFFLOADABLE:
            out[key] = dev
            return
        module = model.get_submodule(key)
        children = list(module.named_children())
        if not children:
            out[key] = main
            return
        for child, _ in children:
            place(f"{key}.{child}" if key else child, dev)
        for leaf, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            out[f"{key}.{leaf}" if key else leaf] = main

    for key, dev in device_map.items():
        place(key, dev)
    return out


def plan_for_model(
    model: nn.Module, device: str | torch.device = "auto", max_memory: dict[Any, int | str] | None = None
) -> Plan:
    """The placement of a model (meta device is fine; the dtypes it has are the dtypes counted).

    ``device="auto"``: accelerate's ``infer_auto_device_map`` over every GPU, then CPU, then disk
    (``max_memory`` as accelerate's, e.g. ``{0: "70GiB", "cpu": "100GiB"}``; default: what is free).
    Any other device: everything there."""
    if str(device) != "auto":
        device_map = {"": _device_name(device)}
    else:
        from accelerate import infer_auto_device_map

        raw = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=NO_SPLIT_MODULE_CLASSES)
        device_map = {k: _device_name(v) for k, v in raw.items()}
    devices = list(dict.fromkeys(device_map.values()))
    main = next((d for d in devices if d not in ("cpu", "disk")), "cpu")
    device_map = _refine(model, device_map, main)
    by_device: dict[str, int] = {}
    layers: dict[str, list[int]] = {}
    for i, layer in enumerate(model.model.layers):
        first = next(name for name, _ in layer.self_attn.named_parameters())
        layers.setdefault(_device_of(f"model.layers.{i}.self_attn.{first}", device_map), []).append(i)
    for name, t in _named_tensors(model).items():
        dev = _device_of(name, device_map)
        by_device[dev] = by_device.get(dev, 0) + t.numel() * t.element_size()
    order = {d: i for i, d in enumerate([*(d for d in devices if d not in ("cpu", "disk")), "cpu", "disk"])}
    by_device = dict(sorted(by_device.items(), key=lambda kv: order.get(kv[0], -1)))
    return Plan(device_map, by_device, main, {d: sorted(v) for d, v in layers.items() if v})


def _allocate(model: nn.Module, plan: Plan) -> None:
    """Real storage for every tensor: on its device; disk-offloaded ones on the CPU until written out."""
    for name, t in _named_tensors(model).items():
        dev = _device_of(name, plan.device_map)
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        empty = torch.empty(t.shape, dtype=t.dtype, device="cpu" if dev == "disk" else dev)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(empty, requires_grad=t.requires_grad)
        else:
            module._buffers[leaf] = empty
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def load_placed(
    path: str | Path,
    model_cls: type[nn.Module],
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    max_memory: dict[Any, int | str] | None = None,
    offload_folder: str | Path | None = None,
    progress: ProgressFn | bool | None = None,
) -> nn.Module:
    """Stream a checkpoint into a model placed by :func:`plan_for_model` and dispatched by accelerate.

    Disk-offloaded modules are written to ``offload_folder`` (a fresh temporary folder by default, kept
    as long as the model: ``model.offload_folder``) as soon as all their tensors have been read, so host
    memory holds at most the modules still being read. Raises CheckpointError."""
    from accelerate import dispatch_model
    from accelerate.utils import offload_weight, save_offload_index

    if offload_folder:  # accelerate's offload files (index.json + one .dat per tensor) are replaced there
        try:
            check_output_folder(offload_folder, ("index.json",), "offload folder", option="--offload-folder")
        except OutputFolderError as exc:
            raise CheckpointError(str(exc)) from None
    files = CheckpointFiles.open(path)
    refuse_quantised_config(files.folder)
    model = build_meta_model(model_cls, files.config, dtype)
    check_headers(files, published_tensors(model))
    plan = plan_for_model(model, device, max_memory)
    _allocate(model, plan)

    # Disk-offloaded parameters: written out once every checkpoint tensor feeding them has been read.
    tensors = _named_tensors(model)
    on_disk = {n for n in tensors if _device_of(n, plan.device_map) == "disk" and n in dict(model.named_parameters())}
    pending: dict[str, int] = {}
    feeds: dict[str, str] = {}
    for ckpt_name in files.tensors:
        param = re.sub(r"\.experts\.\d+\.(w[123])\.weight$", r".experts.\1", ckpt_name)
        if param in on_disk:
            feeds[ckpt_name] = param
            pending[param] = pending.get(param, 0) + 1
    folder = None
    index: dict[str, Any] = {}
    if on_disk:
        folder = Path(offload_folder) if offload_folder else Path(tempfile.mkdtemp(prefix="k3lab-offload-"))
        folder.mkdir(parents=True, exist_ok=True)

    close = None
    if progress is True:
        progress, close = tqdm_progress(f"loading {files.folder.name}")
    elif progress is False:
        progress = None

    def done(ckpt_name: str) -> None:
        param = feeds.get(ckpt_name)
        if param is None:
            return
        pending[param] -= 1
        if pending[param] == 0:
            module_name, _, leaf = param.rpartition(".")
            module = model.get_submodule(module_name)
            offload_weight(module._parameters[leaf].data, param, str(folder), index)
            module._parameters[leaf] = nn.Parameter(
                torch.empty_like(module._parameters[leaf], device="meta"), requires_grad=False
            )

    try:
        stream_weights(model, files, progress=progress, after=done)
    finally:
        if close is not None:
            close()
    if folder is not None:
        save_offload_index(index, str(folder))
    cpu_state = None
    if plan.main_device != "cpu":
        cpu_state = {n: t for n, t in _named_tensors(model).items() if _device_of(n, plan.device_map) == "cpu"}
    if len(set(plan.device_map.values())) > 1:
        with warnings.catch_warnings():
            # Split layers' own parameters are device-map keys (so the map covers them), not submodules.
            warnings.filterwarnings("ignore", message="The following device_map keys do not match any submodules")
            dispatch_model(
                model,
                plan.device_map,
                main_device=plan.main_device,
                state_dict=cpu_state or None,
                offload_dir=str(folder) if folder else None,
                offload_index=index or None,
                offload_buffers=False,
            )
    model.loading = LoadingState(skipped_tensors=list(files.skipped), placement=plan, offload_folder=folder)
    if folder is not None and offload_folder is None:
        weakref.finalize(model, shutil.rmtree, folder, True)  # our temporary folder goes with the model
    return model.eval()
