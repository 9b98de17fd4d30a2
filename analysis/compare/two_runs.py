"""Comparing two runs (two checkpoints on one text, or one checkpoint on two texts), view by view.

Each view declares how it is compared (``View.compare``, an ``analysis.views.view.Comparison``):

- ``side_by_side(view, a, b)``: the view drawn for both contexts in one figure, left and right, on
  shared axis ranges and one colour scale (``analysis.compare.side_by_side``); views that overlay runs
  themselves (training history) are drawn once with run B overlaid;
- ``difference_view(view, a, b)``: for views that declare difference columns, A - B of those columns
  on the declared keys (``analysis.compare.difference``); NotApplicable for every other view, with its reason.

Headline numbers and their delta live in ``analysis.metrics.headline``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.compare.difference import LEARNED_UNITS, difference_figure, difference_table, readable, reduce_keys
from analysis.compare.side_by_side import combine_side_by_side, placeholder_figure
from analysis.runs.context import AnalysisContext
from analysis.views.picks import focus_title
from analysis.views.view import NotApplicable, View

Built = tuple[go.Figure, pd.DataFrame] | NotApplicable


def quantised_copy(folder_a: str | Path, folder_b: str | Path) -> bool:
    """Whether one of two checkpoint folders is a quantised copy of the other: exactly one has a
    ``quantization_config`` in its config.json and both share the model's shape (layers, hidden size, vocabulary,
    experts, layer types, residual; widths may differ: MXFP4 pads them to its 32-value blocks, e.g. the samples'
    k3-full 40 -> k3-mxfp4 64). Their differences are rounding (~1e-5), not two trained runs (no seed noise between
    them), nor a comparison anyone means by default. False when a config cannot be read."""
    from k3core.loading.folder import read_config

    shape = ("num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "full_attn_layers", "residual")
    folders = (Path(folder_a), Path(folder_b))
    try:
        # anywhere in the file: Kimi K3's config nests it in text_config
        raw = [(f / "config.json").read_text() for f in folders]
        ca, cb = (read_config(f).to_dict() for f in folders)
    except Exception:  # noqa: BLE001 - any unreadable config: not a copy; the loader reports it when picked
        return False
    one_quantised = ('"quantization_config"' in raw[0]) != ('"quantization_config"' in raw[1])
    return one_quantised and all(ca.get(k) == cb.get(k) for k in shape)


def distinct_labels(label_a: str, label_b: str) -> tuple[str, str]:
    """The two runs' labels, told apart with " (A)" / " (B)" only when they are equal."""
    if label_a == label_b:
        return f"{label_a} (A)", f"{label_b} (B)"
    return label_a, label_b


def build_both(view: View, a: AnalysisContext, b: AnalysisContext) -> list[Built]:
    """``view.build`` for both contexts; a view that does not apply gives its NotApplicable instead."""
    out: list[Built] = []
    for ctx in (a, b):
        try:
            out.append(view.build(ctx))
        except NotApplicable as exc:
            out.append(exc)
    return out


def _overlay(view: View, a: AnalysisContext, b: AnalysisContext) -> tuple[go.Figure, pd.DataFrame]:
    """A view that draws several runs itself (history): A's context with B's metrics overlaid."""
    overlay = dict(a.options.get("overlay_metrics") or {})
    if b.metrics:
        overlay.setdefault(b.label, b.metrics)
    ctx = AnalysisContext(
        trace=a.trace,
        config=a.config,
        model=a.model,
        input_ids=a.input_ids,
        metrics=a.metrics,
        label=a.label,
        options={**a.options, "overlay_metrics": overlay},
    )
    return view.build(ctx)


def side_by_side(
    view: View, a: AnalysisContext, b: AnalysisContext, built: list[Built] | None = None
) -> tuple[go.Figure, pd.DataFrame]:
    """The view for two contexts on shared axes and one colour scale, and both tables (column ``run``).

    ``built`` reuses ``build_both(view, a, b)``. Raises NotApplicable when the view applies to neither run;
    when it applies to one only, that one is drawn and the other half says why."""
    if view.compare.overlay:
        return _overlay(view, a, b)
    built = build_both(view, a, b) if built is None else built
    if all(isinstance(r, NotApplicable) for r in built):
        raise NotApplicable(f"not applicable to either run ({built[0]})")
    figs = [placeholder_figure(str(r)) if isinstance(r, NotApplicable) else r[0] for r in built]
    title = f"{view.title}{focus_title(view, a, b)}: {a.label} vs {b.label}"
    fig = combine_side_by_side(figs[0], figs[1], a.label, b.label, title=title)
    tables = [r[1].assign(run=ctx.label) for r, ctx in zip(built, (a, b)) if not isinstance(r, NotApplicable)]
    table = pd.concat(tables, ignore_index=True)
    first = next(r[1] for r in built if not isinstance(r, NotApplicable))
    table.attrs.update({**first.attrs, "keys": ["run"] + list(first.attrs.get("keys", []))})
    return fig, table


def checkpoint_identity(ctx: AnalysisContext) -> str | None:
    """What names a context's checkpoint: the traced run's saved fingerprint, or (a weights-only context, no trace)
    the folder its weights were read from; None when neither is known."""
    if ctx.trace is not None:
        found = ((ctx.trace.meta or {}).get("run") or {}).get("fingerprint")
        return found if found and found != "unsaved" else None
    path = getattr(ctx.weights, "path", "")
    return f"path:{Path(path).resolve()}" if path else None


def same_weights(a: AnalysisContext, b: AnalysisContext) -> bool:
    """Whether both contexts ran one checkpoint (the same model object, one saved fingerprint, or one weights
    folder)."""
    if a.model is not None and a.model is b.model:
        return True
    fa, fb = checkpoint_identity(a), checkpoint_identity(b)
    return fa is not None and fa == fb


def has_difference(view: View) -> bool:
    """Whether the view declares a difference A - B at all."""
    return bool(view.compare.difference) and not view.compare.overlay


def difference_view(
    view: View, a: AnalysisContext, b: AnalysisContext, built: list[Built] | None = None
) -> tuple[go.Figure, pd.DataFrame]:
    """A - B of the view's declared difference columns on its declared keys, as a figure and table.

    Raises NotApplicable when the view declares no difference, either run lacks the view, the rows are
    learned units of two different checkpoints (``same_weights``), or the tables do not align."""
    spec = view.compare
    if not has_difference(view):
        if view.section == "weights" and same_weights(a, b):
            # one run on two texts: not "different learned units" (that is two checkpoints), the very same weights
            raise NotApplicable("both sides are one checkpoint's weights, which do not depend on the text: A - B is 0")
        raise NotApplicable(spec.no_difference)
    if spec.same_weights and not same_weights(a, b):
        raise NotApplicable(
            "its rows are learned units (experts) of one checkpoint: expert i of one run is not expert i of "
            "another, so A - B is shown only for one run on two texts"
        )
    built = build_both(view, a, b) if built is None else built
    for r, ctx in zip(built, (a, b)):
        if isinstance(r, NotApplicable):
            raise NotApplicable(f"not applicable to {ctx.label}: {r}")
    df_a, df_b = built[0][1], built[1][1]
    keys = list(spec.keys or df_a.attrs.get("keys") or [])
    values = list(spec.difference)
    reduce = list(spec.reduce)
    units = [k for k in keys if k in LEARNED_UNITS and k not in reduce]
    if units and not spec.same_weights and not same_weights(a, b):
        reduce += units  # head i of one checkpoint is not head i of another: the mean over heads is comparable
    df_a, df_b = (reduce_keys(df, keys, values, reduce) for df in (df_a, df_b))
    keys = [k for k in keys if k not in reduce]
    diff = difference_table(df_a, df_b, keys, values)
    changed = diff[[f"{v}_diff" for v in values]].to_numpy(dtype=float)
    if np.all(np.nan_to_num(changed) == 0.0):
        raise NotApplicable(
            f"A - B is zero everywhere: the two runs have the same {', '.join(readable(v) for v in values)} "
            "(it follows from the configuration alone, or the runs agree)"
        )
    what = ", ".join(readable(v) for v in values)
    averaged = f" (mean over {', '.join(readable(k) + 's' for k in reduce)})" if reduce else ""
    x = spec.x if spec.x in keys else None
    focus = focus_title(view, a, b)
    fig = difference_figure(diff, f"{view.title}{focus}: {what}{averaged}, {a.label} - {b.label}", x=x)
    return fig, diff
