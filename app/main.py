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
from app.library import run_list  # noqa: E402
from app.library.roots import descriptor_check  # noqa: E402
from app.render import prefetch  # noqa: E402
from app.render.errors import shown_errors  # noqa: E402
from app.state import links, sidebar  # noqa: E402
from k3core.utils.files import checked_opens  # noqa: E402

# Not "pages/": a folder of that name next to the main script switches on Streamlit's older multipage mode.
PAGES_DIR = Path(__file__).resolve().parent / "app_pages"

# A local image: a Material icon name makes the browser fetch the favicon from fonts.gstatic.com (nothing may come
# from a public CDN).
FAVICON = str(Path(__file__).resolve().parent / "favicon.png")
use_k3lab_template()  # streamlit's import made its own template plotly's default (app.server.serve imports us first)
st.set_page_config(page_title="k3lab", page_icon=FAVICON, layout="wide", initial_sidebar_state="expanded")


def _page(name: str, title: str, icon: str, default: bool = False, url_path: str | None = None, hidden: bool = False):
    # url_path per page: a link to /moe opens that page
    return st.Page(
        str(PAGES_DIR / f"{name}.py"),
        title=title,
        icon=icon,
        default=default,
        url_path=url_path or name,
        visibility="hidden" if hidden else "visible",
    )


PAGES = {
    "Model": [
        # The default page is served at "/" (its own path, "home", is only reserved); the hidden twin
        # makes a link to /overview open the Overview too, instead of Streamlit's "Page not found".
        _page("overview", "Overview", ":material/home:", default=True, url_path="home"),
        _page("overview", "Overview", ":material/home:", hidden=True),
        _page("weights", "Weights", ":material/scale:"),
    ],
    "Mechanisms": [
        _page("density", "KDA & density", ":material/memory:"),
        _page("attnres", "AttnRes", ":material/layers:"),
        _page("moe", "LatentMoE", ":material/hub:"),
        _page("degradation", "Degradation", ":material/monitor_heart:"),
        _page("long_context", "Long context", ":material/straighten:"),
    ],
    "Runs": [
        _page("compare", "Compare", ":material/compare:"),
        _page("history", "Training history", ":material/show_chart:"),
    ],
    "Tools": [
        _page("experiment", "Experiment", ":material/science:"),
        _page("survey", "Survey", ":material/query_stats:"),
        _page("generate", "Generate", ":material/edit_note:"),
        _page("runs_library", "Runs library", ":material/folder_open:", url_path="upload"),
    ],
}

navigation = st.navigation(PAGES)
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
