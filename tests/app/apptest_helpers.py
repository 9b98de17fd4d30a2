"""What the AppTest tests of the app share: where the app is, the script-run timeout, a k3-nano checkpoint folder,
a fresh AppTest, and readers of what a script run shows. The fixtures that use them (``runs``, ``app_env``) are in
tests/app/conftest.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from streamlit.testing.v1 import AppTest

from app import page_registry
from k3core.modeling.model import K3ForCausalLM

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app" / "main.py"
TIMEOUT = 180  # seconds per script run: generous for a loaded CI machine; typical runs take 1-5 s
MAX_TOKENS = 48

METRICS = {
    "history": [
        {"step": 0, "loss": 5.6, "val_bpb": 8.0, "tokens": 0},
        {"step": 50, "loss": 3.1, "val_bpb": 4.4, "tokens": 12800},
        {"step": 100, "loss": 2.6, "val_bpb": 3.7, "tokens": 25600},
    ]
}


def save_nano(path: Path, seed: int, metrics: dict | None = None) -> Path:
    """A random-init k3-nano of ``seed`` saved to ``path``, with a model card and (if given) a metrics.json."""
    torch.manual_seed(seed)
    K3ForCausalLM.from_config("k3-nano").save_pretrained(path)
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))
    (path / "README.md").write_text(f"# nano seed {seed}\n\nA random-init k3-nano for the app tests.\n")
    return path


def make_app(max_tokens: int = MAX_TOKENS) -> AppTest:
    """The app, not run yet, with texts cut to ``max_tokens``."""
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = max_tokens
    return at


def errors(at: AppTest) -> list[str]:
    """The error boxes' text as shown (the app escapes messages for Markdown: drop the escapes)."""
    return [re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", e.value) for e in at.error]


def charts(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


def open_page(at: AppTest, name: str) -> AppTest:
    """Switch to the registered page ``name`` and run it."""
    return at.switch_page(page_registry.page(name).file).run()


def table_with(at: AppTest, column: str):
    """The first table on the page with this column (AppTest does not expose a dataframe's key)."""
    tables = [d.value for d in at.dataframe] + [t.value.reset_index() for t in at.table]
    return next(t for t in tables if column in t.columns)
