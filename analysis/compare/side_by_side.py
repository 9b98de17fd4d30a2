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
from collections.abc import Callable
from typing import Any

import numpy as np
import plotly.graph_objects as go

from analysis.compare.shared_scales import (
    AXIS_RE,
    REF_RE,
    axis_ids,
    axis_name,
    axis_ref,
    is_cartesian,
    share_colour_scales,
    shared_axis_ranges,
)
from analysis.figures.style import (
    FIGURE_WIDTH,
    LEGEND_RIGHT,
    NOTE_STYLE,
    fit_subplot_titles,
    label_colour_bars,
    wrap_to_px,
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


def _squeeze(x: float, domain: tuple[float, float], columns: Any = None) -> float:
    x = columns(float(x)) if columns is not None else float(x)
    return domain[0] + (domain[1] - domain[0]) * x


MIN_COLUMN_GAP_PX = 70  # between two panels of one half: the right panel's y tick labels and y title
HALF_PX = 360  # a half's width on a 900-px figure (analysis.figures.style.FIGURE_WIDTH)


def column_map(
    layout: dict, ids: dict, half_px: float = HALF_PX, gap_px: float = MIN_COLUMN_GAP_PX
) -> Callable[[float], float] | None:
    """A map of paper x (0..1 of one figure) to the same place with its columns of panels at least ``gap_px``
    apart once squeezed into a half ``half_px`` wide (the figure's own spacing, made for a full width, is too
    narrow there: y titles ran into the neighbour's ticks). Column widths keep their proportions; identity
    when the gaps are wide enough or there is one column."""
    domains = sorted(
        {
            tuple(float(v) for v in layout.get(axis_name("x", n), {}).get("domain", (0.0, 1.0)))
            for n in ids["x"]
            if not layout.get(axis_name("x", n), {}).get("overlaying")
        }
    )
    gap = gap_px / half_px
    if len(domains) < 2 or any(b[0] < a[1] for a, b in zip(domains, domains[1:])):
        return None
    if all(b[0] - a[1] >= gap for a, b in zip(domains, domains[1:])):
        return None
    widths = [d1 - d0 for d0, d1 in domains]
    scale = max(1.0 - gap * (len(domains) - 1), 0.2) / sum(widths)
    new, start = [], 0.0
    for w in widths:
        new.append((start, start + w * scale))
        start += w * scale + gap
    old_x, new_x = [0.0] + [v for d in domains for v in d] + [1.0], [0.0] + [v for d in new for v in d] + [1.0]
    return lambda x: float(np.interp(x, old_x, new_x))


def _place_axes(
    layout: dict, out_layout: dict, ids: dict, offset: dict, domain: tuple[float, float], columns: Any = None
) -> None:
    """Copy a figure's axes into the combined layout, renumbered by ``offset`` and squeezed into ``domain``."""
    for letter in ("x", "y"):
        for n in sorted(ids[letter]):
            src = copy.deepcopy(layout.get(axis_name(letter, n), {}))
            for attr in ("anchor", "overlaying", "matches", "scaleanchor"):
                if attr in src:
                    src[attr] = _remap_ref(src[attr], offset)
            if letter == "x" and not src.get("overlaying"):
                d = src.get("domain", [0.0, 1.0])
                src["domain"] = [_squeeze(d[0], domain, columns), _squeeze(d[1], domain, columns)]
            other = "y" if letter == "x" else "x"
            src.setdefault("anchor", axis_ref(other, 1 + offset[other]))
            out_layout[axis_name(letter, n + offset[letter])] = src


def _place_refs(
    items: list[dict] | None, offset: dict, domain: tuple[float, float], coords: tuple[str, ...], columns: Any = None
) -> list:
    """Annotations/shapes with their axis references renumbered and paper x-coordinates squeezed."""
    out = []
    for item in items or []:
        item = copy.deepcopy(item)
        item["xref"] = _remap_ref(item.get("xref", "paper"), offset)
        item["yref"] = _remap_ref(item.get("yref", "paper"), offset)
        if item["xref"] == "paper":
            for k in coords:
                if k in item:
                    item[k] = _squeeze(item[k], domain, columns)
        out.append(item)
    return out


def _one_legend_entry_per_shape(shapes: list[dict]) -> None:
    """Shapes named in the legend (e.g. the MLA bands of both halves) listed once per name, in place."""
    seen: set[str] = set()
    for shape in shapes:
        if shape.get("showlegend") and shape.get("name"):
            if shape["name"] in seen:
                shape["showlegend"] = False
            seen.add(shape["name"])


def _buttons(menus: list | None) -> dict[str, dict]:
    """A figure's dropdown buttons by label (e.g. "layer 4"), from its first menu."""
    for menu in menus or []:
        return {str(b.get("label")): b for b in menu.get("buttons", [])}
    return {}


def _visible_of(button: dict | None) -> list | None:
    args = (button or {}).get("args") or []
    return args[0].get("visible") if args and isinstance(args[0], dict) else None


def _title_of(button: dict | None) -> str | None:
    args = (button or {}).get("args") or []
    return args[1].get("title.text") if len(args) > 1 and isinstance(args[1], dict) else None


def _menus(la: dict, lb: dict, n_a: int, n_b: int) -> list[dict]:
    """One dropdown for both halves: a button per label of either run's menu (e.g. "layer 4") showing that
    layer's traces in A and in B (a run without the layer, or without the view, shows none). Each button
    carries ``_titles``: A's and B's own title for that state (the run labels' subtitles follow it)."""
    buttons_a, buttons_b = _buttons(la.get("updatemenus")), _buttons(lb.get("updatemenus"))
    if not buttons_a and not buttons_b:
        return []
    template = copy.deepcopy((la.get("updatemenus") or lb.get("updatemenus"))[0])
    out = []
    for label in list(dict.fromkeys(list(buttons_a) + list(buttons_b))):
        ba, bb = buttons_a.get(label), buttons_b.get(label)
        vis_a = _visible_of(ba) if ba else ([False] * n_a if buttons_a else [True] * n_a)
        vis_b = _visible_of(bb) if bb else ([False] * n_b if buttons_b else [True] * n_b)
        if vis_a is None or vis_b is None or len(vis_a) != n_a or len(vis_b) != n_b:
            return []
        out.append(
            {
                "label": label,
                "method": "update",
                "args": [{"visible": list(vis_a) + list(vis_b)}, {}],
                "_titles": (_title_of(ba), _title_of(bb)),
            }
        )
    template["buttons"] = out
    return [template]


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


# ----------------------------------------------------------------------------- colours
def _colorway(layout: dict) -> list[str]:
    from plotly.colors import qualitative

    way = ((layout.get("template") or {}).get("layout") or {}).get("colorway")
    return list(way or qualitative.Plotly)


def _explicit_colour(trace: dict) -> str | None:
    marker, line = trace.get("marker") or {}, trace.get("line") or {}
    for c in (line.get("color"), marker.get("color")):
        if isinstance(c, str):
            return c
    return None


def _pin_colours(traces: list[dict], colorway: list[str], named: dict[str, str] | None = None) -> dict[str, str]:
    """Give every scatter/bar/box trace an explicit colour: its own (unchanged), else the colour of the same
    series (trace name) in ``named`` (the other panel), else the one plotly would pick in its own figure (the
    colorway by trace index). Returns name -> colour of this panel's series, so the other panel can match."""
    out: dict[str, str] = {}
    for i, tr in enumerate(traces):
        if tr.get("type", "scatter") not in ("scatter", "scattergl", "bar", "box"):
            continue
        own = _explicit_colour(tr)
        name = tr.get("name")
        colour = (named or {}).get(name) if name else None
        if colour is None:
            colour = own or colorway[i % len(colorway)]
        if own is None or (colour != own and name in (named or {})):
            marker = tr.get("marker") or {}
            if not isinstance(marker.get("color"), (list, tuple, dict)):
                tr["marker"] = {**marker, "color": colour}
            if tr.get("type", "scatter") in ("scatter", "scattergl", "box"):
                tr["line"] = {**(tr.get("line") or {}), "color": colour}
        if name and name not in out:
            out[name] = colour
    return out


# ----------------------------------------------------------------------------- the combined figure
def _run_label(text: str, sub: str | None) -> str:
    """A run's label over its half, with its own title (per-run numbers, the layer shown) under it, wrapped to
    the half's width."""
    body = f"<b>{text}</b>"
    if not sub:
        return body
    # narrower than the half: the app draws the figure narrower than 900 px and the two labels are centred
    # over their halves, so a line near the half's width ran into the other run's label
    lines = wrap_to_px(sub, HALF_PX - 120, 11).replace("<br>", "</span><br><span style='font-size:11px'>")
    return body + f"<br><span style='font-size:11px'>{lines}</span>"


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
    colours_a = _pin_colours(traces_a, _colorway(la))
    _pin_colours(traces_b, _colorway(lb), colours_a)

    skip = ("annotations", "shapes", "title", "height", "width", "meta", "legend", "updatemenus", "margin")
    layout = {k: copy.deepcopy(v) for k, v in la.items() if not AXIS_RE.match(k) and k not in skip}
    # A figure with a y axis on its right (a second quantity) keeps that axis' ticks and title clear of B's.
    right_axis = any(v.get("side") == "right" for k, v in la.items() if k.startswith("yaxis"))
    left = (LEFT_DOMAIN[0], LEFT_DOMAIN[1] - 0.1) if right_axis else LEFT_DOMAIN
    cols_a, cols_b = column_map(la, ids_a), column_map(lb, ids_b)
    _place_axes(la, layout, ids_a, offset_a, left, cols_a)
    _place_axes(lb, layout, ids_b, offset_b, RIGHT_DOMAIN, cols_b)
    layout["annotations"] = _place_refs(la.get("annotations"), offset_a, left, ("x",), cols_a) + _place_refs(
        lb.get("annotations"), offset_b, RIGHT_DOMAIN, ("x",), cols_b
    )
    layout["shapes"] = _place_refs(la.get("shapes"), offset_a, left, ("x0", "x1"), cols_a) + _place_refs(
        lb.get("shapes"), offset_b, RIGHT_DOMAIN, ("x0", "x1"), cols_b
    )
    _one_legend_entry_per_shape(layout["shapes"])
    menus = _menus(la, lb, len(traces_a), len(traces_b))

    # Run labels (with each run's own title where the titles differ, e.g. per-run numbers, or where a dropdown
    # changes them) in the top margin, above any subplot titles; the legend on the right, clear of both.
    titles = [
        _without_label((lay.get("title") or {}).get("text") or "", lab) for lay, lab in ((la, label_a), (lb, label_b))
    ]
    per_run = bool(menus) or (all(titles) and titles[0] != titles[1])
    label_index = []
    for text, sub, domain in ((label_a, titles[0], left), (label_b, titles[1], RIGHT_DOMAIN)):
        label_index.append(len(layout["annotations"]))
        layout["annotations"].append(
            {
                "text": _run_label(text, sub if per_run else None),
                "xref": "paper",
                "yref": "paper",
                "x": sum(domain) / 2,
                "y": 1.0,
                "yshift": 8,
                "showarrow": False,
                "xanchor": "center",
                "yanchor": "bottom",
                "font": {"size": 13},
                "name": "run label",
            }
        )
    title_text = wrap_to_px(title or titles[0], FIGURE_WIDTH - (200 if menus else 60), 16)  # clear of a dropdown
    title_px = 22 * title_text.count("<br>")
    layout["title"] = {
        "text": title_text,
        "x": 0.0,
        "xanchor": "left",
        "y": 1.0,
        "yref": "container",
        "yanchor": "top",
        "pad": {"l": 8},
    }
    base_margin = la.get("margin") or {}
    layout["margin"] = {**base_margin, "t": base_margin.get("t", 60), "r": 30}
    layout["meta"] = {"export_width": 1600}
    layout["width"] = None
    fit_subplot_titles({"layout": layout})  # each half's subplot titles wrapped to the half's panels
    layout.pop("width")
    subtitle_px = max(
        (18 * (a["text"].count("<br>") + 1) + 8 for a in layout["annotations"] if _is_top_title(a)),
        default=0,
    )
    label_lines = 1 + (max(wrap_note(t, 70).count("<br>") + 1 for t in titles if t) if per_run and any(titles) else 0)
    lift = 8 + subtitle_px
    for i in label_index:
        layout["annotations"][i]["yshift"] = lift
    plot_extra = lift + LABEL_ROW_PX * label_lines + title_px
    layout["margin"]["t"] = 50 + plot_extra
    layout["legend"] = dict(LEGEND_RIGHT)
    layout["height"] = max(la.get("height") or 420, lb.get("height") or 420) + plot_extra
    layout["title"]["y"] = 1.0 - (10 + 11 * title_text.count("<br>")) / layout["height"]  # as analysis.figures.style

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
    label_colour_bars(traces_a + traces_b)

    combined = {"data": traces_a + traces_b, "layout": layout}
    pairs = [
        (axis_name(letter, n), axis_name(letter, n + offset_b[letter]))
        for letter in ("x", "y")
        for n in ids_a[letter] & ids_b[letter]
    ]
    shared_axis_ranges(combined, pairs)
    if menus:
        _menu_states(combined, menus, pairs, label_index, (label_a, label_b))
    for n in ids_a["y"] & ids_b["y"]:  # B's y title when it repeats A's: the left one names both, and the gap
        left_title = (layout[axis_name("y", n)].get("title") or {}).get("text")  # between halves holds ticks only
        right = layout[axis_name("y", n + offset_b["y"])]
        if left_title and (right.get("title") or {}).get("text") == left_title and right.get("side") != "right":
            right["title"] = {**right["title"], "text": ""}
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


def _is_top_title(ann: dict) -> bool:
    return ann.get("name") is None and ann.get("yref") == "paper" and float(ann.get("y", 0)) >= 0.99


def _menu_states(combined: dict, menus: list[dict], pairs: list, label_index: list[int], labels: tuple) -> None:
    """Each dropdown button of the combined figure sets its own shared ranges (the layer it shows, not every
    layer at once) and the run labels' subtitles (that layer's titles); the first button's state is drawn
    first. The dropdown sits at the right of the title row, clear of the run labels."""
    layout = combined["layout"]
    for menu in menus:
        for k, button in enumerate(menu["buttons"]):
            visible = button["args"][0]["visible"]
            state = {
                "data": [{**copy.copy(tr), "visible": v} for tr, v in zip(combined["data"], visible)],
                "layout": copy.deepcopy(layout),
            }
            ranges = shared_axis_ranges(state, pairs, visible=visible)
            button["args"][0]["showlegend"] = _legend_entries(combined["data"], visible)
            relayout = {f"{name}.range": rng for name, rng in ranges.items()}
            for i, text, sub in zip(label_index, labels, button.pop("_titles")):
                relayout[f"annotations[{i}].text"] = _run_label(text, _without_label(sub, text) if sub else None)
            button["args"][1] = relayout
            if k == 0:
                for tr, v, shown in zip(combined["data"], visible, button["args"][0]["showlegend"]):
                    tr["visible"], tr["showlegend"] = v, shown
                for name, rng in ranges.items():
                    layout[name]["range"] = rng
                for i in label_index:
                    layout["annotations"][i]["text"] = relayout[f"annotations[{i}].text"]
        plot_h = layout["height"] - layout["margin"]["t"] - layout["margin"].get("b", 60)
        menu.update(x=1.0, xanchor="right", y=1.0 + (layout["margin"]["t"] - 6) / max(plot_h, 1), yanchor="top")
        menu["pad"] = {"r": 0, "t": 0}
    layout["updatemenus"] = menus


def _legend_entries(traces: list[dict], visible: list[bool]) -> list[bool]:
    """One legend entry per series name among the shown traces: the first shown trace of each name."""
    seen: set = set()
    out = []
    for tr, v in zip(traces, visible):
        name = tr.get("name")
        out.append(bool(v) and bool(name) and name not in seen and tr.get("type") not in ("heatmap",))
        if v and name:
            seen.add(name)
    return out


def placeholder_figure(reason: str) -> go.Figure:
    """An empty half for a run the view does not apply to: its reason, wrapped to stay inside that half, as a
    note in the middle of the half's (empty) panel."""
    fig = go.Figure()
    fig.add_annotation(
        text=f"not applicable: {wrap_note(reason, 40)}",
        xref="paper",
        yref="paper",
        x=0.5,
        y=0.5,
        **NOTE_STYLE,
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig
