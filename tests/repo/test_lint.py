"""The code base passes ruff (the project's linter and formatter) with the settings in pyproject.toml, and every
public function of k3core and analysis has type hints."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401

        cmd = [sys.executable, "-m", "ruff"]
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.skip("ruff is not installed")
        cmd = ["ruff"]
    return subprocess.run([*cmd, *args, "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)


def test_ruff_check_passes():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_check_passes():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `ruff format` on these files:\n" + result.stdout + result.stderr


def _unannotated(path: Path, root: Path = ROOT) -> list[str]:
    """Public functions and methods of one module (names without a leading underscore, plus ``__init__``
    and other dunders, in public classes) with a parameter or the return left unannotated
    (``self``/``cls`` and ``__init__``'s return need none)."""
    out: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{prefix}{child.name}.")
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = child.name
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                continue
            a = child.args
            params = a.posonlyargs + a.args + a.kwonlyargs
            if isinstance(node, ast.ClassDef) and params and params[0].arg in ("self", "cls"):
                params = params[1:]
            missing = [p.arg for p in params if p.annotation is None]
            stars = ((a.vararg, "*"), (a.kwarg, "**"))
            missing += [f"{star}{v.arg}" for v, star in stars if v is not None and v.annotation is None]
            if child.returns is None and name != "__init__":
                missing.append("return")
            if missing:
                out.append(f"{path.relative_to(root)}:{child.lineno} {prefix}{name}: {', '.join(missing)}")

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def test_public_functions_of_k3core_and_analysis_are_annotated():
    files = sorted(p for package in ("k3core", "analysis") for p in (ROOT / package).rglob("*.py"))
    assert len(files) > 20  # the packages were found
    missing = [line for p in files for line in _unannotated(p)]
    assert missing == [], "add type hints:\n" + "\n".join(missing)


def test_the_annotation_check_finds_what_is_missing(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text(
        "class A:\n"
        "    def ok(self, x: int) -> int: ...\n"
        "    def bad(self, x): ...\n"
        "    def _private(self, y): ...\n"
        "def f(a: int, *rest, key=1, **kw: int) -> None: ...\n"
        "def g(a: int, **opts): ...\n"
        "class _Hidden:\n"
        "    def m(self, z): ...\n"
    )
    found = _unannotated(src, root=tmp_path)
    assert found == ["probe.py:3 A.bad: x, return", "probe.py:5 f: key, *rest", "probe.py:6 g: **opts, return"]
