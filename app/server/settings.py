"""The app server's settings, from the environment that ``k3lab app`` sets (stdlib only, no Streamlit).

- ``K3LAB_HOME`` (``--home DIR``): the runs library folder, default ``~/.k3lab``;
- ``K3LAB_ROOTS`` (``--root DIR``, repeatable): folders that may be opened by path, besides the home;
  default: the folder the app was started in;
- ``K3LAB_MAX_UPLOAD_MB`` (``--max-upload-mb N``): the per-file upload limit, default 4096 MB (``k3lab app``
  passes the same number to Streamlit's ``server.maxUploadSize``);
- ``K3LAB_JOB_MEMORY`` (``--job-memory SIZE``): the memory long jobs and the results they leave may use
  (``app.server.job_budget``: three quarters run jobs, a quarter keeps results), default half of the machine's
  memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "K3LAB_HOME"
ROOTS_ENV = "K3LAB_ROOTS"
MAX_UPLOAD_ENV = "K3LAB_MAX_UPLOAD_MB"
JOB_MEMORY_ENV = "K3LAB_JOB_MEMORY"
JOB_MEMORY_SHARE = 0.5  # of the machine's memory, when --job-memory is not given
DEFAULT_MAX_UPLOAD_MB = 4096
DEFAULT_HOST = "127.0.0.1"
#: Streamlit options the app always runs with: ``k3lab app`` passes them to the server, tests/conftest.py sets them
#: for AppTest. Magic off: every page writes explicitly, and magic ast.parse()s each page script, which CPython 3.11
#: cannot do in two threads at once ("SystemError: AST constructor recursion depth mismatch"; AppTest sessions in
#: threads each compile their own copy, as the six-session budget test does). No garbage collection after every script
#: run: Streamlit's gc.collect(2) walks the ~435K objects of torch, plotly and pandas, 0.20-0.28 s holding the GIL
#: on the 2-core machine, and the browser's "run finished" waits behind it, so it added about 0.15 s to every page
#: switch (``python -m benchmarks.bench_pages --against runner.postScriptGC=true``); Python's own collector still runs.
STREAMLIT_OPTIONS = {"runner.magicEnabled": False, "runner.postScriptGC": False}


def home_dir(env: Mapping[str, str] | None = None) -> Path:
    """The k3lab home folder: $K3LAB_HOME, else ~/.k3lab."""
    env = os.environ if env is None else env
    value = env.get(HOME_ENV, "").strip()
    return Path(value).expanduser() if value else Path.home() / ".k3lab"


def max_upload_mb(env: Mapping[str, str] | None = None) -> int:
    """The per-file upload limit in MB: $K3LAB_MAX_UPLOAD_MB when a positive whole number, else 4096."""
    env = os.environ if env is None else env
    try:
        value = int(env.get(MAX_UPLOAD_ENV, DEFAULT_MAX_UPLOAD_MB))
    except ValueError:
        return DEFAULT_MAX_UPLOAD_MB
    return value if value > 0 else DEFAULT_MAX_UPLOAD_MB


def configured_roots(
    home: str | Path | None = None, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
) -> list[Path]:
    """The library home plus K3LAB_ROOTS entries (default: the current folder), resolved and de-duplicated."""
    env = os.environ if env is None else env
    home = home_dir(env) if home is None else home
    value = env.get(ROOTS_ENV, "")
    extra = [p for p in value.split(os.pathsep) if p.strip()] if value.strip() else [str(cwd or os.getcwd())]
    roots: list[Path] = []
    for entry in [str(home), *extra]:
        root = Path(entry.strip()).expanduser().resolve()
        if root not in roots:
            roots.append(root)
    return roots


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def job_memory_bytes(env: Mapping[str, str] | None = None) -> int:
    """The memory budget of the long jobs and their kept results: $K3LAB_JOB_MEMORY ("6GB", "512MiB") when readable,
    else JOB_MEMORY_SHARE of the machine's memory (4 GiB where that is unknown)."""
    from k3core.utils.units import parse_bytes

    env = os.environ if env is None else env
    value = env.get(JOB_MEMORY_ENV, "").strip()
    if value:
        try:
            return int(parse_bytes(value, what="the job memory"))
        except ValueError:
            pass
    return int(machine_memory_bytes() * JOB_MEMORY_SHARE) or 4 * 1024**3
