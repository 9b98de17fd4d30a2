"""Figures built in the background while nobody waits: the first visit to a page finds them cached.

A page that has drawn its own figures calls ``prefetch(views, loaded)``: one thread per (run, text,
options) builds those views through the same cache the pages use (``app.render.view_cache.build_view``'s
``st.cache_resource``). The thread works only while no script run is in progress (``main.py`` wraps each
run in ``script_run()``) and checks between views, so it never slows the page someone is waiting for (a page queued
for job memory is not working: the builds go on, and free the result it may be waiting for).
Views that run the model (the importance ablations) are left to their button.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

from analysis.views.view import View
from app.render import view_cache
from app.render.caching import Loaded
from app.server import job_budget

_IDLE = threading.Condition()
_RUNNING = 0  # script runs in progress, every session together
_DONE: set[tuple] = set()
QUEUE_POLL_S = 0.25


@contextlib.contextmanager
def script_run() -> Iterator[None]:
    """Mark a script run in progress (background builds pause until none is)."""
    global _RUNNING
    with _IDLE:
        _RUNNING += 1
    try:
        yield
    finally:
        with _IDLE:
            _RUNNING -= 1
            _IDLE.notify_all()


def _wait_idle() -> None:
    """Until no script run is in progress, those waiting for job memory aside: a page queued behind a job whose
    result these builds hold would otherwise wait for them, and they for it (re-checked every QUEUE_POLL_S, since a
    page starts waiting outside this lock)."""
    with _IDLE:
        while not _IDLE.wait_for(lambda: _RUNNING <= job_budget.budget().queued, timeout=QUEUE_POLL_S):
            pass


def prefetch(views: list[View], loaded: Loaded) -> None:
    """Build these views' figures for a loaded run in a background thread, once per run key."""
    todo = [v for v in views if not v.needs_model]
    with _IDLE:
        if loaded.key in _DONE or not todo:
            return
        _DONE.add(loaded.key)

    def work() -> None:
        for view in todo:
            _wait_idle()
            try:
                view_cache.build_view(view, loaded)
            except Exception:  # noqa: BLE001, S112 - the page that shows the view reports its error
                continue

    # The page's context goes along: its checked opens of checkpoint files (k3core.utils.files.checked_opens) too.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="k3lab-prefetch", daemon=True)
    add_script_run_ctx(thread, get_script_run_ctx())
    thread.start()
