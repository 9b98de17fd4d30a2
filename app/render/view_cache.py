"""The figure cache: a view's figure and table, a run's headline numbers and the two-run comparisons, built once per
(view, run key) on the contexts ``app.render.caching`` loads and kept among the server's finished results
(``app.server.kept_results``, bounded by bytes); nothing here computes a metric or draws."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import streamlit as st

from analysis.runs import job_memory
from analysis.views.view import NotApplicable
from app.render.caching import Loaded
from app.render.model_use import model_use
from app.server import job_budget
from app.state.inputs import InputError


def _cached_view(view_key: str, key: tuple, build, ctx) -> tuple:
    """(figure, table, None) of a view on a context, or (None, None, why it does not apply), kept among the server's
    finished results. The reason is kept as text, not as the exception: a raised exception's traceback holds the
    frames of the build, whose locals hold the context and its trace."""

    def make() -> tuple:
        try:
            fig, df = build(ctx)
        except NotApplicable as exc:  # kept too: "does not apply" is an answer, not a failure
            return None, None, str(exc)
        return fig, df, None

    return job_budget.budget().kept.get(("view", view_key, key), make, job_memory.held_bytes)


def build_view(view, loaded: Loaded):
    """(figure, table) of a View for a loaded run, cached per (view, run key). Raises NotApplicable."""
    if view.needs_model and loaded.model is not None:
        with model_use(loaded.model, exclusive=True):  # importance views hook into the shared model
            fig, df, na = _cached_view(view.key, loaded.key, view.build, loaded.ctx)
    else:
        fig, df, na = _cached_view(view.key, loaded.key, view.build, loaded.ctx)
    if na is not None:
        raise NotApplicable(na)
    return fig, df


@st.cache_resource(show_spinner=False, max_entries=64)
def _cached_headline(key: tuple, _ctx) -> dict[str, Any]:
    from analysis.metrics.headline import headline_numbers

    return headline_numbers(_ctx)


def headline(loaded: Loaded) -> dict[str, Any]:
    """analysis.metrics.headline.headline_numbers of a loaded run, cached per run key."""
    return _cached_headline(loaded.key, loaded.ctx)


def cached_build(view, *loadeds: Loaded):
    """The same View, its build served from the figure cache for these loaded runs' contexts.

    Lets analysis.compare.two_runs build side-by-side and difference figures without recomputing a view."""
    by_ctx = {id(loaded.ctx): loaded for loaded in loadeds}

    def build(ctx):
        loaded = by_ctx.get(id(ctx))
        return build_view(view, loaded) if loaded is not None else view.build(ctx)

    return replace(view, build=build)


def _cached_both(view, a: Loaded, b: Loaded) -> list:
    """analysis.compare.two_runs.build_both: each run's figure (or its NotApplicable), asked of the figure cache once
    for both comparisons, side by side and difference (as ``analysis.output.report`` builds them); kept among the
    server's finished results."""
    from analysis.compare import two_runs as compare

    def make() -> list:  # a NotApplicable as a fresh one, never raised: no traceback keeps a context alive
        built = compare.build_both(cached_build(view, a, b), a.ctx, b.ctx)
        return [NotApplicable(str(r)) if isinstance(r, NotApplicable) else r for r in built]

    return job_budget.budget().kept.get(("both", view.key, a.key, b.key), make, job_memory.held_bytes)


def _cached_pair(kind: str, view, a: Loaded, b: Loaded) -> tuple:
    from analysis.compare import two_runs as compare

    def make() -> tuple:
        fn = compare.side_by_side if kind == "side" else compare.difference_view
        built = None if view.compare.overlay else _cached_both(view, a, b)
        try:
            fig, df = fn(cached_build(view, a, b), a.ctx, b.ctx, built=built)
        except NotApplicable as exc:
            return None, None, str(exc)
        return fig, df, None

    return job_budget.budget().kept.get(("pair", kind, view.key, a.key, b.key), make, job_memory.held_bytes)


def compare_view(kind: str, view, a: Loaded, b: Loaded):
    """analysis.compare.two_runs.side_by_side (kind "side") or difference_view (kind "diff"), cached. May raise
    NotApplicable."""
    if kind not in ("side", "diff"):
        raise InputError(f"unknown comparison {kind!r}")
    fig, df, na = _cached_pair(kind, view, a, b)
    if na is not None:
        raise NotApplicable(na)
    return fig, df


def _clear_kept(_: object) -> None:
    job_budget.budget().kept.clear()


@st.cache_resource(show_spinner=False, on_release=_clear_kept)
def kept_results_follow_clear_cache() -> bool:
    """Ties the kept results to Streamlit's "Clear cache" (the app menu, or C): that clears every ``st.cache_resource``
    (``st.cache_resource.clear()``) and releases this one's entry, whose release clears the kept results, which no
    Streamlit cache holds. Called on every script run (app/main.py), so that each clear finds it registered again."""
    return True
