"""k3lab: the Streamlit app. Run with ``k3lab app [RUN ...]`` or ``streamlit run app/main.py``.

Checkpoint folders to preload come from the ``K3LAB_RUNS`` environment variable (os.pathsep-joined);
the shipped ``sample_checkpoints/*`` and uploaded checkpoints are always offered too. The sidebar holds
the inputs every page shares (run, text, max tokens, device, dtype, options); pages are thin: they pick
inputs, call ``analysis`` / ``k3core``, show figures and offer exports.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from analysis.figures.style import use_k3lab_template  # noqa: E402
from app import page_registry  # noqa: E402
from app.library import run_list  # noqa: E402
from app.library.roots import descriptor_check  # noqa: E402
from app.render import prefetch, view_cache  # noqa: E402
from app.render.errors import shown_errors  # noqa: E402
from app.state import links, sidebar  # noqa: E402
from k3core.utils.files import checked_opens  # noqa: E402

# Not "pages/": a folder of that name next to the main script switches on Streamlit's older multipage mode.
PAGES_DIR = Path(__file__).resolve().parent / "page_scripts"

# A local image: a Material icon name makes the browser fetch the favicon from fonts.gstatic.com (nothing may come
# from a public CDN).
FAVICON = str(Path(__file__).resolve().parent / "favicon.png")
use_k3lab_template()  # streamlit's import made its own template plotly's default (app.server.serve imports us first)
st.set_page_config(page_title="k3lab", page_icon=FAVICON, layout="wide", initial_sidebar_state="expanded")


def _st_page(entry: page_registry.Page, default: bool = False, url_path: str | None = None, hidden: bool = False):
    # url_path per page: a link to /moe opens that page
    return st.Page(
        str(PAGES_DIR / f"{entry.name}.py"),
        title=entry.title,
        icon=entry.icon,
        default=default,
        url_path=url_path or entry.url_path,
        visibility="hidden" if hidden else "visible",
    )


def _navigation() -> dict[str, list]:
    """The sidebar from the page registry (app.page_registry). The default page is served at "/" (its own path, "home",
    is only reserved); its hidden twin makes a link to /overview open it too, instead of "Page not found"."""
    out: dict[str, list] = {}
    for group, entries in page_registry.sidebar_groups().items():
        out[group] = []
        for entry in entries:
            if entry == page_registry.DEFAULT:
                out[group] += [_st_page(entry, default=True, url_path="home"), _st_page(entry, hidden=True)]
            else:
                out[group].append(_st_page(entry))
    return out


# expanded: with more than twelve pages Streamlit shows ten and hides the rest behind "View N more" (Survey, Generate
# and the Runs library were hidden)
navigation = st.navigation(_navigation(), expanded=True)
view_cache.kept_results_follow_clear_cache()  # "Clear cache" clears the kept traces and figures too
# Every checkpoint file this script run opens is checked on its descriptor: a regular file with one link,
# inside the folders the app may read (a link or hard link swapped in after a check is refused at open).
with prefetch.script_run(), checked_opens(descriptor_check(run_list.readable_folders)):
    # Whatever the sidebar or a page raises (a damaged library index, a hostile checkpoint) becomes a message
    # on the page; the server keeps serving every session.
    with shown_errors("The sidebar"):
        sidebar.sidebar()
    links.show_notes(navigation.url_path)
    with shown_errors():
        navigation.run()
