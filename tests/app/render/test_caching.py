"""One figure path: how often a page enters analysis.runs.loading and app.render.caching, counted through the real app
(AppTest).

Every module-level function of both modules is wrapped with a counter; a call from outside the module counts
as one entry (calls the module makes to itself do not). A page loads its run, tokens and trace once, and asks
the figure cache once per figure; analysis.runs.loading is entered only for work not done yet (load, tokens, trace).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from analysis.figures.papers import MODEL_RUNS
from analysis.runs import loading as runs_mod
from analysis.runs import texts as texts_mod
from analysis.views.catalogue import section_views
from app.library import run_list
from app.render import caching, page_scaffold, view_cache
from app.server.settings import HOME_ENV
from k3core.modeling.model import K3ForCausalLM

APP = Path(__file__).resolve().parents[3] / "app" / "main.py"
SECTION = "attnres"  # a section without the importance button, drawn whole here (its "show the rest" turned on)


def _drawn_views() -> list:
    """The section's views drawn on opening: a view that runs the model (analysis.figures.papers.MODEL_RUNS, e.g. issue
    40's attnres_causal_sources) waits for its own button and is built only when pressed."""
    return [v for v in section_views(SECTION) if v.key not in MODEL_RUNS]


# called on every script run to tie the kept results to "Clear cache" (app/main.py): bookkeeping, not figure work
NOT_COUNTED = {"kept_results_follow_clear_cache"}


class Entries:
    """Entries into analysis.runs.loading and app.render.caching (with its figure cache, app.render.view_cache), per
    function, and how often each (view, run) figure was asked of the figure cache (``build_view``, from anywhere)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.figures: collections.Counter = collections.Counter()
        self._inside = threading.local()
        for module in (runs_mod, texts_mod, caching, view_cache):
            for name, fn in list(vars(module).items()):
                if self._counted(module, fn) and name not in NOT_COUNTED:
                    monkeypatch.setattr(module, name, self._wrap(module, name, fn))

    @staticmethod
    def _counted(module, fn) -> bool:
        if isinstance(fn, type) or not callable(fn):
            return False
        return getattr(fn, "__module__", None) == module.__name__ or type(fn).__name__.startswith("Cached")

    def _wrap(self, module, name: str, fn):
        # analysis.runs.texts (the inputs a run reads) was split out of analysis.runs.loading: its entries count as
        # runs'; app.render.view_cache (the figure cache) was split out of app.render.caching: its entries count as
        # caching's
        short = "runs" if module in (runs_mod, texts_mod) else "caching"

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if threading.current_thread().name == "k3lab-prefetch":
                # an earlier test's background builds may still be running in this process: not this page's work
                return fn(*args, **kwargs)
            depth = getattr(self._inside, short, 0)
            if depth == 0:  # entered from outside the module
                self.calls[f"{short}.{name}"] += 1
            if name == "build_view":  # from a page or from a comparison
                self.figures[(args[0].key, args[1].key)] += 1
            setattr(self._inside, short, depth + 1)
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self._inside, short, depth)

        return counted

    def of(self, module: str) -> dict[str, int]:
        return {k.partition(".")[2]: n for k, n in self.calls.items() if k.startswith(module + ".")}

    def clear(self) -> None:
        self.calls.clear()
        self.figures.clear()


@pytest.fixture
def app(monkeypatch, tmp_path):
    """Two fresh k3-nano runs (their own fingerprints: nothing cached by other tests), no shipped samples, no
    background builds (they would enter the cache for other pages' figures while a page is counted)."""
    folders = []
    for seed, name in ((10, "count-a"), (11, "count-b")):
        torch.manual_seed(seed)
        folders.append(K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path / name))
        (tmp_path / name / "README.md").write_text(f"# {name}\n")
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(run_list.RUNS_ENV, os.pathsep.join(str(f) for f in folders))
    (tmp_path / "no-samples").mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", tmp_path / "no-samples")
    monkeypatch.setattr(page_scaffold, "prefetch_sections", lambda loaded: None)
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.session_state["k3lab_max_tokens"] = 33  # a token count no other test uses
    at.session_state[f"k3lab_show_all_{SECTION}"] = True  # every view of the section, and of its comparison
    at.session_state[f"k3lab_show_all_cmp_{SECTION}"] = True
    return at


def _shown(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == []


def test_each_figure_enters_the_cache_once_and_analysis_runs_only_for_new_work(app, monkeypatch):
    entries = Entries(monkeypatch)
    app.run()  # the Overview, nothing cached yet: one load, one tokenisation, one trace
    _shown(app)
    assert entries.of("runs") == {"load_run": 1, "sample_input": 1, "trace_run": 1, "read_card_text": 1}
    overview = {"load_run": 1, "make_tokens": 1, "trace": 1, "build_view": 1, "headline": 1, "run_card": 1}
    # the layer map's context, read before the run loads (app.render.page_scaffold.config_context): both cached by
    # file stamps
    overview |= {"run_fingerprint": 1, "run_metrics": 1}
    assert entries.of("caching") == overview  # the run once, though the layer map and headline numbers use it
    for _ in range(2):  # a rerun (any widget) finds everything cached: analysis.runs.loading is not entered
        entries.clear()
        app.run()
        _shown(app)
        assert entries.of("runs") == {} and entries.of("caching") == overview

    views = _drawn_views()
    entries.clear()
    app.switch_page(f"page_scripts/{SECTION}.py").run()
    _shown(app)
    assert entries.of("runs") == {}
    assert entries.of("caching") == {"load_run": 1, "make_tokens": 1, "trace": 1, "build_view": len(views)}
    assert set(entries.figures.values()) == {1} and len(entries.figures) == len(views)


def test_a_comparison_builds_each_runs_figure_once(app, monkeypatch):
    app.session_state["k3lab_cmp_section"] = SECTION
    app.run()
    entries = Entries(monkeypatch)
    app.switch_page("page_scripts/compare.py").run()  # run B is loaded here for the first time
    _shown(app)
    assert entries.of("runs") == {"load_run": 1, "sample_input": 1, "trace_run": 1}
    views = _drawn_views()
    # side by side and difference draw from one build of each run's figure
    assert set(entries.figures.values()) == {1} and len(entries.figures) == 2 * len(views)
    calls = entries.of("caching")
    assert len(views) <= calls.pop("compare_view") <= 2 * len(views)  # side by side, and a difference where one is
    assert calls == {"load_run": 2, "make_tokens": 2, "trace": 2, "headline": 2}

    entries.clear()
    app.run()
    _shown(app)
    assert entries.of("runs") == {} and entries.figures == {}  # the pairs are cached
