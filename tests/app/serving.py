"""The app's environment for an AppTest, set up one way: a fresh library home, the runs it preloads (and no shipped
samples), the folders it may open by path."""

from __future__ import annotations

from pathlib import Path

from app.library import run_list
from app.server.settings import HOME_ENV, ROOTS_ENV


def serve_only(monkeypatch, tmp_path: Path, runs: str, roots: str) -> Path:
    """The app (in this process) with a library home in ``tmp_path``, ``runs`` preloaded (paths joined by
    ``os.pathsep``) and nothing else, and ``roots`` openable by path; the home."""
    home = tmp_path / "home"
    monkeypatch.setenv(HOME_ENV, str(home))
    monkeypatch.setenv(ROOTS_ENV, roots)
    monkeypatch.setenv(run_list.RUNS_ENV, runs)
    empty = tmp_path / "no-samples"
    empty.mkdir(exist_ok=True)
    monkeypatch.setattr(run_list, "SAMPLES_DIR", empty)
    return home
