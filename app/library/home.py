"""The runs library of this server process: opened once from $K3LAB_HOME (``app.library.store.RunsLibrary``), with
the upload limit the server enforces and the folders that may be opened by path."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app.library.roots import PathRefused, confine_folder
from app.library.store import RunsLibrary
from app.server.settings import configured_roots, home_dir


def upload_limit_mb() -> int:
    """The per-file upload limit Streamlit enforces (``k3lab app --max-upload-mb`` sets it)."""
    return int(st.get_option("server.maxUploadSize"))


@st.cache_resource(show_spinner=False)
def _library(home: str, max_upload_mb: int) -> RunsLibrary:
    return RunsLibrary(home, max_upload_bytes=max_upload_mb * 1024**2)


def library() -> RunsLibrary:
    """The runs library in $K3LAB_HOME (~/.k3lab), opened (and cleaned up) once per server process."""
    return _library(str(home_dir()), upload_limit_mb())


def path_refusal(entry) -> str | None:
    """Why a folder-on-the-server entry may not be opened now (the roots are those of this server start), or None."""
    if entry.source != "path":
        return None
    try:
        confine_folder(entry.path, allowed_roots())
    except PathRefused as exc:
        return str(exc)
    return None


def allowed_roots() -> list[Path]:
    """Folders that may be opened by path: the library home and K3LAB_ROOTS (default: where the app started)."""
    return configured_roots(home=home_dir())  # not library().home: a damaged index must not stop every read
