"""The View type: one figure of the catalogue (``analysis.views.catalogue``) and how it compares two runs.

A view turns an ``AnalysisContext`` (``analysis.runs.context``) into a plotly figure plus the tidy table it was drawn
from. A view that cannot be drawn for this context (e.g. no MoE layers) raises ``NotApplicable``. The figure
modules under ``analysis/figures/`` define views with this type; they never import the catalogue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import plotly.graph_objects as go

from analysis.runs.context import AnalysisContext


class NotApplicable(Exception):
    """This view has nothing to show for this run (the message says why)."""


@dataclass(frozen=True)
class Comparison:
    """How a view compares two runs (``analysis.compare.two_runs``), declared by the view itself.

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


LAYER, HEAD = "layer", "head"  # the axes a view can be picked on (``View.picks``; ``analysis.views.picks``)
AXES = (LAYER, HEAD)


@dataclass(frozen=True)
class PickChoices:
    """The valid picks of one view for one context: ``mechanism`` names the layers ("KDA", "MLA", "MoE",
    "AttnRes"), ``layers`` are this run's layers with it (0-based decoder layers), ``heads`` its head indices
    (empty: the view has no head axis)."""

    mechanism: str
    layers: tuple[int, ...]
    heads: tuple[int, ...] = ()

    def values(self, axis: str) -> tuple[int, ...]:
        return self.layers if axis == LAYER else self.heads

    def label(self, axis: str, value: int | None) -> str:
        """What a picker shows for a value: "MLA layer 3", "head 1"; None: "all MLA layers", "all heads"."""
        if axis == LAYER:
            return (
                f"all {self.mechanism} layers".replace("  ", " ")
                if value is None
                else f"{self.mechanism} layer {value}".strip()
            )
        return "all heads" if value is None else f"head {value}"


@dataclass(frozen=True)
class Picks:
    """What a view declares: the axes it can focus on (``("layer",)`` or ``("layer", "head")``) and
    ``choices(ctx)`` (raises NotApplicable when the view has nothing to show for the context)."""

    axes: tuple[str, ...]
    choices: Callable[[AnalysisContext], PickChoices]
    # The figure shows one layer at a time: a picker offers no "all" (its first layer is the default), so the page
    # has one layer selector, not a picker saying "all" beside a dropdown in the plot saying "layer 1".
    one_at_a_time: bool = False

    def __post_init__(self) -> None:
        unknown = [a for a in self.axes if a not in AXES]
        if unknown or not self.axes:
            raise ValueError(f"pick axes must be among {AXES}, got {self.axes}")


@dataclass(frozen=True)
class View:
    key: str  # stable id, used in file names: "moe_load_heatmap"
    title: str
    section: str  # "density", "attnres", "moe", "degradation", "history"
    build: Callable[[AnalysisContext], tuple[go.Figure, pd.DataFrame]]
    needs_model: bool = False
    description: str = ""
    compare: Comparison = field(default_factory=Comparison)
    # Drawn from the checkpoint's weights alone (``ctx.weights``, or a loaded model's parameters), so it needs
    # no trace: the Weights page and ``k3lab weights`` draw every such view, whatever its section.
    from_weights: bool = False
    # Drawn from the config alone (parameter and cache arithmetic), not measured on the text: a mechanism page opens
    # with its measured views and draws these on request.
    from_config: bool = False
    # Per layer / per head: the axes the view can focus on and their valid choices for a context
    # (``analysis.views.picks`` has the choices per mechanism and the checks); the build reads the pick from
    # ``ctx.options["layer"]`` / ``ctx.options["head"]`` and shows everything, as without picks, when none is given.
    picks: Picks | None = None
