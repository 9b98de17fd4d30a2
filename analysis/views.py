"""The catalogue of views: one entry per figure the app, the report and the exports show.

A view turns an ``AnalysisContext`` (a trace, its config, optionally the model, the token batch
and a run's metrics history) into a plotly figure plus the tidy table it was drawn from. Domain
modules under ``analysis/figures/`` each expose ``VIEWS: list[View]``; ``all_views()`` gathers them.
A view that cannot be drawn for this context (e.g. no MoE layers) raises ``NotApplicable``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from k3core.config import K3Config
from k3core.trace import Trace


class NotApplicable(Exception):
    """This view has nothing to show for this run (the message says why)."""


@dataclass
class AnalysisContext:
    trace: Trace
    config: K3Config
    model: Any = None  # K3ForCausalLM, needed by importance views only
    input_ids: Any = None  # torch.LongTensor [batch, tokens] the trace was recorded on
    metrics: dict | None = None  # a run's metrics.json
    label: str = "run"
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"seq_len": 131072}


@dataclass(frozen=True)
class View:
    key: str  # stable id, used in file names: "moe_load_heatmap"
    title: str
    section: str  # "density", "attnres", "moe", "degradation", "history"
    build: Callable[[AnalysisContext], tuple[go.Figure, pd.DataFrame]]
    needs_model: bool = False
    description: str = ""


def all_views() -> list[View]:
    """Every registered view, in report order."""
    import importlib

    views: list[View] = []
    for module in ("density", "attnres", "moe", "degradation", "history"):
        try:
            mod = importlib.import_module(f"analysis.figures.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"analysis.figures.{module}":
                raise
            continue
        views.extend(getattr(mod, "VIEWS", []))
    return views
