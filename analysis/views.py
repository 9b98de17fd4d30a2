"""The catalogue of views: one entry per figure the app, the report and the exports show.

A view turns an ``AnalysisContext`` (a trace, its config, optionally the model, the token batch
and a run's metrics history) into a plotly figure plus the tidy table it was drawn from. Domain
modules under ``analysis/figures/`` each expose ``VIEWS: list[View]``; ``all_views()`` gathers them.
A view that cannot be drawn for this context (e.g. no MoE layers) raises ``NotApplicable``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    tokenizer: Any = None  # k3core.tokenizer.Tokenizer of the run (None: token ids are shown as numbers)
    weights: Any = None  # analysis.weights.WeightSummary: weight-only views (a checkpoint not loaded)
    # Results computed once per (model, tokens) and shared by every copy made with ``with_options``
    # (e.g. the importance ablations, which do not depend on the view options).
    shared: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def loss(self) -> float | None:
        """The mean loss of the traced forward (nats/token), as ``analysis.runs.trace_run`` stored it."""
        loss = ((self.trace.meta or {}).get("run") or {}).get("loss")
        return float(loss) if loss is not None else None

    def with_options(self, label: str | None = None, **options: Any) -> AnalysisContext:
        """The same trace, model and tokens under another label and view options (no copy of the trace)."""
        return replace(self, label=self.label if label is None else label, options={**self.options, **options})

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` the first time ``key`` is asked for on this context or its ``with_options`` copies."""
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]

    @property
    def token_strings(self) -> list[str] | None:
        """Readable strings of the traced tokens (first sequence of the batch, ``Tokenizer.token_strings``:
        ``'␣the'``, ``'↵'``, ``'<0xE2>'``), or None without a tokenizer or tokens."""
        if self.tokenizer is None or self.input_ids is None:
            return None
        ids = self.input_ids[0] if getattr(self.input_ids, "ndim", 1) > 1 else self.input_ids
        return self.tokenizer.token_strings(ids)

    def token_texts(self, token_ids: Any) -> list[str]:
        """A readable string per token id (any batch row): the tokenizer's, else the id as a number."""
        ids = [int(i) for i in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]
        return self.tokenizer.token_strings(ids) if self.tokenizer is not None else [str(i) for i in ids]

    def position_labels(self, positions: Any) -> list[str]:
        """``"12:␣the"`` for each token position of the first sequence (``k3core.tokenizer.token_axis_labels``
        style, unique per position); ``"12"`` without a tokenizer or beyond the tokens."""
        strings = self.token_strings or []
        return [f"{p}:{strings[p]}" if 0 <= p < len(strings) else str(p) for p in (int(q) for q in positions)]

    def token_axis(self, positions: Any, max_ticks: int = 48) -> dict[str, Any]:
        """Tick values and texts (``"12:␣the"``) for a numeric token-position axis: every position when at most
        ``max_ticks`` are shown, else an evenly spaced subset. Pass to ``fig.update_xaxes(**...)``; ``{}``
        without a tokenizer (plotly's own numeric ticks)."""
        if self.token_strings is None:
            return {}
        values = sorted({int(p) for p in positions})
        if len(values) > max_ticks:
            step = -(-len(values) // max_ticks)
            values = values[::step]
        return {"tickmode": "array", "tickvals": values, "ticktext": self.position_labels(values)}


@dataclass(frozen=True)
class Comparison:
    """How a view compares two runs (``analysis.compare``), declared by the view itself.

    ``overlay``: the view draws several runs in one figure (training history): the comparison is that
    figure with run B overlaid, not two halves. Otherwise the two runs are drawn side by side on shared
    axis ranges and one colour scale (always). ``difference`` names the value columns whose A - B is
    drawn; empty means the view has no difference figure and ``no_difference`` says why. ``keys`` are
    the columns that align the two tables row for row (default: the table's ``attrs["keys"]``);
    ``reduce`` lists key columns averaged over first (e.g. heads of a state norm over time); ``x`` is
    the key on the difference figure's x axis (default: the last key). ``same_weights``: rows are
    learned units (experts) that only correspond between two texts on one checkpoint.
    """

    difference: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    reduce: tuple[str, ...] = ()
    x: str | None = None
    same_weights: bool = False
    overlay: bool = False
    no_difference: str = "a difference A - B of this view has no meaning"


@dataclass(frozen=True)
class View:
    key: str  # stable id, used in file names: "moe_load_heatmap"
    title: str
    section: str  # "density", "attnres", "moe", "degradation", "history"
    build: Callable[[AnalysisContext], tuple[go.Figure, pd.DataFrame]]
    needs_model: bool = False
    description: str = ""
    compare: Comparison = field(default_factory=Comparison)


def all_views() -> list[View]:
    """Every registered view, in report order."""
    # Imported here, not at the top: each figures module imports View from this one.
    from analysis.figures import attnres, degradation, density, history, moe, weights

    return [view for module in (density, attnres, moe, degradation, history, weights) for view in module.VIEWS]
