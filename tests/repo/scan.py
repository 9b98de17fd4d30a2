"""The one scan behind the "defined once" tests: every line of the project's Python that matches a pattern."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

#: the folders that hold the project's code (a concept written once must not be written again in any of them)
CODE_FOLDERS = ("k3core", "analysis", "app", "k3lab", "tests", "benchmarks", "scripts")


def matching_lines(root: Path, folders: Iterable[str], pattern: re.Pattern[str]) -> list[str]:
    """``path:line`` (path relative to ``root``, sorted by path) of every line of ``folders/**/*.py`` that
    ``pattern`` finds."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    out.append(f"{path.relative_to(root).as_posix()}:{n}")
    return out


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the module, class and function docstring nodes of ``tree``: prose for developers, which the scans of
    messages and titles skip."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out
