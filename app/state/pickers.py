"""Layer and head pickers: one helper for every page that shows a per-layer or per-head view.

A view declares its axes and their choices (``View.picks``, ``analysis.views.picks``); ``view_pick`` draws a selectbox
per axis above the view ("MLA layer 3", "head 1", or "all ..." where the view can show all) and gives the
``Loaded`` the view is drawn from with the pick in its options (and in its cache key). The picks live in the
session under ``PICKS`` ({view key: {"layer": 3, "head": 1}}), which ``app.state.links`` writes into the address bar,
so a copied link reopens the same layer and head. A pick the run does not have (a link from another run, a
layer without that mechanism) gets a warning naming the valid ones and the view shows all.
"""

from __future__ import annotations

from dataclasses import replace

import streamlit as st

from analysis.runs.context import AnalysisContext
from analysis.views import picks as pk
from analysis.views import view as view_mod
from analysis.views.view import NotApplicable, View
from app.render.caching import Loaded
from app.render.errors import md_escape
from app.state import links
from app.state.links import PICKS

ALL = "all"  # the pickers' "every layer / head" choice (no pick)


def _store() -> dict[str, dict[str, int]]:
    return st.session_state.setdefault(PICKS, {})


def stored_pick(key: str) -> dict[str, int]:
    """The session's pick for a view (or picker) key: {"layer": 3, "head": 1}, empty for none."""
    return dict(_store().get(key) or {})


def _set(key: str, axis: str, value: int | None) -> None:
    entry = dict(_store().get(key) or {})
    if value is None:
        entry.pop(axis, None)
    else:
        entry[axis] = int(value)
    store = _store()
    if entry:
        store[key] = entry
    else:
        store.pop(key, None)


def _keep(key: str, axis: str, value: int | str, default: int | str) -> None:
    """Keep a pick in the session (and so in the link) unless it is the picker's default ("all", or the first
    choice of a picker without "all")."""
    _set(key, axis, None if value == default or value == ALL else value)


def view_choices(view: View, ctx: AnalysisContext) -> view_mod.PickChoices | None:
    """The view's pick choices for a context; None when the view has no picks or nothing to show there."""
    if view.picks is None:
        return None
    try:
        return view.picks.choices(ctx)
    except NotApplicable:
        return None


def merged(choices: list[view_mod.PickChoices | None]) -> view_mod.PickChoices | None:
    """One set of choices for several runs (Compare): the union of their layers and heads."""
    found = [c for c in choices if c is not None]
    if not found:
        return None
    layers = tuple(sorted({i for c in found for i in c.layers}))
    heads = tuple(sorted({h for c in found for h in c.heads}))
    return view_mod.PickChoices(found[0].mechanism, layers, heads)


def picker(
    key: str, title: str, choices: view_mod.PickChoices, axes: tuple[str, ...], allow_all: bool = True
) -> dict[str, int]:
    """A selectbox per axis (layer, head), labelled with the mechanism; the pick kept in the session under
    ``key``. A kept pick this run does not have gets a warning and is dropped. Returns {"layer": 3, ...}."""
    axes = tuple(a for a in axes if choices.values(a))
    if not axes:
        return {}
    kept = stored_pick(key)
    for axis in axes:
        try:
            pk.check_pick(choices, axis, kept.get(axis))
        except pk.PickError as exc:
            st.warning(f"**{md_escape(title)}**: {md_escape(str(exc))}; showing {choices.label(axis, None)}.")
            _set(key, axis, None)
    kept = stored_pick(key)
    cols = st.columns(3)  # narrow boxes, whatever the number of axes
    pick: dict[str, int] = {}
    for col, axis in zip(cols, axes):
        # "all" is a string: a selectbox shows the value None as an empty box ("Choose an option")
        options = ([ALL] if allow_all else []) + list(choices.values(axis))
        widget = f"k3lab_pick_{key}_{axis}"
        if st.session_state.get(widget, "unset") not in options:  # first draw, or a value this run lacks
            default = kept.get(axis, options[0])
            st.session_state[widget] = default if default in options else options[0]
        value = col.selectbox(
            f"{choices.mechanism} layer" if axis == view_mod.LAYER else "Head",
            options,
            format_func=lambda v, a=axis: choices.label(a, None if v == ALL else v),
            key=widget,
            on_change=lambda w=widget, a=axis, first=options[0]: _keep(key, a, st.session_state.get(w), first),
        )
        _keep(key, axis, value, options[0])
        if value != ALL:
            pick[axis] = int(value)
    links.write_picks()
    return pick


def focused(loaded: Loaded, pick: dict[str, int]) -> Loaded:
    """``loaded`` with the pick in its view options and its figure-cache key (itself without a pick)."""
    if not pick:
        return loaded
    text = pk.pick_text(pick.get(view_mod.LAYER), pick.get(view_mod.HEAD))
    return replace(loaded, ctx=loaded.ctx.with_options(**pick), key=(*loaded.key, ("pick", text)))


def view_pick(view: View, *loadeds: Loaded) -> tuple[dict[str, int], list[view_mod.PickChoices | None]]:
    """Pickers for a view that declares them (one pick for every loaded run): (the pick, each run's choices)."""
    each = [view_choices(view, loaded.ctx) for loaded in loadeds]
    choices = merged(each)
    if choices is None:
        return {}, each
    return picker(view.key, view.title, choices, view.picks.axes, allow_all=not view.picks.one_at_a_time), each


def only_in(pick: dict[str, int], each: list[view_mod.PickChoices | None], labels: list[str]) -> str:
    """A sentence naming the runs that lack the picked layer/head ("" when every run has it)."""
    missing = []
    for choices, label in zip(each, labels):
        lacks = [
            f"{axis} {value}" for axis, value in pick.items() if choices is None or value not in choices.values(axis)
        ]
        if lacks:
            missing.append(f"{label} has no {' / '.join(lacks)}")
    return "; ".join(missing)


def table_pick(key: str, title: str, table, mechanism: str, allow_all: bool = True):
    """Pickers for a tidy table with ``layer`` / ``head`` columns (e.g. the Experiment page's per-token tables):
    (the table's rows for the pick, the choices, the pick)."""
    choices = view_mod.PickChoices(
        mechanism,
        tuple(sorted(int(v) for v in table["layer"].unique())),
        tuple(sorted(int(v) for v in table["head"].unique())) if "head" in table else (),
    )
    pick = picker(key, title, choices, (view_mod.LAYER, view_mod.HEAD), allow_all=allow_all)
    return pk.filter_picked(table, pick.get(view_mod.LAYER), pick.get(view_mod.HEAD)), choices, pick
