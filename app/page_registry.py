"""The page registry: every page of the app once, with its title, icon, URL path, sidebar group and the section of
views it shows.

Navigation (``app/main.py``), every page's heading, the links and mentions between pages, Compare's sections, the
README's page list and the tests all read this table; no page title is written anywhere else
(``tests/app/test_page_registry.py`` checks it). It imports nothing from streamlit, so a test or a benchmark can read it
without streamlit's plotly template becoming the default.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUPS = ("Model", "Mechanisms", "Runs", "Tools")  # the sidebar's groups, in order


@dataclass(frozen=True)
class Page:
    """One page. ``name``: its script ``app/page_scripts/<name>.py``; ``url_path``: it opens at ``/<url_path>``;
    ``section``: the ``View.section`` of the catalogue views it shows (``analysis.views.catalogue.section_views``;
    "weights": every view drawn from the weights alone), None for a page without catalogue views."""

    name: str
    title: str
    icon: str
    group: str
    url_path: str
    section: str | None = None

    @property
    def file(self) -> str:
        """The page script, relative to ``app/`` (what ``st.Page`` and ``AppTest.switch_page`` take)."""
        return f"page_scripts/{self.name}.py"

    def link(self, query: str = "") -> str:
        """The page's address in this app: ``/compare`` or ``/compare?mode=edited``."""
        return f"/{self.url_path}" + (f"?{query}" if query else "")

    @property
    def mention(self) -> str:
        """How a message names the page: ``**Runs library** page``."""
        return f"**{self.title}** page"


PAGES = (
    # The default page (the first) is served at "/"; app/main.py also opens it at its own /overview.
    Page("overview", "Overview", ":material/home:", "Model", "overview"),
    Page("weights", "Weights", ":material/scale:", "Model", "weights", section="weights"),
    Page("density", "KDA & density", ":material/memory:", "Mechanisms", "density", section="density"),
    Page("attnres", "AttnRes", ":material/layers:", "Mechanisms", "attnres", section="attnres"),
    Page("moe", "LatentMoE", ":material/hub:", "Mechanisms", "moe", section="moe"),
    Page("degradation", "Degradation", ":material/monitor_heart:", "Mechanisms", "degradation", section="degradation"),
    Page("long_context", "Long context", ":material/straighten:", "Mechanisms", "long_context", section="long_context"),
    Page("compare", "Compare", ":material/compare:", "Runs", "compare"),
    Page("history", "Training history", ":material/show_chart:", "Runs", "history", section="history"),
    Page("experiment", "Experiment", ":material/science:", "Tools", "experiment", section="experiment"),
    Page("survey", "Survey", ":material/query_stats:", "Tools", "survey"),
    Page("generate", "Generate", ":material/edit_note:", "Tools", "generate"),
    Page("runs_library", "Runs library", ":material/folder_open:", "Tools", "upload"),
)
BY_NAME = {p.name: p for p in PAGES}
DEFAULT = PAGES[0]

# The sections Compare offers, in its order: every page's views but training history's (each run's history is
# overlaid on its own page, from metrics.json, not drawn per text).
COMPARE_SECTIONS = ("density", "attnres", "moe", "degradation", "long_context", "weights", "experiment")


def page(name: str) -> Page:
    """The registered page of a script name (``"compare"``); a KeyError names the known ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no page {name!r} is registered; known: {sorted(BY_NAME)}") from None


def page_for_section(section: str) -> Page:
    """The page that shows a section's views."""
    return next(p for p in PAGES if p.section == section)


def compare_sections() -> dict[str, str]:
    """Compare's sections: {section: the title of the page that shows it}, in Compare's order."""
    return {s: page_for_section(s).title for s in COMPARE_SECTIONS}


def sidebar_groups() -> dict[str, list[Page]]:
    """The pages by sidebar group, groups and pages in registry order."""
    return {g: [p for p in PAGES if p.group == g] for g in GROUPS}


def readme_list() -> str:
    """The README's page list: groups joined by "; ", pages by ", " (tests/app/test_page_registry.py compares it)."""
    return "; ".join(", ".join(p.title for p in group) for group in sidebar_groups().values())
