"""docs/ARCHITECTURE.md's module map is the one map of the code: it names every module of k3core, analysis, app
and k3lab (a package folder names its ``__init__.py``), and every path it names exists."""

from pathlib import Path

from tests.repo.test_docs_layout import PACKAGES, section, tree_paths

ROOT = Path(__file__).resolve().parents[2]


def unnamed_modules(root: Path, named: set[str]) -> list[str]:
    """The .py files of the packages that the map does not name (an ``__init__.py`` counts as named with its
    folder)."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel or rel in named:
                continue
            if path.name == "__init__.py" and rel.removesuffix("__init__.py") in named:
                continue
            out.append(rel)
    return sorted(out)


def map_paths(root: Path = ROOT) -> set[str]:
    return set(tree_paths(section((root / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), "Module map")))


def test_the_module_map_names_every_module():
    named = map_paths()
    assert len(named) > 150 and "k3core/interp/recorder.py" in named  # the map was read
    assert unnamed_modules(ROOT, named) == []


def test_every_path_the_module_map_names_exists():
    assert sorted(p for p in map_paths() if not (ROOT / p).exists()) == []


def test_the_readme_points_at_the_module_map_instead_of_a_copy():
    layout = section((ROOT / "README.md").read_text(encoding="utf-8"), "Layout")
    assert "docs/ARCHITECTURE.md" in layout
    assert len(tree_paths(layout)) < 5  # a pointer, not a second tree


def test_the_check_finds_an_unnamed_module(tmp_path):
    for rel in ("k3core/__init__.py", "k3core/a.py", "k3core/sub/__init__.py", "k3core/sub/b.py", "app/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    named = {"k3core/", "k3core/a.py", "k3core/sub/"}
    assert unnamed_modules(tmp_path, named) == ["app/c.py", "k3core/sub/b.py"]
