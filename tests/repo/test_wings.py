"""k3core's wings import only downward: the model's wing (``k3core.modeling``) imports no ``k3core.interp`` at any
level and ``k3core.loading`` only inside a function (the thin ``from_pretrained`` / ``save_pretrained`` calls; a
``TYPE_CHECKING`` import for an annotation runs never);
``k3core.loading`` imports no ``k3core.interp``; the decoder lives in the model's wing."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path, package: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, run at import time) for every import of a file of ``package``. An import under
    ``if TYPE_CHECKING:`` names a type for annotations and runs never: not at import time (the import-cycle test
    still counts it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out += [(name, node.lineno, id(node) in top) for name in names]
    return out


def wing_imports(wing: str) -> list[tuple[str, str, int, bool]]:
    out = []
    for path in sorted((ROOT / "k3core" / wing).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = ".".join(parts[:-1])
        rel = path.relative_to(ROOT).as_posix()
        out += [(rel, name, line, top) for name, line, top in imports(path, package)]
    return out


def reaches(name: str, wing: str) -> bool:
    return name == f"k3core.{wing}" or name.startswith(f"k3core.{wing}.")


def test_the_model_wing_imports_no_interp_and_loading_only_inside_functions():
    found = wing_imports("modeling")
    assert any(reaches(n, "ops") for _, n, _, _ in found)  # the imports were read
    assert [(f, n, line) for f, n, line, _ in found if reaches(n, "interp")] == []
    assert [(f, n, line) for f, n, line, top in found if reaches(n, "loading") and top] == []


def test_loading_imports_no_interp():
    found = wing_imports("loading")
    assert any(reaches(n, "modeling") for _, n, _, _ in found)
    assert [(f, n, line) for f, n, line, _ in found if reaches(n, "interp")] == []


def test_the_decoder_lives_in_the_model_wing():
    assert (ROOT / "k3core" / "modeling" / "model.py").is_file()
    assert sorted(p.name for p in (ROOT / "k3core").glob("*.py")) == ["__init__.py"]
