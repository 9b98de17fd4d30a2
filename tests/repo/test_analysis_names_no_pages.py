"""analysis never imports streamlit, so its messages cannot name the app's pages or sidebar either: a message shown
by the app, the CLI and the report alike ("set on the Experiment page") is wrong outside the app. The app adds its
own links (``app.page_registry.Page.mention``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from app import page_registry
from tests.repo.scan import docstring_nodes

ROOT = Path(__file__).resolve().parents[2]


def app_ui_mentions(folder: Path) -> list[str]:
    """``path:line: text`` of every string constant (docstrings aside) under ``folder`` that names one of the app's
    pages ("the Weights page", "Experiment page") or its sidebar."""
    titles = "|".join(re.escape(p.title) for p in page_registry.PAGES)
    pattern = re.compile(rf"\b({titles}) page\b|\bsidebar\b|\bon (its|this|that) own page\b", re.IGNORECASE)
    out = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = docstring_nodes(tree)
        found = sorted(
            (node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            if pattern.search(node.value)
        )
        out += [f"{path.relative_to(folder.parent).as_posix()}:{n}: {text[:80]}" for n, text in found]
    return out


def test_analysis_messages_name_no_app_page():
    assert app_ui_mentions(ROOT / "analysis") == []


def test_the_scan_finds_a_page_named_in_a_message(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        '"""Drawn on the Weights page (a docstring: fine)."""\n'
        "def f(what):\n"
        '    """The Compare page (fine)."""\n'
        '    raise ValueError(f"no {what}: it is set on the Experiment page")\n'
        'TITLE = "tick it in the sidebar"\n'
    )
    found = app_ui_mentions(pkg)
    assert [f.split(":")[1] for f in found] == ["4", "5"], found
