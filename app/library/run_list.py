"""The runs the picker lists: checkpoint folders named at start-up, the shipped samples, and the runs library.

``discover_runs`` lists them in picker order; ``library_runs()`` turns the runs library's entries
(``app.library.store``: uploads, folders opened by path, random-init presets; opened by ``app.library.home``) into
picker runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from analysis.compare.two_runs import quantised_copy
from app.library.home import allowed_roots, library, path_refusal
from app.library.run_folders import LibraryError

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES_DIR = REPO_ROOT / "sample_checkpoints"
RUNS_ENV = "K3LAB_RUNS"
ORIGIN_OF_SOURCE = {"upload": "uploaded", "path": "path", "preset": "preset"}
LIBRARY_ORIGINS = tuple(ORIGIN_OF_SOURCE.values())


@dataclass(frozen=True)
class RunRef:
    """A checkpoint folder the user can pick in the sidebar (``discover_runs``); ``app.render.caching.load_run`` turns
    it into an ``analysis.runs.loading.Run``, ``app.render.caching.load_weights`` into the weights path's context."""

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
    Duplicate folders are listed once per name (first origin wins; a library run named otherwise than the
    folder is listed under its name as well); labels are the folder names (a library run's name), made unique
    with a " (2)", " (3)" suffix. Returns (runs, problems) where problems names
    K3LAB_RUNS entries that are not checkpoint folders.
    """
    library = list(library)
    found: list[tuple[Path, str, RunRef | None]] = []
    problems: list[str] = []
    for entry in (env_value or "").split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        path = Path(entry).expanduser()
        children = sorted(p for p in path.iterdir() if is_checkpoint_dir(p)) if path.is_dir() else []
        if is_checkpoint_dir(path):
            found.append((path.resolve(), "preloaded", None))
        elif children:  # a folder of runs
            found.extend((child.resolve(), "preloaded", None) for child in children)
        else:
            problems.append(f"{entry}: not a checkpoint folder (no config.json)")
    if samples_dir is not None and Path(samples_dir).is_dir():
        for path in sorted(Path(samples_dir).iterdir()):
            if is_checkpoint_dir(path):
                found.append((path.resolve(), "sample", None))
    found.extend((Path(r.path).resolve(), r.origin, r) for r in library)

    runs: list[RunRef] = []
    seen: set[tuple[Path, str]] = set()
    labels: set[str] = set()
    for path, origin, lib_ref in found:
        base = lib_ref.label if lib_ref is not None else path.name
        # one folder once per name: a library entry that names a listed folder (e.g. a shipped sample opened by
        # path as "my-sample") is listed under its own name too, so the name it was given can be picked and linked
        if (path, base) in seen or (lib_ref is None and any(p == path for p, _ in seen)):
            continue
        seen.add((path, base))
        label, n = base, 2
        while label in labels:
            label, n = f"{base} ({n})", n + 1
        labels.add(label)
        runs.append(RunRef(label=label, path=str(path), origin=origin, run_id=lib_ref.run_id if lib_ref else ""))
    return runs, problems


def ref_of(entry) -> RunRef:
    """A library entry as a picker run."""
    return RunRef(label=entry.name, path=str(entry.path), origin=ORIGIN_OF_SOURCE[entry.source], run_id=entry.id)


def library_runs() -> list[RunRef]:
    """The library's runs whose files are there and may be opened, oldest first ([] when it cannot be opened)."""
    try:
        return [ref_of(e) for e in library().entries() if e.available and path_refusal(e) is None]
    except LibraryError:
        return []


def readable_folders() -> list[Path]:
    """Every folder the app reads checkpoints from: the roots (with the library home), the shipped samples and
    the folders given to ``k3lab app`` (K3LAB_RUNS). Files opened outside them are refused (``app.library.roots``)."""
    given = [Path(p).expanduser() for p in os.environ.get(RUNS_ENV, "").split(os.pathsep) if p.strip()]
    return [*allowed_roots(), Path(SAMPLES_DIR), *given]


def default_run_b(run_a: RunRef, others: list[RunRef]) -> RunRef:
    """Compare's default B: the first other run that is not a quantised copy of A (else the first)."""
    return next((r for r in others if not quantised_copy(run_a.path, r.path)), others[0])
