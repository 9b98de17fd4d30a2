"""Where runs come from: checkpoint folders named at start-up, the shipped samples, and the runs library.

``discover_runs`` lists them in picker order. The runs library (``app.library``: uploads, folders opened
by path, random-init presets, kept under the k3lab home with a SQLite index) is opened once per server
process with ``library()``; ``library_runs()`` turns its entries into picker runs. ``message`` words an
error about a run with the run's name, never the server folder it lives in. ``fit_problem`` says, from the
checkpoint's headers alone, when a run cannot fit in the chosen device's memory (so a page shows that
instead of trying, and running out of memory).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from analysis.format import format_bytes
from app.library import LibraryError, RunsLibrary
from app.roots import PathRefused, confine_folder
from app.settings import configured_roots, home_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLES_DIR = REPO_ROOT / "sample_checkpoints"
RUNS_ENV = "K3LAB_RUNS"
ORIGIN_OF_SOURCE = {"upload": "uploaded", "path": "path", "preset": "preset"}
LIBRARY_ORIGINS = tuple(ORIGIN_OF_SOURCE.values())
WEIGHTS_PAGE = REPO_ROOT / "app" / "app_pages" / "weights.py"
MEMORY_HEADROOM = 0.9  # leave a tenth of the free memory for activations, the trace and everything else


@dataclass(frozen=True)
class RunRef:
    """A checkpoint folder the user can pick."""

    label: str
    path: str
    origin: str  # "preloaded" (K3LAB_RUNS), "sample" (sample_checkpoints/), or a library source (LIBRARY_ORIGINS)
    run_id: str = ""  # the library's id for library runs


def is_checkpoint_dir(path: str | Path) -> bool:
    """A folder with a config.json (the loader reports everything else that may be wrong)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def discover_runs(
    env_value: str | None, samples_dir: str | Path | None, library: Iterable[RunRef] = ()
) -> tuple[list[RunRef], list[str]]:
    """Runs in picker order: K3LAB_RUNS entries, then sample_checkpoints/* folders, then library runs.

    A K3LAB_RUNS entry is a checkpoint folder, or a folder of checkpoint folders (each becomes a run).
    Duplicate folders are listed once (first origin wins); labels are the folder names (a library run's
    name), made unique with a " (2)", " (3)" suffix. Returns (runs, problems) where problems names
    K3LAB_RUNS entries that are not checkpoint folders.
    """
    library = list(library)
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
    by_path = {str(Path(r.path).resolve()): r for r in library}
    found.extend((Path(p), r.origin) for p, r in by_path.items())

    runs: list[RunRef] = []
    seen_paths: set[Path] = set()
    labels: set[str] = set()
    for path, origin in found:
        if path in seen_paths:
            continue
        seen_paths.add(path)
        lib_ref = by_path.get(str(path)) if origin in LIBRARY_ORIGINS else None
        base = lib_ref.label if lib_ref is not None else path.name
        label, n = base, 2
        while label in labels:
            label, n = f"{base} ({n})", n + 1
        labels.add(label)
        runs.append(RunRef(label=label, path=str(path), origin=origin, run_id=lib_ref.run_id if lib_ref else ""))
    return runs, problems


# ----------------------------------------------------------------------------------------- library
def upload_limit_mb() -> int:
    """The per-file upload limit Streamlit enforces (``k3lab app --max-upload-mb`` sets it)."""
    return int(st.get_option("server.maxUploadSize"))


@st.cache_resource(show_spinner=False)
def _library(home: str, max_upload_mb: int) -> RunsLibrary:
    return RunsLibrary(home, max_upload_bytes=max_upload_mb * 1024**2)


def library() -> RunsLibrary:
    """The runs library in $K3LAB_HOME (~/.k3lab), opened (and cleaned up) once per server process."""
    return _library(str(home_dir()), upload_limit_mb())


def ref_of(entry) -> RunRef:
    """A library entry as a picker run."""
    return RunRef(label=entry.name, path=str(entry.path), origin=ORIGIN_OF_SOURCE[entry.source], run_id=entry.id)


def path_refusal(entry) -> str | None:
    """Why a folder-on-the-server entry may not be opened now (the roots are those of this server start), or None."""
    if entry.source != "path":
        return None
    try:
        confine_folder(entry.path, allowed_roots())
    except PathRefused as exc:
        return str(exc)
    return None


def library_runs() -> list[RunRef]:
    """The library's runs whose files are there and may be opened, oldest first ([] when it cannot be opened)."""
    try:
        return [ref_of(e) for e in library().entries() if e.available and path_refusal(e) is None]
    except LibraryError:
        return []


def allowed_roots() -> list[Path]:
    """Folders that may be opened by path: the library home and K3LAB_ROOTS (default: where the app started)."""
    return configured_roots(home=library().home)


def message(exc: BaseException | str, ref: RunRef | None = None) -> str:
    """An error's text with server folders replaced by run names (the run's own, the library's)."""
    text = str(exc)
    names = {}
    if ref is not None:
        names[ref.path] = ref.label
        names[str(Path(ref.path).resolve())] = ref.label
    try:
        return library().redact(text, names)
    except LibraryError:
        for path, name in names.items():
            text = text.replace(path, name)
        return text


# ----------------------------------------------------------------------------------------- memory
def available_memory(device: str) -> int | None:
    """Free bytes on a device ("cpu", "cuda", "cuda:N"); None when unknown."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(index)[0])
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


def _stamp(path: Path) -> tuple:
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file())


@st.cache_data(show_spinner=False, max_entries=64)
def _plan(path: str, stamp: tuple, device: str, dtype: str):
    from analysis.runs import DTYPES
    from k3core.model import K3ForCausalLM

    return K3ForCausalLM.plan_placement(path, device, DTYPES[dtype])


def placement_plan(path: str | Path, device: str, dtype: str):
    """k3core's placement plan (bytes and layers per device) for loading the checkpoint in ``dtype`` on
    ``device`` ("auto": GPUs, then CPU, then disk), from config.json alone; cached per folder state."""
    path = Path(path)
    return _plan(str(path), _stamp(path), device, dtype)


@st.cache_data(show_spinner=False, max_entries=32)
def _stream_plan(path: str, stamp: tuple, device: str, dtype: str, max_memory: str):
    from analysis.runs import DTYPES
    from k3core.model import K3ForCausalLM
    from k3core.streamed import plan_for_path

    return plan_for_path(path, K3ForCausalLM, device=device, dtype=DTYPES[dtype], max_memory=max_memory)


def stream_plan(path: str | Path, device: str, dtype: str, max_memory: str):
    """k3core's streaming plan (what stays, what streams, bytes and expected time per prompt) for running the
    checkpoint within ``max_memory``; cached per folder state. Raises CheckpointError (a budget too small)."""
    path = Path(path)
    return _stream_plan(str(path), _stamp(path), device, dtype, max_memory)


def fit_problem(ref: RunRef, device: str, dtype: str) -> str | None:
    """A message when the run's weights cannot fit in the device's free memory, else None (config only, no load)."""
    if device == "auto":
        return None  # the placement spreads it over every device and disk
    try:
        needed = placement_plan(ref.path, device, dtype).total_bytes
    except (OSError, ValueError):  # a bad checkpoint gets the loader's own message (CheckpointError), not this one
        return None
    free = available_memory(device)
    if free is None or needed <= MEMORY_HEADROOM * free:
        return None
    weights = ""
    if WEIGHTS_PAGE.is_file():
        weights = " Its weights can still be read without loading it: see the **Weights** page."
    return (
        f"**{ref.label}** needs {format_bytes(needed)} in {dtype} but {device} has {format_bytes(free)} free: it "
        f"cannot be loaded here. Pick a smaller dtype or another device in the sidebar, or set a **Memory budget** "
        f"there to run it from its files.{weights}"
    )
