"""The analysis context: what every view is drawn from.

Where it sits in the flow: ``analysis.runs.loading.trace_run`` (a loaded ``Run`` traced on an ``Input``) returns one;
the weights path (``analysis.weights``) makes one with ``weights`` set and no trace. Views (``analysis.views.view``)
take it and return (figure, table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from k3core.interp.trace import Trace
from k3core.modeling.config import K3Config


@dataclass
class AnalysisContext:
    """What every view draws from: a run's trace on one input (``analysis.runs.loading.trace_run``), or a checkpoint's
    weight summary (``weights``, no trace) on the weights path; plus the config, the model when loaded, the
    tokens, the training metrics, the label and the view options. Views never change it."""

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
        """The mean loss of the traced forward (nats/token), as ``analysis.runs.loading.trace_run`` stored it."""
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
    def repeat_start(self) -> int | None:
        """The first position of a copy task's second half (the built-in ``repeat`` sample), else None."""
        start = ((self.trace.meta or {}).get("run") or {}).get("repeat_start")
        return int(start) if start is not None else None

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
