"""Two plotly figures placed left and right in one figure, on shared axis ranges and one colour scale.

``combine_side_by_side(fig_a, fig_b, label_a, label_b)`` renumbers B's axes after A's, squeezes A into
the left and B into the right part of the width, and then makes the comparison right by construction:

- every axis of A and its counterpart in B get one explicit range that covers both runs' data
  (``shared_axis_ranges``), in plotly's own units: log10 of the values for log axes, category
  positions for category axes (with the union of both runs' categories). Ranges are set explicitly
  because plotly.js autoranges matched bar axes wrongly (every bar at the top of a -1..4 axis);
- paired heatmaps (same position, same type) get the union of both colour ranges and one colour bar;
- run labels sit in the top margin, clear of subplot titles; legends go to the right, clear of both.

The traces' numbers are copied unchanged; only axis references, ranges and colour limits change.
"""

from __future__ import annotations

import base64
import copy
import math
import re
import textwrap
from collections.abc import Iterable
from typing import Any

import numpy as np
import plotly.graph_objects as go

LEFT_DOMAIN, RIGHT_DOMAIN = (0.0, 0.45), (0.55, 1.0)
LABEL_ROW_PX = 22  # height of one line of a run label in the top margin
_AXIS_RE = re.compile(r"^([xy])axis(\d*)$")
_REF_RE = re.compile(r"^([xy])(\d*)( domain)?$")
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


def _ref(letter: str, n: int) -> str:
    return letter if n == 1 else f"{letter}{n}"


def _ref_number(ref: str | None, letter: str) -> int:
    m = _REF_RE.match(ref or letter)
    return int(m.group(2) or 1) if m else 1


def axis_ids(fig: dict) -> dict[str, set[int]]:
    """Numbers of the x and y axes a figure dict uses (layout axes and trace references)."""
    ids: dict[str, set[int]] = {"x": set(), "y": set()}
    for key in fig.get("layout", {}):
        m = _AXIS_RE.match(key)
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


def _heatmap_edges(trace: dict, letter: str, values: np.ndarray) -> np.ndarray:
    """A heatmap's numeric cell coordinates widened by half a cell on each side (plotly draws cells
    centred on the coordinates)."""
    if trace.get("type") != "heatmap" or values.size == 0 or values.dtype == object:
        return values
    v = np.unique(values[np.isfinite(values)])
    half = float(np.diff(v).min()) / 2 if v.size > 1 else 0.5
    return np.concatenate([values, [v.min() - half, v.max() + half]]) if v.size else values


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


def _numeric_range(values: np.ndarray, log: bool, include_zero: bool) -> tuple[float, float] | None:
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
    pad = 0.05 * span if span > 0 else (0.1 if log else max(abs(hi) * 0.1, 0.5))
    lo, hi = lo - pad, hi + pad
    if include_zero and not log:  # bars start at zero: no padding below a zero base
        lo = 0.0 if float(values[np.isfinite(values)].min(initial=0.0)) >= 0 else lo
    return lo, hi


def shared_axis_ranges(fig: dict, pairs: Iterable[tuple[str, str]]) -> None:
    """Give every group of axes (``pairs`` of axis layout names that must agree, plus each figure's own
    ``matches``) one explicit range covering every trace on them, in place.

    Numeric axes: [min, max] of the data padded by 5% (bars from 0), widened to any explicit range the
    figures already set (e.g. a 0..1 share axis stays 0..1). Log axes: the same in log10 units over the
    positive values. Category axes: the union of both runs' categories in order, positions -0.5..n-0.5.
    ``autorange="reversed"`` axes keep their direction."""
    layout = fig.setdefault("layout", {})
    names = {k for k in layout if _AXIS_RE.match(k)}
    links = list(pairs)
    for name in list(names):
        match = layout[name].get("matches")
        if match:
            links.append((name, axis_name(match[0], _ref_number(match, match[0]))))
    values: dict[str, list[np.ndarray]] = {}
    bar_axes: set[str] = set()
    for tr in fig.get("data", []):
        if not is_cartesian(tr):
            continue
        for letter in ("x", "y"):
            name = axis_name(letter, _ref_number(tr.get(f"{letter}axis"), letter))
            vals = trace_axis_values(tr, letter)
            if vals.size:
                values.setdefault(name, []).append(_heatmap_edges(tr, letter, vals))
            if tr.get("type") == "bar" and letter == _value_axis(tr) and vals.size and vals.dtype != object:
                bar_axes.add(name)
    names |= set(values)
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
            found = _numeric_range(allv, log, zero)
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
            rng = [lo, hi]
        if reversed_:
            rng = rng[::-1]
        for ax in axes:
            ax["range"] = list(rng)
            ax["autorange"] = False


# ----------------------------------------------------------------------------- colours
def _value_range(tr: dict) -> tuple[float, float] | None:
    """Colour range of a trace dict: explicit zmin/zmax, else the finite min/max of z (None without z)."""
    z = plotly_array(tr.get("z"))
    if z is None:
        return None
    lo, hi = tr.get("zmin"), tr.get("zmax")
    if lo is None or hi is None:
        try:
            finite = z.astype(np.float64)
        except (TypeError, ValueError):
            return None
        finite = finite[np.isfinite(finite)]
        if not finite.size:
            return None
        lo = float(finite.min()) if lo is None else lo
        hi = float(finite.max()) if hi is None else hi
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


# ----------------------------------------------------------------------------- placing one figure's parts
def _remap_ref(ref: Any, offset: dict[str, int]) -> Any:
    """'x2' -> 'x{2+off}', 'y domain' -> 'y{1+off} domain'; 'paper' and others unchanged."""
    if not isinstance(ref, str):
        return ref
    m = _REF_RE.match(ref)
    if not m:
        return ref
    letter, num, dom = m.group(1), int(m.group(2) or 1), m.group(3) or ""
    return _ref(letter, num + offset[letter]) + dom


def _squeeze(x: float, domain: tuple[float, float]) -> float:
    return domain[0] + (domain[1] - domain[0]) * float(x)


def _place_axes(layout: dict, out_layout: dict, ids: dict, offset: dict, domain: tuple[float, float]) -> None:
    """Copy a figure's axes into the combined layout, renumbered by ``offset`` and squeezed into ``domain``."""
    for letter in ("x", "y"):
        for n in sorted(ids[letter]):
            src = copy.deepcopy(layout.get(axis_name(letter, n), {}))
            for attr in ("anchor", "overlaying", "matches", "scaleanchor"):
                if attr in src:
                    src[attr] = _remap_ref(src[attr], offset)
            if letter == "x" and not src.get("overlaying"):
                d = src.get("domain", [0.0, 1.0])
                src["domain"] = [_squeeze(d[0], domain), _squeeze(d[1], domain)]
            other = "y" if letter == "x" else "x"
            src.setdefault("anchor", _ref(other, 1 + offset[other]))
            out_layout[axis_name(letter, n + offset[letter])] = src


def _place_refs(items: list[dict] | None, offset: dict, domain: tuple[float, float], coords: tuple[str, ...]) -> list:
    """Annotations/shapes with their axis references renumbered and paper x-coordinates squeezed."""
    out = []
    for item in items or []:
        item = copy.deepcopy(item)
        item["xref"] = _remap_ref(item.get("xref", "paper"), offset)
        item["yref"] = _remap_ref(item.get("yref", "paper"), offset)
        if item["xref"] == "paper":
            for k in coords:
                if k in item:
                    item[k] = _squeeze(item[k], domain)
        out.append(item)
    return out


def _subplot_titles_on_top(layout: dict) -> bool:
    """Whether any annotation sits above the plot area (a subplot title of the top row)."""
    return any(
        a.get("yref") == "paper" and float(a.get("y", 0)) >= 0.99 and a.get("yanchor") == "bottom"
        for a in layout.get("annotations") or []
    )


def _menus(menus_a: list | None, n_a: int, n_b: int) -> list:
    """A's dropdowns applied to both halves: each button's ``visible`` list repeated for B when both
    figures have the same traces (the same layers), dropped otherwise."""
    out = []
    for menu in copy.deepcopy(menus_a or []):
        ok = True
        for button in menu.get("buttons", []):
            args = button.get("args") or []
            vis = args[0].get("visible") if args and isinstance(args[0], dict) else None
            if vis is None:
                continue
            if len(vis) == n_a and n_a == n_b:
                args[0]["visible"] = list(vis) + list(vis)
            else:
                ok = False
        if ok:
            out.append(menu)
    return out


def _without_label(title: str, label: str) -> str:
    """A view title without the " — <run label>" the single-run figure appends."""
    for sep in (" — ", " - ", ": "):
        if label and title.endswith(f"{sep}{label}"):
            return title[: -len(sep + label)]
    return title


def wrap_note(text: str, width: int = 48) -> str:
    """A note wrapped into lines of at most ``width`` characters (plotly's ``<br>``), so that it stays
    inside its half of a side-by-side figure."""
    return "<br>".join(textwrap.wrap(str(text), width)) or str(text)


# ----------------------------------------------------------------------------- the combined figure
def combine_side_by_side(
    fig_a: go.Figure, fig_b: go.Figure, label_a: str, label_b: str, title: str | None = None
) -> go.Figure:
    """Place two figures left and right in one figure on shared ranges and colour scales (module doc)."""
    da, db = fig_a.to_plotly_json(), fig_b.to_plotly_json()
    la, lb = da.get("layout", {}), db.get("layout", {})
    ids_a, ids_b = axis_ids(da), axis_ids(db)
    offset_a = {"x": 0, "y": 0}
    offset_b = {"x": max(ids_a["x"] | {0}), "y": max(ids_a["y"] | {0})}
    traces_a = [copy.copy(t) for t in da.get("data", [])]
    traces_b = [copy.copy(t) for t in db.get("data", [])]
    share_colour_scales(traces_a, traces_b)

    skip = ("annotations", "shapes", "title", "height", "width", "meta", "legend", "updatemenus", "margin")
    layout = {k: copy.deepcopy(v) for k, v in la.items() if not _AXIS_RE.match(k) and k not in skip}
    _place_axes(la, layout, ids_a, offset_a, LEFT_DOMAIN)
    _place_axes(lb, layout, ids_b, offset_b, RIGHT_DOMAIN)
    layout["annotations"] = _place_refs(la.get("annotations"), offset_a, LEFT_DOMAIN, ("x",)) + _place_refs(
        lb.get("annotations"), offset_b, RIGHT_DOMAIN, ("x",)
    )
    layout["shapes"] = _place_refs(la.get("shapes"), offset_a, LEFT_DOMAIN, ("x0", "x1")) + _place_refs(
        lb.get("shapes"), offset_b, RIGHT_DOMAIN, ("x0", "x1")
    )
    menus = _menus(la.get("updatemenus"), len(traces_a), len(traces_b))
    if menus:
        layout["updatemenus"] = menus

    # Run labels (with each run's own title where the titles differ, e.g. per-run numbers) in the top
    # margin, above any subplot titles; the legend on the right, where it cannot cover either.
    titles = [
        _without_label((lay.get("title") or {}).get("text") or "", lab) for lay, lab in ((la, label_a), (lb, label_b))
    ]
    per_run = titles[0] != titles[1]  # per-run numbers in the titles (e.g. a sink rate): shown under each label
    sub_titles = _subplot_titles_on_top(la) or _subplot_titles_on_top(lb)
    lift = 8 + (LABEL_ROW_PX if sub_titles else 0)
    for text, sub, domain in ((label_a, titles[0], LEFT_DOMAIN), (label_b, titles[1], RIGHT_DOMAIN)):
        body = f"<b>{text}</b>" + (f"<br><span style='font-size:11px'>{wrap_note(sub, 70)}</span>" if per_run else "")
        layout["annotations"].append(
            {
                "text": body,
                "xref": "paper",
                "yref": "paper",
                "x": sum(domain) / 2,
                "y": 1.0,
                "yshift": lift,
                "showarrow": False,
                "xanchor": "center",
                "yanchor": "bottom",
                "font": {"size": 13},
                "name": "run label",
            }
        )
    label_lines = 1 + (max(wrap_note(t, 70).count("<br>") + 1 for t in titles) if per_run else 0)
    layout["title"] = {"text": title or titles[0], "x": 0.0, "xanchor": "left", "y": 0.99, "yanchor": "top"}
    layout["margin"] = {**(la.get("margin") or {}), "t": 50 + lift + LABEL_ROW_PX * label_lines, "r": 30}
    layout["legend"] = {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}
    layout["height"] = max(la.get("height") or 420, lb.get("height") or 420) + lift + LABEL_ROW_PX * label_lines
    layout["meta"] = {"export_width": 1600}

    names_a = {t.get("name") for t in traces_a if t.get("name")}
    for tr in traces_a:
        if tr.get("name") and not tr.get("legendgroup"):
            tr["legendgroup"] = tr["name"]
    for tr in traces_b:
        if is_cartesian(tr):
            for letter in ("x", "y"):
                tr[f"{letter}axis"] = _remap_ref(tr.get(f"{letter}axis") or letter, offset_b)
        if tr.get("name"):
            tr.setdefault("legendgroup", tr["name"])
            if tr["name"] in names_a:
                tr["showlegend"] = False
        if tr.get("type") == "heatmap" or "colorbar" in tr:
            tr.setdefault("colorbar", {})
            tr["colorbar"] = {**tr["colorbar"], "x": 1.0, "xanchor": "left"}

    combined = {"data": traces_a + traces_b, "layout": layout}
    pairs = [
        (axis_name(letter, n), axis_name(letter, n + offset_b[letter]))
        for letter in ("x", "y")
        for n in ids_a[letter] & ids_b[letter]
    ]
    shared_axis_ranges(combined, pairs)
    for letter in ("x", "y"):  # linked zoom: each right axis follows its left counterpart
        for n in ids_a[letter] & ids_b[letter]:
            right = layout[axis_name(letter, n + offset_b[letter])]
            if not right.get("overlaying"):
                right["matches"] = _ref(letter, n)
    # Both inputs are valid figures and only references/ranges changed: skip plotly's (slow) re-validation.
    try:
        return go.Figure(combined, _validate=False)
    except TypeError:  # pragma: no cover - a plotly without the private flag
        return go.Figure(combined)


def placeholder_figure(reason: str) -> go.Figure:
    """An empty half for a run the view does not apply to, its reason wrapped to stay inside that half."""
    fig = go.Figure()
    fig.add_annotation(
        text=f"not applicable: {wrap_note(reason)}", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def numbers_equal(a: Any, b: Any) -> bool:
    """Whether two trace attributes hold the same numbers (NaN equal to NaN), whatever their encoding."""
    xa, xb = plotly_array(a), plotly_array(b)
    if xa is None or xb is None:
        return xa is None and xb is None
    if xa.shape != xb.shape:
        return False
    if xa.dtype == object or xb.dtype == object:
        return [str(v) for v in xa.ravel()] == [str(v) for v in xb.ravel()]
    fa, fb = xa.astype(np.float64), xb.astype(np.float64)
    return bool(np.array_equal(fa, fb, equal_nan=True))


def _numeric_pair(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)
    )
