"""Where runs come from: checkpoint folders named at start-up, the shipped samples, and uploads.

``discover_runs`` lists them in picker order; ``save_upload`` writes uploaded checkpoint files into a
fresh folder (the checkpoint itself is checked when it is loaded), ``remove_upload`` deletes it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from app.inputs import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES_DIR = REPO_ROOT / "sample_checkpoints"
RUNS_ENV = "K3LAB_RUNS"


@dataclass(frozen=True)
class RunRef:
    """A checkpoint folder the user can pick."""

    label: str
    path: str
    origin: str  # "preloaded" (K3LAB_RUNS), "sample" (sample_checkpoints/) or "uploaded"


def is_checkpoint_dir(path: str | Path) -> bool:
    """A folder with a config.json (the loader reports everything else that may be wrong)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def discover_runs(
    env_value: str | None, samples_dir: str | Path | None, uploaded: Iterable[RunRef] = ()
) -> tuple[list[RunRef], list[str]]:
    """Runs in picker order: K3LAB_RUNS entries, then sample_checkpoints/* folders, then uploads.

    A K3LAB_RUNS entry is a checkpoint folder, or a folder of checkpoint folders (each becomes a run).
    Duplicate folders are listed once (first origin wins); labels are the folder names, made unique
    with a " (2)", " (3)" suffix. Returns (runs, problems) where problems names K3LAB_RUNS entries that
    are not checkpoint folders.
    """
    found: list[tuple[Path, str]] = []
    problems: list[str] = []
    for entry in (env_value or "").split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        path = Path(entry).expanduser()
        children = sorted(p for p in path.iterdir() if is_checkpoint_dir(p)) if path.is_dir() else []
        if is_checkpoint_dir(path):
            found.append((path.resolve(), "preloaded"))
        elif children:  # a folder of runs
            found.extend((child.resolve(), "preloaded") for child in children)
        else:
            problems.append(f"{entry}: not a checkpoint folder (no config.json)")
    if samples_dir is not None and Path(samples_dir).is_dir():
        for path in sorted(Path(samples_dir).iterdir()):
            if is_checkpoint_dir(path):
                found.append((path.resolve(), "sample"))
    for run in uploaded:
        found.append((Path(run.path).resolve(), "uploaded"))

    runs: list[RunRef] = []
    seen_paths: set[Path] = set()
    labels: set[str] = set()
    uploaded_labels = {str(Path(r.path).resolve()): r.label for r in uploaded}
    for path, origin in found:
        if path in seen_paths:
            continue
        seen_paths.add(path)
        base = uploaded_labels.get(str(path), path.name) if origin == "uploaded" else path.name
        label, n = base, 2
        while label in labels:
            label, n = f"{base} ({n})", n + 1
        labels.add(label)
        runs.append(RunRef(label=label, path=str(path), origin=origin))
    return runs, problems


UPLOAD_NAMES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "metrics.json",
    "README.md",
    "pytorch_model.bin",
    "model.bin",
    "model.pt",
    "pytorch_model.pt",
)
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def save_upload(files: Iterable[tuple[str, bytes]], name: str = "", root: str | Path | None = None) -> RunRef:
    """Write uploaded checkpoint files into a fresh temporary folder and return it as a run.

    Accepts config.json, model.safetensors (or shards + index), optional metrics.json / README.md, and
    pickle weights (.bin/.pt, which the loader reads only with torch.load(weights_only=True)). Raises
    InputError for an unknown file name, a duplicate, or a missing config.json. The checkpoint itself is
    validated when it is loaded (CheckpointError).
    """
    files = list(files)
    if not files:
        raise InputError("No files uploaded: choose config.json and model.safetensors.")
    names = [Path(n).name for n, _ in files]
    bad = [n for n in names if n not in UPLOAD_NAMES and not _SHARD_RE.match(n)]
    if bad:
        raise InputError(
            f"unexpected file(s) {bad}: a checkpoint is config.json + model.safetensors (or shards "
            f"model-00001-of-0000N.safetensors + model.safetensors.index.json), optionally metrics.json "
            f"and README.md"
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"file(s) uploaded twice: {dupes}")
    if "config.json" not in names:
        raise InputError(
            "config.json is missing among the uploaded files (a checkpoint is config.json + model.safetensors)"
        )
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip()).strip("-.") or "uploaded"
    folder = Path(tempfile.mkdtemp(prefix=f"k3lab-upload-{label}-", dir=root))
    for fname, data in zip(names, (d for _, d in files)):
        (folder / fname).write_bytes(data)
    return RunRef(label=label, path=str(folder), origin="uploaded")


def remove_upload(run: RunRef) -> None:
    """Delete an uploaded run's temporary folder (only folders this app created)."""
    path = Path(run.path)
    if run.origin == "uploaded" and path.name.startswith("k3lab-upload-") and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
