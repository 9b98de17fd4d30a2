"""Where the weight figures (``analysis.figures.weights``) read their ``WeightSummary``: ``ctx.weights``, or
for a loaded run without a summary one computed from the model's parameters (once per model)."""

from __future__ import annotations

import weakref

from analysis import weights as wt
from analysis.runs.context import AnalysisContext
from analysis.views.view import NotApplicable

_FROM_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_of(ctx: AnalysisContext) -> wt.WeightSummary:
    """The context's WeightSummary: ``ctx.weights``, else one computed from ``ctx.model`` (cached per model),
    else NotApplicable."""
    summary = getattr(ctx, "weights", None)
    if summary is not None:
        return summary
    model = getattr(ctx, "model", None)
    if model is None:
        raise NotApplicable(
            "needs the checkpoint: this run has neither its weights nor a weight summary (a trace folder opened "
            "without its checkpoint)"
        )
    summary = _FROM_MODEL.get(model)
    if summary is None:
        try:
            summary = wt.summary_of_model(model, label=ctx.label)
        except wt.OffloadedWeights as exc:
            raise NotApplicable(f"weights not in memory: {exc}") from exc
        _FROM_MODEL[model] = summary
    return summary


def run_label(ctx: AnalysisContext, summary: wt.WeightSummary) -> str:
    """The run's name in a figure title: the context's label, else the summary's."""
    return ctx.label or summary.label
