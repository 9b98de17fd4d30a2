"""Shared scales for comparing figures: plotly data read back as numbers, one explicit axis range covering
every trace on a group of axes, and one colour range for paired heatmaps.

Ranges are in plotly's own units: the values for linear axes, log10 of the values for log axes, and
category positions (-0.5 .. n - 0.5 over the union of categories) for category axes. They are set
explicitly because plotly.js autoranges matched bar axes wrongly (every bar at the top of a -1..4
axis in the Compare page before this module).
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

AXIS_RE = re.compile(r"^([xy])axis(\d*)$")
REF_RE = re.compile(r"^([xy])(\d*)( domain)?$")
_NON_CARTESIAN = {
    "pie",
    "table",
    "indicator",
    "sunburst",
    "treemap",
    "sankey",
    "parcoords",
    "parcats",
    "scatterpolar",
    "barpolar",
    "scatter3d",
    "surface",
    "mesh3d",
    "funnelarea",
    "icicle",
    "scattergeo",
    "choropleth",
    "scatterternary",
    "cone",
    "streamtube",
    "volume",
    "isosurface",
}


# ----------------------------------------------------------------------------- plotly data as numpy
def plotly_array(value: Any) -> np.ndarray | None:
    """A trace attribute as a numpy array: lists, tuples, numpy arrays and plotly's base64 typed arrays
    (``{"dtype": "f8", "bdata": ..., "shape": "2, 3"}``). None for None."""
    if value is None:
        return None
    if isinstance(value, dict) and "bdata" in value:
        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        if shape:
            arr = arr.reshape([int(s) for s in str(shape).split(",")])
        return arr
    if isinstance(value, str):
        return np.asarray([value], dtype=object)
    return np.asarray(value, dtype=object if _has_text(value) else None)


def _has_text(value: Any) -> bool:
    try:
        return any(isinstance(v, str) for v in np.asarray(value, dtype=object).ravel())
    except (TypeError, ValueError):
        return False


def is_cartesian(trace: dict) -> bool:
    """Whether a trace dict is drawn on x/y axes."""
    return trace.get("type", "scatter") not in _NON_CARTESIAN


def axis_name(letter: str, n: int) -> str:
    """Layout key of axis number n: ("x", 1) -> "xaxis", ("y", 3) -> "yaxis3"."""
    return f"{letter}axis{'' if n == 1 else n}"


def axis_ref(letter: str, n: int) -> str:
    """Trace reference of axis number n: ("x", 1) -> "x", ("y", 3) -> "y3"."""
    return letter if n == 1 else f"{letter}{n}"


def _ref_number(ref: str | None, letter: str) -> int:
    m = REF_RE.match(ref or letter)
    return int(m.group(2) or 1) if m else 1


def axis_ids(fig: dict) -> dict[str, set[int]]:
    """Numbers of the x and y axes a figure dict uses (layout axes and trace references)."""
    ids: dict[str, set[int]] = {"x": set(), "y": set()}
    for key in fig.get("layout", {}):
        m = AXIS_RE.match(key)
        if m:
            ids[m.group(1)].add(int(m.group(2) or 1))
    for tr in fig.get("data", []):
        if is_cartesian(tr):
            for letter in ("x", "y"):
                ids[letter].add(_ref_number(tr.get(f"{letter}axis"), letter))
    return ids


# ----------------------------------------------------------------------------- what a trace puts on an axis
def _value_axis(trace: dict) -> str:
    return "x" if trace.get("orientation") == "h" else "y"


def trace_axis_values(trace: dict, letter: str) -> np.ndarray:
    """Every value a trace places on its ``letter`` axis ("x" or "y"), flattened: data coordinates,
    bar bases (0), error-bar ends, box statistics and box names; heatmap cell edges are added by
    ``shared_axis_ranges``. Text values (categories) come back as an object array."""
    kind = trace.get("type", "scatter")
    value_axis = _value_axis(trace)
    parts: list[np.ndarray] = []
    coords = plotly_array(trace.get(letter))
    if coords is None and kind == "heatmap":
        z = plotly_array(trace.get("z"))
        if z is not None and z.ndim == 2:
            coords = np.arange(z.shape[1] if letter == "x" else z.shape[0])
    if coords is not None:
        parts.append(coords.ravel())
    if kind == "box":
        if letter == value_axis:
            for attr in ("q1", "median", "q3", "lowerfence", "upperfence", "mean"):
                arr = plotly_array(trace.get(attr))
                if arr is not None:
                    parts.append(arr.ravel())
        elif coords is None and trace.get("name") is not None:
            parts.append(np.asarray([str(trace["name"])], dtype=object))
    if kind == "bar" and letter == value_axis and coords is not None and not _is_text(coords):
        parts.append(np.zeros(1))
    err = trace.get(f"error_{letter}") or {}
    if coords is not None and err.get("visible", True) and err.get("array") is not None and not _is_text(coords):
        e = plotly_array(err["array"]).astype(np.float64).ravel()
        minus = plotly_array(err.get("arrayminus"))
        m = e if minus is None else minus.astype(np.float64).ravel()
        c = coords.astype(np.float64).ravel()
        if e.size == c.size and m.size == c.size:
            parts += [c + e, c - m]
    if not parts:
        return np.zeros(0)
    if any(_is_text(p) for p in parts):
        return np.concatenate([np.asarray([str(v) for v in p], dtype=object) for p in parts])
    return np.concatenate([p.astype(np.float64) for p in parts])


def _is_text(arr: np.ndarray) -> bool:
    return arr.dtype == object and any(isinstance(v, str) for v in arr.ravel())


def _cell_edges(trace: dict, letter: str, values: np.ndarray) -> np.ndarray:
    """Numeric positions of heatmap cells or bars widened by half a cell (or bar slot) on each side:
    plotly draws both centred on their coordinates, so a range over the centres alone cuts the edge
    cells and bars in half. Other traces and value axes come back unchanged."""
    kind = trace.get("type")
    on_positions = kind == "heatmap" or (kind == "bar" and letter != _value_axis(trace))
    if not on_positions or values.size == 0 or values.dtype == object:
        return values
    v = np.unique(values[np.isfinite(values)])
    width = trace.get("width") if kind == "bar" else None
    if isinstance(width, (int, float)) and width > 0:  # bars of a set width: half of it, whatever their spacing
        half = float(width) / 2  # (MLA bars at layers 3 and 7 alone widened the axis to layer 9)
    else:
        half = float(np.diff(v).min()) / 2 if v.size > 1 else 0.5
    return np.concatenate([values, [v.min() - half, v.max() + half]]) if v.size else values


def _has_cell_edges(trace: dict, letter: str) -> bool:
    return trace.get("type") == "heatmap" or (trace.get("type") == "bar" and letter != _value_axis(trace))


# ----------------------------------------------------------------------------- shared ranges
def _groups(pairs: Iterable[tuple[str, str]], names: Iterable[str]) -> list[set[str]]:
    """Connected groups of axis names under the given pairs (union-find)."""
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent.setdefault(n, n) != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in pairs:
        parent[find(a)] = find(b)
    groups: dict[str, set[str]] = {}
    for n in list(parent):
        groups.setdefault(find(n), set()).add(n)
    return list(groups.values())


def _numeric_range(
    values: np.ndarray, log: bool, include_zero: bool, pad_fraction: float = 0.05
) -> tuple[float, float] | None:
    v = values[np.isfinite(values)]
    if log:
        v = v[v > 0]
        if not v.size:
            return None
        v = np.log10(v)
    elif include_zero:
        v = np.concatenate([v, [0.0]])
    if not v.size:
        return None
    lo, hi = float(v.min()), float(v.max())
    span = hi - lo
    pad = pad_fraction * span if span > 0 else (0.1 if log else max(abs(hi) * 0.1, 0.5))
    lo, hi = lo - pad, hi + pad
    if include_zero and not log:  # bars start at zero: no padding below a zero base
        lo = 0.0 if float(values[np.isfinite(values)].min(initial=0.0)) >= 0 else lo
    return lo, hi


AXIS_TOP = "k3lab-axis-top"  # a trace's ``meta``: its markers stand at the top of the range the data set
AXIS_TOP_AT = 0.93  # where, as a fraction of the axis (in its own units: log10 on log axes)


def stacked_bar_ends(traces: list[dict], layout: dict) -> list[np.ndarray]:
    """For ``barmode`` "stack" / "relative": per group of bars on one pair of axes, the stacked ends at each
    position (positive values summed upwards, negative downwards), so a range covers the whole stack and not
    only the largest single segment. Empty for other bar modes."""
    if layout.get("barmode") not in ("stack", "relative"):
        return []
    sums: dict[tuple, dict[str, list[float]]] = {}
    for tr in traces:
        if tr.get("type") != "bar" or tr.get("visible") is False or not is_cartesian(tr):
            continue
        value = _value_axis(tr)
        position = "y" if value == "x" else "x"
        pos, val = plotly_array(tr.get(position)), plotly_array(tr.get(value))
        if val is None:
            continue
        pos = np.arange(val.size) if pos is None else pos.ravel()
        key = (tr.get("xaxis") or "x", tr.get("yaxis") or "y", value)
        per = sums.setdefault(key, {})
        for p, v in zip(pos, val.astype(np.float64).ravel()):
            if np.isfinite(v):
                up, down = per.setdefault(str(p), [0.0, 0.0])
                per[str(p)] = [up + max(v, 0.0), down + min(v, 0.0)]
    out = []
    for (xref, yref, value), per in sums.items():
        ends = np.asarray([e for pair in per.values() for e in pair], dtype=np.float64)
        out.append((axis_name(value, _ref_number(xref if value == "x" else yref, value)), ends))
    return out


def shape_extents(layout: dict) -> list[tuple[str, np.ndarray]]:
    """Per shape drawn in data coordinates (e.g. a band over an MLA layer), the axis name and the shape's ends on
    it: a range over the traces alone would cut a band beyond the last trace (the half-life plot's MLA layer 7)."""
    out = []
    for shape in layout.get("shapes") or []:
        for letter in ("x", "y"):
            ref = shape.get(f"{letter}ref") or letter
            if not isinstance(ref, str) or not ref.startswith(letter) or " " in ref:
                continue  # paper or "x domain" coordinates: not a data range
            ends = [shape.get(f"{letter}0"), shape.get(f"{letter}1")]
            if all(isinstance(e, (int, float)) and math.isfinite(e) for e in ends):
                out.append((axis_name(letter, _ref_number(ref, letter)), np.asarray(ends, dtype=np.float64)))
    return out


def _pin_to_top(traces: list[dict], layout: dict) -> None:
    """Markers flagged ``meta=AXIS_TOP`` (e.g. "unbounded memory" for full-attention layers) moved to the top of
    their y axis' final range, so every panel sharing the axis draws them at one height."""
    for tr in traces:
        if tr.get("meta") != AXIS_TOP:
            continue
        axis = layout.get(axis_name("y", _ref_number(tr.get("yaxis"), "y")), {})
        rng = axis.get("range")
        x = plotly_array(tr.get("x"))
        if not _numeric_pair(rng) or x is None:
            continue
        lo, hi = sorted(float(r) for r in rng)
        top = lo + AXIS_TOP_AT * (hi - lo)
        tr["y"] = [10**top if axis.get("type") == "log" else top] * x.size


def shared_axis_ranges(
    fig: dict, pairs: Iterable[tuple[str, str]], visible: list[bool] | None = None
) -> dict[str, list[float]]:
    """Give every group of axes (``pairs`` of axis layout names that must agree, plus each figure's own
    ``matches``) one explicit range covering every trace on them, in place; returns the ranges set.

    Only the traces shown count: ``visible`` (one flag per trace, e.g. a dropdown's state) or else each
    trace's own ``visible`` (False: hidden). Stacked bars count by their stacked ends; markers flagged
    ``meta=AXIS_TOP`` do not set the range but are moved to its top.

    Numeric axes: [min, max] of the data padded by 5% (bars from 0; heatmap cells and bar slots by
    their own half width instead), widened to any explicit range the
    figures already set (e.g. a 0..1 share axis stays 0..1). Log axes: the same in log10 units over the
    positive values. Category axes: the union of both runs' categories in order, positions -0.5..n-0.5.
    ``autorange="reversed"`` axes keep their direction."""
    layout = fig.setdefault("layout", {})
    names = {k for k in layout if AXIS_RE.match(k)}
    links = list(pairs)
    for name in list(names):
        match = layout[name].get("matches")
        if match:
            links.append((name, axis_name(match[0], _ref_number(match, match[0]))))
    values: dict[str, list[np.ndarray]] = {}
    bar_axes: set[str] = set()
    unedged_axes: set[str] = set()  # axes with a trace that is not heatmap cells or bar positions
    traces = fig.get("data", [])
    shown = [
        (tr.get("visible") is not False) if visible is None else bool(v)
        for tr, v in zip(traces, visible or [None] * len(traces))
    ]
    counted = [tr for tr, on in zip(traces, shown) if on]
    pinned_axes = {
        axis_name("y", _ref_number(tr.get("yaxis"), "y"))
        for tr, on in zip(traces, shown)
        if on and tr.get("meta") == AXIS_TOP
    }
    for name, ends in stacked_bar_ends(counted, layout):
        values.setdefault(name, []).append(ends)
    for tr in counted:
        if not is_cartesian(tr):
            continue
        for letter in ("x", "y"):
            if letter == "y" and tr.get("meta") == AXIS_TOP:  # placed at the top of the range, not part of it
                continue
            name = axis_name(letter, _ref_number(tr.get(f"{letter}axis"), letter))
            vals = trace_axis_values(tr, letter)
            if vals.size:
                values.setdefault(name, []).append(_cell_edges(tr, letter, vals))
                if not _has_cell_edges(tr, letter):
                    unedged_axes.add(name)
            if tr.get("type") == "bar" and letter == _value_axis(tr) and vals.size and vals.dtype != object:
                bar_axes.add(name)
    for name, ends in shape_extents(layout):
        values.setdefault(name, []).append(ends)
        unedged_axes.add(name)
    names |= set(values)
    set_ranges: dict[str, list[float]] = {}
    for group in _groups(links, names):
        axes = [layout.setdefault(n, {}) for n in sorted(group)]
        data = [v for n in group for v in values.get(n, [])]
        bar = bool(group & bar_axes)
        if not data:
            continue
        reversed_ = any(ax.get("autorange") == "reversed" for ax in axes)
        kinds = {ax.get("type") for ax in axes if ax.get("type")}
        text = any(v.dtype == object for v in data) or "category" in kinds
        if text:
            cats: list[str] = []
            for ax in axes:
                cats += [str(c) for c in ax.get("categoryarray") or []]
            for v in data:
                cats += [str(c) for c in v]
            cats = list(dict.fromkeys(cats))
            rng = [-0.5, len(cats) - 0.5]
            for ax in axes:
                ax.update(categoryorder="array", categoryarray=cats)
        else:
            log = "log" in kinds
            allv = np.concatenate(data).astype(np.float64)
            zero = bar or any(ax.get("rangemode") in ("tozero", "nonnegative") for ax in axes)
            # cell and bar edges already frame the data; padding them again leaves a blank band
            found = _numeric_range(allv, log, zero, 0.05 if group & unedged_axes else 0.0)
            if found is None:
                continue
            lo, hi = found
            given = [sorted(float(g) for g in ax["range"]) for ax in axes if _numeric_pair(ax.get("range"))]
            if given:  # a range the view chose (e.g. 0..1 for a share) stays, unless the data leave it
                glo, ghi = min(g[0] for g in given), max(g[1] for g in given)
                raw = allv[np.isfinite(allv)]
                raw = np.log10(raw[raw > 0]) if log else raw
                if raw.size:
                    lo = glo if raw.min() >= glo else lo
                    hi = ghi if raw.max() <= ghi else hi
            if group & pinned_axes:  # room above the data for the markers pinned to the top
                hi += (1.0 / AXIS_TOP_AT - 1.0) * 2 * (hi - lo)
            rng = [lo, hi]
        if reversed_:
            rng = rng[::-1]
        for n, ax in zip(sorted(group), axes):
            ax["range"] = list(rng)
            ax["autorange"] = False
            set_ranges[n] = list(rng)
    _pin_to_top(traces, layout)
    return set_ranges


# ----------------------------------------------------------------------------- colours
def finite_range(values: Any) -> tuple[float, float] | None:
    """(min, max) of the finite numbers of a trace attribute (any encoding); None without numbers."""
    arr = plotly_array(values)
    if arr is None or isinstance(values, str):
        return None
    try:
        finite = arr.astype(np.float64)
    except (TypeError, ValueError):
        return None
    finite = finite[np.isfinite(finite)]
    return (float(finite.min()), float(finite.max())) if finite.size else None


def _value_range(tr: dict) -> tuple[float, float] | None:
    """Colour range of a trace dict: explicit zmin/zmax, else the finite min/max of z (None without z)."""
    lo, hi = tr.get("zmin"), tr.get("zmax")
    if lo is None or hi is None:
        found = finite_range(tr.get("z"))
        if found is None:
            return None
        lo = found[0] if lo is None else lo
        hi = found[1] if hi is None else hi
    return float(lo), float(hi)


def share_colour_scales(traces_a: list[dict], traces_b: list[dict]) -> None:
    """Give paired z-traces (same position and type) the union colour range; only the right one shows a
    colour bar, so the comparison has ONE colour bar per pair."""
    for ta, tb in zip(traces_a, traces_b):
        if ta.get("type") != tb.get("type") or ta.get("coloraxis"):
            continue
        ra, rb = _value_range(ta), _value_range(tb)
        if ra is None or rb is None:
            continue
        lo, hi = min(ra[0], rb[0]), max(ra[1], rb[1])
        if ta.get("zmid") is not None or tb.get("zmid") is not None:
            m = max(abs(lo), abs(hi))
            lo, hi = -m, m
        for tr in (ta, tb):
            tr["zmin"], tr["zmax"] = lo, hi
            tr["zauto"] = False
        ta["showscale"] = False


def _numeric_pair(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)
    )
