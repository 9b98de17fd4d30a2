"""The files of a run directory, and writing them so that a crash never leaves a half-written one.

A run directory is a loadable checkpoint plus its history::

    config.json, model.safetensors     K3ForCausalLM.from_pretrained(run_dir)
    metrics.json                       history and results (schema: k3core.training.history)
    README.md                          model card, written when the run finishes
    train_state/step-000123/           resume state (only while the run is unfinished, or --keep-state):
        model.safetensors, config.json, optimizer.safetensors (AdamW tensors + RNG states),
        state.json (step, scalar optimiser state, training config, history)

Everything is safetensors + JSON: nothing is pickled. A resume checkpoint is first written to a
``.tmp-*`` folder and then renamed into place; single files are replaced atomically
(k3core.utils.files).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from ..loading.pretrained import save_pretrained
from ..utils.files import atomic_write_bytes, atomic_write_text, fsync_dir
from .config import TrainError

METRICS_NAME = "metrics.json"
STATE_DIR = "train_state"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "state.json"


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON (NaN allowed), replaced atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, allow_nan=True) + "\n")


def load_metrics(run_dir: str | Path) -> dict[str, Any]:
    """The metrics.json of a run directory."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        raise TrainError(f"{path}: no metrics.json (not a k3lab run directory?)")
    return json.loads(path.read_text())


def latest_state_dir(run_dir: str | Path) -> Path | None:
    """The newest complete resume checkpoint ``train_state/step-*`` (None when there is none)."""
    root = Path(run_dir) / STATE_DIR
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / STATE_NAME).is_file())
    return done[-1] if done else None


def code_version() -> str:
    """``git describe --always --dirty`` of the source tree, else the installed package version."""
    root = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return f"k3lab {importlib.metadata.version('k3lab')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------ optimizer / RNG
def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state as (tensors keyed ``<param>/<key>``, JSON-able scalars and param groups)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{names[idx]}/{key}"] = value.detach().to("cpu").contiguous().clone()
            else:
                scalars[f"{names[idx]}/{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def restore_optimizer(
    optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    """Inverse of :func:`optimizer_tensors` (``names``: parameter names in the optimizer's order)."""
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        pname, _, sub = key.rpartition("/")
        if pname not in index:
            raise TrainError(f"optimizer state names an unknown parameter {pname!r}")
        state.setdefault(index[pname], {})[sub] = value
    for key, value in meta["scalars"].items():
        pname, _, sub = key.rpartition("/")
        state.setdefault(index[pname], {})[sub] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors(data_gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """The data generator's and torch's RNG states (and every CUDA device's when training on CUDA)."""
    tensors = {"rng/data": data_gen.get_state().clone(), "rng/torch": torch.get_rng_state().clone()}
    if device.type == "cuda":
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s.clone()
    return tensors


def restore_rng(tensors: dict[str, torch.Tensor], data_gen: torch.Generator, device: torch.device) -> None:
    data_gen.set_state(tensors["rng/data"])
    torch.set_rng_state(tensors["rng/torch"])
    if device.type == "cuda":
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda/")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------------------------------------------ resume checkpoints
def write_resume_state(
    run_dir: Path, step: int, model: torch.nn.Module, tensors: dict[str, torch.Tensor], state: dict[str, Any]
) -> Path:
    """``train_state/step-<step>`` with the weights, ``tensors`` (optimizer + RNG) and ``state`` (JSON).

    Written into a ``.tmp-*`` folder that is renamed into place once complete, so a crash leaves the
    previous checkpoint intact; older checkpoints are then removed. An existing complete folder for
    the same step is kept as it is.
    """
    root = run_dir / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    if not (final / STATE_NAME).is_file():
        tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_pretrained(model, tmp)
            atomic_write_bytes(tmp / OPTIMIZER_NAME, safetensors_bytes(tensors, metadata={"producer": "k3lab.train"}))
            write_json(tmp / STATE_NAME, state)
            fsync_dir(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for old in root.iterdir():
        if old != final and (old.name.startswith("step-") or old.name.startswith(".tmp-")):
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state_json(state_dir: Path) -> dict[str, Any]:
    """The state.json of a resume checkpoint (step, training config, optimizer scalars, metrics)."""
    return json.loads((state_dir / STATE_NAME).read_text())


def read_resume_state(state_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(state.json, optimizer.safetensors tensors) of a resume checkpoint."""
    return read_state_json(state_dir), load_file(str(state_dir / OPTIMIZER_NAME))
