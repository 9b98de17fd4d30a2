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

import copy
import textwrap
from typing import Any

import plotly.graph_objects as go

from analysis.shared_scales import (
    AXIS_RE,
    REF_RE,
    axis_ids,
    axis_name,
    axis_ref,
    is_cartesian,
    share_colour_scales,
    shared_axis_ranges,
)

LEFT_DOMAIN, RIGHT_DOMAIN = (0.0, 0.45), (0.55, 1.0)
LABEL_ROW_PX = 22  # height of one line of a run label in the top margin


# ----------------------------------------------------------------------------- placing one figure's parts
def _remap_ref(ref: Any, offset: dict[str, int]) -> Any:
    """'x2' -> 'x{2+off}', 'y domain' -> 'y{1+off} domain'; 'paper' and others unchanged."""
    if not isinstance(ref, str):
        return ref
    m = REF_RE.match(ref)
    if not m:
        return ref
    letter, num, dom = m.group(1), int(m.group(2) or 1), m.group(3) or ""
    return axis_ref(letter, num + offset[letter]) + dom


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
            src.setdefault("anchor", axis_ref(other, 1 + offset[other]))
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
    layout = {k: copy.deepcopy(v) for k, v in la.items() if not AXIS_RE.match(k) and k not in skip}
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
    per_run = (
        all(titles) and titles[0] != titles[1]
    )  # per-run numbers in the titles (e.g. a sink rate): shown under each label
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
                right["matches"] = axis_ref(letter, n)
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
