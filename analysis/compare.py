"""Comparing two runs (two checkpoints on one text, or one checkpoint on two texts).

- ``side_by_side(view, a, b)``: the view drawn for both contexts in one figure, left and right, with
  matched axes (zooming one zooms the other; ranges cover both) and shared colour ranges.
- ``difference_view(view, a, b)``: where the two tidy tables align row for row, a heatmap of A - B on a
  diverging scale centred at 0.
- ``headline_numbers(ctx)`` / ``headline_table(a, b)``: the headline numbers of a run and their delta.

The "keys" of a tidy table (the columns that index it, e.g. layer and head) come from
``df.attrs["keys"]`` when a view sets it, else from a heuristic: text/categorical columns and integer
columns with an index-like name (layer, head, expert, ...). Numeric non-key columns are values.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis import degradation as dg
from analysis.style import DIVERGING, apply_style
from analysis.views import AnalysisContext, NotApplicable, View

KEY_NAMES = {
    "layer",
    "head",
    "depth",
    "expert",
    "token",
    "position",
    "query",
    "key",
    "rank",
    "step",
    "source",
    "site",
    "channel",
    "latent",
    "component",
    "run",
    "i",
    "j",
    "expert_i",
    "expert_j",
    "sublayer",
    "kind",
    "type",
    "layer_idx",
    "seq_len",
    "index",
    "curve",
    "stat",
    "metric",
}
LEFT_DOMAIN, RIGHT_DOMAIN = (0.0, 0.45), (0.55, 1.0)
_AXIS_RE = re.compile(r"^([xy])axis(\d*)$")
_REF_RE = re.compile(r"^([xy])(\d*)( domain)?$")


# ----------------------------------------------------------------------------- headline numbers
def moe_load_stats(load: np.ndarray) -> dict[str, float]:
    """Balance of one layer's expert load c[e]: MaxVio = max c / mean c - 1, CV = std c / mean c,
    normalised entropy -sum p log p / log E with p = c / sum c, dead experts (c = 0)."""
    c = np.asarray(load, dtype=np.float64).ravel()
    E = c.size
    if E == 0 or c.sum() <= 0:
        return {"maxvio": float("nan"), "cv": float("nan"), "entropy_norm": float("nan"), "dead": float(E)}
    mean = c.mean()
    p = c / c.sum()
    nz = p[p > 0]
    ent = float(-(nz * np.log(nz)).sum() / math.log(E)) if E > 1 else 1.0
    return {
        "maxvio": float(c.max() / mean - 1.0),
        "cv": float(c.std() / mean),
        "entropy_norm": ent,
        "dead": float((c == 0).sum()),
    }


def _moe_stats(trace) -> list[dict[str, float]]:
    """Per MoE layer load statistics: analysis.moe.load_imbalance when available (the MoE view's own
    definition), else ``moe_load_stats`` (the same formulas)."""
    try:
        from analysis.moe import load_imbalance
    except ImportError:
        load_imbalance = None
    stats = []
    for i in trace.layer_indices("moe"):
        load = trace.get(f"moe.{i}.load")
        if load is None:
            continue
        s = moe_load_stats(load)
        if load_imbalance is not None:
            try:
                ext = load_imbalance(np.asarray(load))
                s.update(
                    maxvio=float(ext["max_vio"]),
                    cv=float(ext["cv"]),
                    entropy_norm=float(ext["entropy"]),
                    dead=float(ext["dead"]),
                )
            except (KeyError, TypeError, ValueError):
                pass  # a changed API: keep the local definition
        stats.append(s)
    return stats


def attnres_embedding_weight(trace) -> float:
    """Mean depth-softmax weight on the embedding source over every AttnRes site, token and sequence."""
    sources = trace.meta.get("attnres_sources") or {}
    weights = []
    for name in trace.names("attnres."):
        p = trace[name]
        if p.ndim != 3:
            continue
        site = name[len("attnres.") :]
        names = sources.get(site) or []
        idx = names.index("embedding") if "embedding" in names else 0
        weights.append(float(np.asarray(p, dtype=np.float64)[..., idx].mean()))
    return float(np.mean(weights)) if weights else float("nan")


def kda_horizons(trace) -> np.ndarray:
    """Per KDA layer, head and channel: memory horizon 1 / (1 - alpha) tokens with alpha = exp(mean_t g), the
    per-channel geometric-mean decay (as analysis.density.kda_channel_decay); inf where alpha = 1 (g = 0)."""
    values = []
    for i in trace.layer_indices("kda"):
        g = trace.get(f"kda.{i}.g")
        if g is None:
            continue
        g = np.asarray(g, dtype=np.float64)
        g_mean = g.reshape(-1, g.shape[-2], g.shape[-1]).mean(0)
        with np.errstate(divide="ignore"):
            values.append(np.where(g_mean < 0, -1.0 / np.expm1(np.minimum(g_mean, -1e-300)), np.inf).ravel())
    return np.concatenate(values) if values else np.zeros(0)


def kda_horizon_summary(trace) -> dict[str, float]:
    """Mean horizon over the channels with a finite one, median over all, and the share with alpha = 1 in fp32."""
    h = kda_horizons(trace)
    if h.size == 0:
        return {
            "kda_horizon_mean": float("nan"),
            "kda_horizon_median": float("nan"),
            "kda_horizon_inf_share": float("nan"),
        }
    finite = h[np.isfinite(h)]
    return {
        "kda_horizon_mean": float(finite.mean()) if finite.size else float("inf"),
        "kda_horizon_median": float(np.median(h)),
        "kda_horizon_inf_share": float(1.0 - finite.size / h.size),
    }


def headline_numbers(ctx: AnalysisContext) -> dict[str, Any]:
    """The run's headline numbers on this trace (NaN where the trace or model lacks the data):

    loss (mean next-token NLL in nats over scored tokens), bits per token (= bits per byte for the
    byte-level vocab), mean causal-normalised MLA entropy, sink rate, mean rank-collapse ratio, mean token
    cosine, mean Block Influence, worst max/median activation ratio, max MaxVio / mean normalised entropy
    / mean CV / dead experts of the MoE load, mean AttnRes embedding weight, KDA horizon (mean over finite
    channels, median, share of channels that never decay), mean MLA
    output gate, and the final validation bits/byte from metrics.json when present.
    """
    trace = ctx.trace
    nan = float("nan")
    out: dict[str, Any] = {"label": ctx.label, "tokens": int(trace["tokens"].shape[-1]) if "tokens" in trace else 0}
    nll = trace.get("token_nll")
    loss = float(np.nanmean(nll)) if nll is not None and np.isfinite(nll).any() else nan
    out["loss"] = loss
    out["bits_per_token"] = loss / math.log(2) if math.isfinite(loss) else nan
    out["bits_per_byte"] = out["bits_per_token"] if ctx.config.vocab_size == 256 else nan
    out.update(dg.degradation_summary(trace))
    moe = _moe_stats(trace)
    out["moe_maxvio_max"] = max((s["maxvio"] for s in moe), default=nan)
    out["moe_entropy_norm_mean"] = float(np.mean([s["entropy_norm"] for s in moe])) if moe else nan
    out["moe_cv_mean"] = float(np.mean([s["cv"] for s in moe])) if moe else nan
    out["moe_dead_experts"] = float(sum(s["dead"] for s in moe)) if moe else nan
    out["attnres_embedding_weight_mean"] = attnres_embedding_weight(trace)
    out.update(kda_horizon_summary(trace))
    try:
        out["mla_gate_mean"] = float(dg.mla_gate_table(trace)["gate_mean"].mean())
    except dg.MissingTraceData:
        out["mla_gate_mean"] = nan
    if ctx.metrics:
        from analysis.history import final_numbers

        final = final_numbers(ctx.metrics)
        out["train_final_val_bpb"] = final.get("final_val_bpb", final.get("val_bpb", nan))
    return out


HEADLINE_LABELS = {
    "loss": "loss (nats/token)",
    "bits_per_token": "bits/token",
    "bits_per_byte": "bits/byte",
    "mla_entropy_norm_mean": "MLA entropy (normalised, mean)",
    "sink_rate": "sink rate",
    "rank_collapse_mean": "rank-collapse ratio (mean over depth)",
    "token_cosine_mean": "token cosine (mean)",
    "block_influence_mean": "Block Influence (mean)",
    "massive_ratio_max": "max/median |h| (worst depth)",
    "moe_maxvio_max": "MoE MaxVio (max over layers)",
    "moe_entropy_norm_mean": "MoE load entropy (normalised)",
    "moe_cv_mean": "MoE load CV (mean)",
    "moe_dead_experts": "MoE dead experts",
    "attnres_embedding_weight_mean": "AttnRes embedding weight (mean)",
    "kda_horizon_mean": "KDA horizon, mean of finite (tokens)",
    "kda_horizon_median": "KDA horizon, median (tokens)",
    "kda_horizon_inf_share": "KDA channels with alpha = 1",
    "mla_gate_mean": "MLA output gate (mean)",
    "train_final_val_bpb": "val bits/byte (training)",
    "tokens": "tokens traced",
}


def headline_table(a: AnalysisContext | dict, b: AnalysisContext | dict) -> pd.DataFrame:
    """Headline numbers of two runs with delta = A - B. Columns: metric, description, a, b, delta.

    Accepts contexts or already computed ``headline_numbers`` dicts; ``df.attrs`` holds the labels."""
    ha = a if isinstance(a, dict) else headline_numbers(a)
    hb = b if isinstance(b, dict) else headline_numbers(b)
    rows = []
    for key in [k for k in ha if k != "label"] + [k for k in hb if k not in ha and k != "label"]:
        va, vb = _num(ha.get(key)), _num(hb.get(key))
        rows.append({"metric": key, "description": HEADLINE_LABELS.get(key, key), "a": va, "b": vb, "delta": va - vb})
    df = pd.DataFrame(rows)
    df.attrs.update(label_a=str(ha.get("label", "A")), label_b=str(hb.get("label", "B")), keys=["metric"])
    return df


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


# ----------------------------------------------------------------------------- side by side
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


def _cartesian(trace: dict) -> bool:
    return trace.get("type", "scatter") not in _NON_CARTESIAN


def _axis_ids(fig: dict) -> dict[str, set[int]]:
    """Numbers of the x and y axes a figure dict uses (layout axes and trace references)."""
    ids: dict[str, set[int]] = {"x": set(), "y": set()}
    for key in fig.get("layout", {}):
        m = _AXIS_RE.match(key)
        if m:
            ids[m.group(1)].add(int(m.group(2) or 1))
    for tr in fig.get("data", []):
        if _cartesian(tr):
            for letter in ("x", "y"):
                ref = tr.get(f"{letter}axis") or letter
                ids[letter].add(int(ref[1:] or 1))
    return ids


def _ref(letter: str, n: int) -> str:
    return letter if n == 1 else f"{letter}{n}"


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


def _value_range(tr: dict) -> tuple[float, float] | None:
    """Colour range of a trace dict: explicit zmin/zmax, else the finite min/max of z (None without z)."""
    if tr.get("z") is None:
        return None
    lo, hi = tr.get("zmin"), tr.get("zmax")
    if lo is None or hi is None:
        try:
            z = np.asarray(tr["z"], dtype=np.float64)
        except (TypeError, ValueError):
            return None
        finite = z[np.isfinite(z)]
        if not finite.size:
            return None
        lo = float(finite.min()) if lo is None else lo
        hi = float(finite.max()) if hi is None else hi
    return float(lo), float(hi)


def _share_colours(traces_a: list[dict], traces_b: list[dict]) -> None:
    """Give paired z-traces (same position and type) the union colour range; only the right one keeps a bar."""
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
            tr.pop("zauto", None)
        ta["showscale"] = False


def _place_axes(
    layout: dict, out_layout: dict, ids: dict, offset: dict, domain: tuple[float, float], match_ids: dict | None
) -> None:
    """Copy a figure's axes into the combined layout, renumbered by ``offset`` and squeezed into ``domain``;
    with ``match_ids`` (the left figure's axes) each axis matches its left counterpart."""
    overlaying = set()
    for letter in ("x", "y"):
        for n in sorted(ids[letter]):
            src = copy.deepcopy(layout.get(f"{letter}axis{'' if n == 1 else n}", {}))
            new_n = n + offset[letter]
            for attr in ("anchor", "overlaying", "matches", "scaleanchor"):
                if attr in src:
                    src[attr] = _remap_ref(src[attr], offset)
            if letter == "x" and not src.get("overlaying"):
                d = src.get("domain", [0.0, 1.0])
                src["domain"] = [_squeeze(d[0], domain), _squeeze(d[1], domain)]
            other = "y" if letter == "x" else "x"
            src.setdefault("anchor", _ref(other, 1 + offset[other]))
            if src.get("overlaying"):
                overlaying.add(n)
            elif match_ids is not None and n in match_ids[letter]:
                src["matches"] = _ref(letter, n)
            out_layout[f"{letter}axis{'' if new_n == 1 else new_n}"] = src


def _place_refs(items: list[dict], offset: dict, domain: tuple[float, float], coords: tuple[str, ...]) -> list[dict]:
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


def combine_side_by_side(
    fig_a: go.Figure, fig_b: go.Figure, label_a: str, label_b: str, title: str | None = None
) -> go.Figure:
    """Place two figures left and right in one figure: B's axes match A's (shared ranges and zoom),
    heatmap colour ranges are the union of both, legends are linked, run labels head each half."""
    da, db = fig_a.to_plotly_json(), fig_b.to_plotly_json()
    la, lb = da.get("layout", {}), db.get("layout", {})
    ids_a, ids_b = _axis_ids(da), _axis_ids(db)
    offset_a = {"x": 0, "y": 0}
    offset_b = {"x": max(ids_a["x"] | {0}), "y": max(ids_a["y"] | {0})}
    traces_a = [copy.copy(t) for t in da.get("data", [])]
    traces_b = [copy.copy(t) for t in db.get("data", [])]
    _share_colours(traces_a, traces_b)

    skip = ("annotations", "shapes", "title", "height", "width", "meta")
    layout = {k: copy.deepcopy(v) for k, v in la.items() if not _AXIS_RE.match(k) and k not in skip}
    _place_axes(la, layout, ids_a, offset_a, LEFT_DOMAIN, None)
    _place_axes(lb, layout, ids_b, offset_b, RIGHT_DOMAIN, ids_a)
    layout["annotations"] = _place_refs(la.get("annotations"), offset_a, LEFT_DOMAIN, ("x",)) + _place_refs(
        lb.get("annotations"), offset_b, RIGHT_DOMAIN, ("x",)
    )
    layout["shapes"] = _place_refs(la.get("shapes"), offset_a, LEFT_DOMAIN, ("x0", "x1")) + _place_refs(
        lb.get("shapes"), offset_b, RIGHT_DOMAIN, ("x0", "x1")
    )
    titles = [(la.get("title") or {}).get("text") or "", (lb.get("title") or {}).get("text") or ""]
    if titles[0] != titles[1]:  # per-run numbers in the titles (e.g. a sink rate): keep them under the labels
        label_a, label_b = (
            f"{lab}<br><span style='font-size:11px'>{t}</span>" for lab, t in zip((label_a, label_b), titles)
        )
    for text, domain in ((label_a, LEFT_DOMAIN), (label_b, RIGHT_DOMAIN)):
        layout["annotations"].append(
            {
                "text": f"<b>{text}</b>",
                "xref": "paper",
                "yref": "paper",
                "x": sum(domain) / 2,
                "y": 1.0,
                "yshift": 34,
                "showarrow": False,
                "xanchor": "center",
                "yanchor": "bottom",
                "font": {"size": 13},
            }
        )
    src_title = (la.get("title") or {}).get("text", "")
    layout["title"] = {"text": title or src_title, "x": 0.0, "xanchor": "left"}
    top = max(110, (layout.get("margin") or {}).get("t", 60) + 50) + (20 if titles[0] != titles[1] else 0)
    layout["margin"] = {**layout.get("margin", {}), "t": top}
    layout["height"] = max(la.get("height") or 420, lb.get("height") or 420) + 40
    layout["meta"] = {"export_width": 1600}

    names_a = {t.get("name") for t in traces_a if t.get("name")}
    for tr in traces_a:
        if tr.get("name") and not tr.get("legendgroup"):
            tr["legendgroup"] = tr["name"]
    for tr in traces_b:
        if _cartesian(tr):
            for letter in ("x", "y"):
                tr[f"{letter}axis"] = _remap_ref(tr.get(f"{letter}axis") or letter, offset_b)
        if tr.get("name"):
            tr.setdefault("legendgroup", tr["name"])
            if tr["name"] in names_a:
                tr["showlegend"] = False
    # Both inputs are valid figures and only references/ranges changed: skip plotly's (slow) re-validation of
    # the data and the template where this plotly version allows it.
    try:
        return go.Figure({"data": traces_a + traces_b, "layout": layout}, _validate=False)
    except TypeError:  # pragma: no cover - a plotly without the private flag
        return go.Figure({"data": traces_a + traces_b, "layout": layout})


Built = tuple[go.Figure, pd.DataFrame] | NotApplicable


def build_both(view: View, a: AnalysisContext, b: AnalysisContext) -> list[Built]:
    """``view.build`` for both contexts; a view that does not apply gives its NotApplicable instead."""
    out: list[Built] = []
    for ctx in (a, b):
        try:
            out.append(view.build(ctx))
        except NotApplicable as exc:
            out.append(exc)
    return out


def _placeholder(reason: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=f"not applicable: {reason}", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def side_by_side(
    view: View, a: AnalysisContext, b: AnalysisContext, built: list[Built] | None = None
) -> tuple[go.Figure, pd.DataFrame]:
    """The view for two contexts side by side on shared axes and colour ranges, and both tables (column 'run').

    ``built`` reuses ``build_both(view, a, b)``. Raises NotApplicable when the view applies to neither run;
    when it applies to one only, that one is drawn and the other half says why."""
    built = build_both(view, a, b) if built is None else built
    if all(isinstance(r, NotApplicable) for r in built):
        raise NotApplicable(f"{view.title}: not applicable to either run ({built[0]})")
    figs = [_placeholder(str(r)) if isinstance(r, NotApplicable) else r[0] for r in built]
    fig = combine_side_by_side(figs[0], figs[1], a.label, b.label, title=f"{view.title}: {a.label} vs {b.label}")
    tables = [r[1].assign(run=ctx.label) for r, ctx in zip(built, (a, b)) if not isinstance(r, NotApplicable)]
    table = pd.concat(tables, ignore_index=True)
    first = next(r[1] for r in built if not isinstance(r, NotApplicable))
    table.attrs.update({**first.attrs, "keys": ["run"] + list(table_keys(first))})
    return fig, table


# ----------------------------------------------------------------------------- difference
def table_keys(df: pd.DataFrame) -> list[str]:
    """Index-like columns of a tidy table: df.attrs['keys'] if set, else text columns and integer columns with
    an index-like name."""
    if df.attrs.get("keys"):
        return [k for k in df.attrs["keys"] if k in df.columns]
    keys = []
    for col in df.columns:
        s = df[col]
        if pd.api.types.is_bool_dtype(s):
            continue
        if not pd.api.types.is_numeric_dtype(s):
            keys.append(col)
        elif pd.api.types.is_integer_dtype(s) and str(col).lower() in KEY_NAMES:
            keys.append(col)
    return keys


def table_values(df: pd.DataFrame, keys: list[str]) -> list[str]:
    """Numeric, non-boolean, non-key columns."""
    return [
        c
        for c in df.columns
        if c not in keys and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
    ]


def difference_table(df_a: pd.DataFrame, df_b: pd.DataFrame, keys: list[str] | None = None) -> pd.DataFrame:
    """Align two tidy tables on their keys and subtract: keys + for each value column v: v_a, v_b, v_diff = A - B.

    Raises NotApplicable when the tables do not have the same columns, keys and rows."""
    if list(df_a.columns) != list(df_b.columns):
        raise NotApplicable(f"the tables have different columns: {list(df_a.columns)} vs {list(df_b.columns)}")
    if len(df_a) != len(df_b):
        raise NotApplicable(f"the tables have different shapes: {df_a.shape} vs {df_b.shape}")
    keys = table_keys(df_a) if keys is None else keys
    if not keys:
        raise NotApplicable("the table has no key columns to align the two runs on")
    values = table_values(df_a, keys)
    if not values:
        raise NotApplicable("the table has no numeric value columns")
    if df_a.duplicated(keys).any():
        raise NotApplicable(f"the keys {keys} do not identify the rows uniquely")
    merged = df_a[keys + values].merge(df_b[keys + values], on=keys, how="inner", suffixes=("_a", "_b"))
    if len(merged) != len(df_a):
        raise NotApplicable(f"the tables' keys {keys} do not match row for row ({len(merged)} of {len(df_a)} align)")
    for v in values:
        merged[f"{v}_diff"] = merged[f"{v}_a"] - merged[f"{v}_b"]
    merged.attrs.update(keys=keys, values=values)
    return merged


def difference_figure(diff: pd.DataFrame, value: str, title: str) -> go.Figure:
    """Heatmap of ``value``'s A - B on a diverging scale centred at 0 (symmetric range).

    The last key is the x axis; the other keys, joined, the rows (a single key gives one row)."""
    keys = diff.attrs["keys"]
    col = f"{value}_diff"
    x_key = keys[-1]
    row_keys = keys[:-1]
    if row_keys:
        rows = diff[row_keys].astype(str).agg(lambda r: " ".join(f"{k}={v}" for k, v in zip(row_keys, r)), axis=1)
    else:
        rows = pd.Series([value] * len(diff), index=diff.index)
    table = pd.DataFrame({"row": rows, "x": diff[x_key].astype(str), "d": diff[col]})
    pivot = table.pivot_table(index="row", columns="x", values="d", aggfunc="mean", sort=False)
    z = pivot.to_numpy(dtype=np.float64)
    finite = z[np.isfinite(z)]
    m = float(np.abs(finite).max()) if finite.size else 1.0
    m = m if m > 0 else 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=pivot.columns.tolist(),
            y=pivot.index.tolist(),
            colorscale=DIVERGING,
            zmid=0.0,
            zmin=-m,
            zmax=m,
            colorbar={"title": {"text": "A - B"}},
            hovertemplate="%{y} %{x}<br>A - B = %{z:.4g}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return apply_style(
        fig, title, x_key, " / ".join(row_keys) if row_keys else "", height=max(260, 90 + 28 * len(pivot))
    )


def difference_view(
    view: View, a: AnalysisContext, b: AnalysisContext, value: str | None = None, built: list[Built] | None = None
) -> tuple[go.Figure, pd.DataFrame]:
    """Build the view for both contexts and, when their tidy tables align, a heatmap of A - B.

    ``value`` picks the column (default ``df.attrs['value']``, else the first value column); ``built`` reuses
    ``build_both(view, a, b)``. Raises NotApplicable when either run lacks the view or the tables differ."""
    built = build_both(view, a, b) if built is None else built
    for r, ctx in zip(built, (a, b)):
        if isinstance(r, NotApplicable):
            raise NotApplicable(f"not applicable to {ctx.label}: {r}")
    df_a, df_b = built[0][1], built[1][1]
    diff = difference_table(df_a, df_b)
    values = diff.attrs["values"]
    value = value or df_a.attrs.get("value") or values[0]
    if value not in values:
        raise NotApplicable(f"{value!r} is not a value column of {view.key} ({values})")
    fig = difference_figure(diff, value, f"{view.title}: {value}, {a.label} - {b.label}")
    return fig, diff
