"""Layer and head picks: which layer / head a per-layer or per-head view shows.

A view that is per layer or per head declares it (``View.picks``, a ``Picks``): the axes it can focus on and a
function giving, for a context, the valid choices (``PickChoices``: the mechanism, e.g. "MLA", its layers in
this run, its heads). The pick itself travels in the view options, ``ctx.options["layer"]`` and
``ctx.options["head"]`` (None or absent: every layer / head, what the view shows without a pick), so the app,
the Compare page and ``k3lab report --layer/--head`` all hand it over the same way. A pick the run does not have
raises ``PickError`` (a ``NotApplicable``) naming the valid choices.

Link and file-name forms: ``"L3H1"`` (layer 3, head 1), ``"L3"``, ``"H1"`` (``pick_text`` / ``parse_pick``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs.context import AnalysisContext
from analysis.views.view import AXES, HEAD, LAYER, NotApplicable, PickChoices
from k3core.interp.trace import names

_PICK_RE = re.compile(r"^(?:L(\d+))?(?:H(\d+))?$", re.IGNORECASE)


class PickError(NotApplicable):
    """A layer or head this run (or this view) does not have; the message lists the valid ones."""


# ----------------------------------------------------------------------------- choices per mechanism
def _heads_of(trace: Any, array: str, axis: int) -> tuple[int, ...]:
    return tuple(range(int(np.asarray(trace[array]).shape[axis]))) if array in trace else ()


def kda_choices(ctx: AnalysisContext) -> PickChoices:
    """KDA layers with gates in the trace; heads from ``kda.i.beta`` ([batch, token, head])."""
    layers = tuple(i for i in ctx.trace.layer_indices("kda") if names.kda_g(i) in ctx.trace)
    if not layers:
        raise NotApplicable("no KDA data in this trace (no KDA layers, or recorded without 'kda')")
    return PickChoices("KDA", layers, _heads_of(ctx.trace, names.kda_beta(layers[0]), -1))


def kda_state_choices(ctx: AnalysisContext) -> PickChoices:
    """KDA layers with state norms in the trace; heads from ``kda.i.state_norm`` ([batch, step, head])."""
    layers = tuple(i for i in ctx.trace.layer_indices("kda") if names.kda_state_norm(i) in ctx.trace)
    if not layers:
        raise NotApplicable("trace has no kda.*.state_norm arrays")
    return PickChoices("KDA", layers, _heads_of(ctx.trace, names.kda_state_norm(layers[0]), -1))


def kda_attention_choices(ctx: AnalysisContext) -> PickChoices:
    """KDA layers with an implicit-attention window map (``blocks.i.kda.attn``, recorded with "attn_probs"); heads
    from its head axis (1)."""
    layers = tuple(i for i in ctx.trace.layer_indices("kda") if names.kda_attn(i) in ctx.trace)
    if not layers:
        raise NotApplicable("no KDA attention map in this trace (no KDA layer, or recorded without 'attn_probs')")
    return PickChoices("KDA", layers, _heads_of(ctx.trace, names.kda_attn(layers[0]), 1))


def mla_choices(ctx: AnalysisContext) -> PickChoices:
    """MLA layers with attention statistics (``mla.i.entropy``, or an older trace's map ``mla.i.attn``); heads
    from that array's head axis (1 in both)."""
    tr = ctx.trace
    layers = tuple(i for i in tr.layer_indices("mla") if names.mla_stat(i, "entropy") in tr or names.mla_attn(i) in tr)
    if not layers:
        raise NotApplicable("no MLA attention statistics in this trace (no MLA layer, or not recorded)")
    first = names.mla_stat(layers[0], "entropy")
    return PickChoices("MLA", layers, _heads_of(tr, first if first in tr else names.mla_attn(layers[0]), 1))


def moe_choices(ctx: AnalysisContext) -> PickChoices:
    """MoE layers with chosen experts in the trace (no head axis)."""
    layers = tuple(i for i in ctx.trace.layer_indices("moe") if names.moe_experts(i) in ctx.trace)
    if not layers:
        raise NotApplicable("no MoE routing data in this trace")
    return PickChoices("MoE", layers)


def moe_latent_choices(ctx: AnalysisContext) -> PickChoices:
    """MoE layers with the routed latent z in the trace (recorded with 'latent')."""
    layers = tuple(i for i in ctx.trace.layer_indices("moe") if names.moe_latent(i) in ctx.trace)
    if not layers:
        raise NotApplicable("trace has no moe.*.latent arrays (record with 'latent')")
    return PickChoices("MoE", layers)


# ----------------------------------------------------------------------------- reading a pick
def check_pick(choices: PickChoices, axis: str, value: Any) -> int | None:
    """The pick as an int (None: all), or PickError naming what this run has."""
    if value is None:
        return None
    valid = choices.values(axis)
    what = f"{choices.mechanism} layers" if axis == LAYER else f"{choices.mechanism} heads"
    listed = f"this run's {what}: {', '.join(str(v) for v in valid) if valid else 'none'}"
    whole = isinstance(value, (int, np.integer)) or (isinstance(value, str) and value.strip().isdigit())
    if isinstance(value, bool) or not whole:
        raise PickError(f"the {axis} pick must be a whole number, got {value!r} ({listed})")
    index = int(value)
    if index not in valid:
        raise PickError(f"{axis} {index} is not one of {listed}")
    return index


def picked(ctx: AnalysisContext, choices: PickChoices, axes: Iterable[str] = AXES) -> tuple[int | None, int | None]:
    """(layer, head) picked in ``ctx.options`` for a view with these ``axes``, checked against ``choices``;
    None for an axis not picked (or not among ``axes``). Raises PickError for a pick this run does not have."""
    axes = tuple(axes)
    layer = check_pick(choices, LAYER, ctx.options.get(LAYER)) if LAYER in axes else None
    head = check_pick(choices, HEAD, ctx.options.get(HEAD)) if HEAD in axes and choices.heads else None
    return layer, head


def filter_picked(table: pd.DataFrame, layer: int | None, head: int | None) -> pd.DataFrame:
    """The rows of a tidy table (columns ``layer`` / ``head``) for the pick; the table itself without one."""
    keep = np.ones(len(table), dtype=bool)
    if layer is not None:
        keep &= (table["layer"] == layer).to_numpy()
    if head is not None and "head" in table:
        keep &= (table["head"] == head).to_numpy()
    if keep.all():
        return table
    out = table[keep].reset_index(drop=True)
    out.attrs.update(table.attrs)
    return out


def pick_title(choices: PickChoices, layer: int | None, head: int | None) -> str:
    """ ", MLA layer 3, head 1" for a figure title ("" without a pick)."""
    parts = ([choices.label(LAYER, layer)] if layer is not None else []) + (
        [choices.label(HEAD, head)] if head is not None else []
    )
    return (", " + ", ".join(parts)) if parts else ""


# ----------------------------------------------------------------------------- text forms
def pick_text(layer: int | None, head: int | None) -> str:
    """``"L3H1"``, ``"L3"``, ``"H1"``; "" without a pick (links and file names)."""
    return (f"L{layer}" if layer is not None else "") + (f"H{head}" if head is not None else "")


def parse_pick(text: str) -> dict[str, int]:
    """``"L3H1"`` -> {"layer": 3, "head": 1}; ValueError for anything else (say what is expected)."""
    m = _PICK_RE.match(text.strip())
    if not text.strip() or m is None:
        raise ValueError(f"{text!r} is not a pick: write L<layer>, H<head> or L<layer>H<head>, e.g. L3H1")
    out = {}
    if m.group(1) is not None:
        out[LAYER] = int(m.group(1))
    if m.group(2) is not None:
        out[HEAD] = int(m.group(2))
    return out


def pick_of(options: dict[str, Any], axes: Iterable[str] = AXES) -> dict[str, Any]:
    """The pick entries (``layer`` / ``head``, not None) of a view-options dict, for the given axes."""
    return {a: options[a] for a in axes if options.get(a) is not None}


def focus_title(view: Any, *contexts: AnalysisContext) -> str:
    """ ", MLA layer 3, head 1" for a view drawn from contexts that carry a pick (the first context whose run has
    the view's choices names the mechanism); "" when the view has no picker or nothing is picked."""
    if view.picks is None:
        return ""
    pick = pick_of(contexts[0].options, view.picks.axes)
    if not pick:
        return ""
    for ctx in contexts:
        try:
            choices = view.picks.choices(ctx)
        except NotApplicable:
            continue
        return pick_title(choices, pick.get(LAYER), pick.get(HEAD))
    return pick_title(PickChoices("", ()), pick.get(LAYER), pick.get(HEAD))
