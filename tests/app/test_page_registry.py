"""The page registry (app.page_registry) is the one list of pages: every page script is registered, every
registered page opens in AppTest with its title as heading, the README's page list and Compare's sections are the
registry's, and no page title is written anywhere else in the app, the tests or the benchmarks (the check finds a
planted copy)."""

from __future__ import annotations

import ast
from pathlib import Path

from streamlit.testing.v1 import AppTest

from analysis.views.catalogue import all_views, section_views
from app import page_registry
from tests.app.apptest_helpers import APP, MAX_TOKENS, TIMEOUT, charts, errors
from tests.repo.scan import docstring_nodes

ROOT = Path(__file__).resolve().parents[2]
# Where pages are named: the app, the command line, the tests of the app and the benchmarks. (analysis/ never imports
# app, and its strings "AttnRes", "LatentMoE" name mechanisms and layer kinds, not pages.)
SCANNED = ("app", "k3lab", "tests/app", "benchmarks")
REGISTRY = "app/page_registry.py"
DRAWN_AT_OPEN = ("weights", "density", "attnres", "moe", "degradation")  # pages whose figures need no click


def title_copies(root: Path, titles: list[str], folders=SCANNED, registry: str = REGISTRY) -> list[str]:
    """``path:line: 'text'`` of every string literal outside the registry (docstrings aside) that is a page title,
    or names one in a message (``**Title**``, ``Title page``)."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == registry or "__pycache__" in rel:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            skip = docstring_nodes(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
                    continue
                text = node.value
                if any(text == t or f"**{t}**" in text or f"{t} page" in text for t in titles):
                    out.append(f"{rel}:{node.lineno}: {text[:60]!r}")
    return out


TITLES = [p.title for p in page_registry.PAGES]


def test_every_page_script_is_registered_once_and_every_entry_has_its_script():
    scripts = sorted(p.stem for p in (ROOT / "app" / "page_scripts").glob("*.py"))
    names = [p.name for p in page_registry.PAGES]
    assert sorted(names) == scripts
    assert len(set(names)) == len(names) and len(set(TITLES)) == len(TITLES)
    assert len({p.url_path for p in page_registry.PAGES}) == len(page_registry.PAGES)
    assert {p.group for p in page_registry.PAGES} == set(page_registry.GROUPS)
    assert page_registry.DEFAULT.name == "overview"


def test_every_section_of_a_page_has_views_and_every_view_section_has_a_page():
    sections = {p.section for p in page_registry.PAGES if p.section}
    assert sections == {v.section for v in all_views()} | {"weights"}
    for section in sections:
        assert section_views(section), section
    assert set(page_registry.COMPARE_SECTIONS) <= sections
    assert page_registry.compare_sections()["density"] == page_registry.page("density").title


def test_the_readme_lists_the_registered_pages_in_sidebar_order():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"**Pages** (in the sidebar's order): {page_registry.readme_list()}." in readme


def test_no_page_title_is_written_outside_the_registry():
    assert title_copies(ROOT, TITLES) == []


def test_the_title_check_finds_a_planted_copy(tmp_path):
    compare, library = page_registry.page("compare").title, page_registry.page("runs_library").title
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "page_registry.py").write_text(f"TITLE = {compare!r}\n")  # the registry itself: allowed
    planted = (
        f'"""A docstring may say {compare}."""\n'  # prose: allowed
        f"HEADING = {compare!r}\n"
        f"NOTE = 'add one on the **{library}** page'\n"
        f"LINK = 'on the {compare} page'\n"
        "OTHER = 'Compare mode'\n"
    )
    (tmp_path / "app" / "x.py").write_text(planted)
    found = title_copies(tmp_path, TITLES, folders=("app",))
    assert [f.split(": ")[0] for f in found] == ["app/x.py:2", "app/x.py:3", "app/x.py:4"], found


def test_every_registered_page_opens_with_its_title_as_heading(app_env, runs):  # noqa: F811 - fixtures
    app_env(runs["good"], runs["other"])
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = MAX_TOKENS
    at.session_state["k3lab_cmp_section"] = "attnres"  # density's importance is measured on request
    at.run()
    for entry in page_registry.PAGES:
        at.switch_page(entry.file).run()
        assert not at.exception, (entry.name, [e.value for e in at.exception])
        assert errors(at) == [], (entry.name, errors(at))
        assert [t.value for t in at.title] == [entry.title], entry.name
        if entry.name in DRAWN_AT_OPEN:
            assert charts(at) >= 2, entry.name
        if entry.name == "compare":
            assert list(at.radio(key="k3lab_cmp_section").options) == list(page_registry.compare_sections().values())


def test_compare_offers_the_registered_sections_and_links_accept_them():
    from app.state import links

    values, notes = links.from_params({"section": "experiment"}, [])
    assert values["k3lab_cmp_section"] == "experiment" and notes == []
    _, notes = links.from_params({"section": "history"}, [])  # not a Compare section
    assert notes and "section='history'" in notes[0]
