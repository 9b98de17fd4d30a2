"""The catalogue of views: one entry per figure the app, the report and the exports show, in report order.

The figure modules under ``analysis/figures/`` each define ``VIEWS: list[View]`` (``analysis.views.view``) and never
import this module, so the catalogue imports them at the top without a circle. A new view goes into its
figure module's ``VIEWS``; a new figure module goes into ``MODULES`` below.
"""

from __future__ import annotations

from analysis.figures import (
    attention_kinds,
    attnres,
    degradation,
    density,
    experiment,
    history,
    kda_memory,
    long_context,
    moe,
    papers,
    weights,
)
from analysis.views.view import View

MODULES = (
    density,
    kda_memory,
    attnres,
    moe,
    degradation,
    long_context,
    history,
    weights,
    experiment,
    attention_kinds,
    papers,
)


def all_views() -> list[View]:
    """Every registered view, in report order."""
    return [view for module in MODULES for view in module.VIEWS]


def section_views(section: str) -> list[View]:
    """The views one page shows: a section's, in catalogue order; for "weights", every view drawn from the
    checkpoint's weights alone (``View.from_weights``), whatever its section."""
    if section == "weights":
        return [view for view in all_views() if view.from_weights]
    return [view for view in all_views() if view.section == section]
