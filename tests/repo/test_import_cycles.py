"""No import circle between modules of k3core, analysis, app and k3lab.

Every import counts: at the top of a module, inside a function (the usual way to dodge a circle at import
time) and under ``if TYPE_CHECKING``. A module importing ``pkg.mod`` depends on ``pkg.mod`` (on ``pkg``'s
``__init__`` only when it names the package itself), so a package re-exporting its own modules is no circle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("k3core", "analysis", "app", "k3lab")


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} for every .py file under the packages."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line of the first such import}}, for imports between ``modules``."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # `from pkg import mod` imports the module pkg.mod; `from pkg import name` the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                found = known(target)
                if found and found != name:
                    edges.setdefault(found, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each holds at least one circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def describe(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    edges = [f"  {a} -> {b} (line {line})" for a in group for b, line in graph[a].items() if b in group]
    return "\n".join([", ".join(group), *edges])


def test_no_import_circle_between_modules():
    modules = module_files(ROOT)
    assert len(modules) > 100 and "analysis.views.catalogue" in modules  # the packages were found
    graph = import_graph(modules)
    found = circles(graph)
    assert found == [], "import circles:\n" + "\n".join(describe(graph, g) for g in found)


def test_the_check_finds_a_circle_dodged_by_a_function_level_import(tmp_path):
    pkg = tmp_path / "k3core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import f\n")  # re-exporting its own module: no circle
    (pkg / "sub" / "leaf.py").write_text("def f():\n    return 1\n")
    (pkg / "a.py").write_text("from k3core.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from k3core import a  # dodged at import time, still a circle\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    modules = module_files(tmp_path, ("k3core",))
    graph = import_graph(modules)
    assert graph["k3core.b"] == {"k3core.a": 2} and graph["k3core.c"] == {"k3core.a": 3}
    assert circles(graph) == [["k3core.a", "k3core.b"]]
    (pkg / "b.py").write_text("def g():\n    return 2\n")
    assert circles(import_graph(module_files(tmp_path, ("k3core",)))) == []
