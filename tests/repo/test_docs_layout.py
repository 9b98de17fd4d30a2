"""The README's Layout section and docs/ARCHITECTURE.md match the tree: every file or folder their module maps
name exists, and every dotted name (``analysis.runs.loading.load_run``) in ARCHITECTURE.md is a module or something a
module defines."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("k3core", "analysis", "app", "k3lab")
_PATH = re.compile(r"^[\w.-]+/?$")
_ENTRY = re.compile(r"^( +)(\S.*?)(?: {2,}|$)")
_SLASH_PATH = re.compile(r"\b(?:k3core|analysis|app|k3lab|docs|tests|benchmarks)/[\w./]*")
_DOTTED = re.compile(r"\b(?:k3core|analysis|app|k3lab)(?:\.(?!py\b|md\b)\w+)+")


def section(text: str, title: str) -> str:
    """The text of a ``## title`` section (up to the next ``## ``)."""
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def tree_paths(block: str) -> list[str]:
    """Paths named by an indented tree: each line ``<indent>name[, name...]  description``; a name ending in
    ``/`` is a folder holding the deeper-indented lines below it. Lines whose first column is not a list of
    file or folder names (wrapped descriptions) name nothing."""
    parents: list[tuple[int, str]] = []  # (indent, folder)
    out = []
    for line in block.splitlines():
        m = _ENTRY.match(line)
        if not m or not line.startswith("    "):
            continue
        indent, names = len(m.group(1)), [n.strip() for n in m.group(2).split(",")]
        if not all(_PATH.match(n) for n in names):
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        prefix = "".join(folder for _, folder in parents)
        out += [prefix + n for n in names]
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, names[0]))
    return out


def missing_paths(text: str, tree: str) -> list[str]:
    named = tree_paths(tree) + [p.rstrip(".") for p in _SLASH_PATH.findall(text)]
    return sorted({p for p in named if not (ROOT / p).exists()})


def defines(module_file: Path, name: str) -> bool:
    source = module_file.read_text(encoding="utf-8")
    pattern = rf"^(?:def|class|async def) {name}\b|^{name}\s*[:=]|^\s+def {name}\b|\bimport .*\b{name}\b|^\s+{name}:"
    return re.search(pattern, source, re.M) is not None


def unknown_dotted_names(text: str) -> list[str]:
    """Dotted names whose longest module prefix does not define the next part."""
    bad = []
    for dotted in sorted(set(_DOTTED.findall(text))):
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:k])
            module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if module.is_file():
                if k < len(parts) and not defines(module, parts[k]):
                    bad.append(dotted)
                break
        else:
            bad.append(dotted)
    return bad


def test_readme_layout_names_only_what_exists():
    layout = section((ROOT / "README.md").read_text(encoding="utf-8"), "Layout")
    assert "docs/ARCHITECTURE.md" in layout and "k3core/" in layout  # the section was read
    assert missing_paths(layout, layout) == []


def test_architecture_names_only_what_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    tree = section(text, "Module map")
    paths = tree_paths(tree)
    assert "k3core/ops/kda/gate.py" in paths and "app/page_scripts/runs_library.py" in paths
    assert missing_paths(text, tree) == []
    assert unknown_dotted_names(text) == []


def test_diagnostics_names_only_functions_that_exist():
    text = (ROOT / "docs" / "DIAGNOSTICS.md").read_text(encoding="utf-8")
    table = section(text, "One function per quantity")
    assert len(_DOTTED.findall(table)) > 20  # the table was read
    assert unknown_dotted_names(text) == []


def test_architecture_names_every_package_folder():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    named = set(tree_paths(section(text, "Module map")))
    folders = {f"{p.relative_to(ROOT).as_posix()}/" for pkg in PACKAGES for p in [ROOT / pkg, *(ROOT / pkg).rglob("*")]
               if p.is_dir() and (p / "__init__.py").is_file() or p.name == "page_scripts"}  # fmt: skip
    assert folders and folders <= named, sorted(folders - named)


def test_the_checks_find_what_is_missing():
    tree = "    k3core/    the model\n      __init__.py    the front\n      nowhere.py, ops/   gone\n" \
           "      ops/\n        norm.py, lost.py\n                   wrapped text, not names\n"  # fmt: skip
    assert tree_paths(tree) == ["k3core/", "k3core/__init__.py", "k3core/nowhere.py", "k3core/ops/", "k3core/ops/",
                                "k3core/ops/norm.py", "k3core/ops/lost.py"]  # fmt: skip
    assert missing_paths("see analysis/nothing.py", tree) == ["analysis/nothing.py", "k3core/nowhere.py",
                                                              "k3core/ops/lost.py"]  # fmt: skip
    assert unknown_dotted_names("analysis.runs.loading.load_run, analysis.runs.loading.no_such, analysis.gone.x") == [
        "analysis.gone.x",
        "analysis.runs.loading.no_such",
    ]
