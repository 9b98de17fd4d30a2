"""The KDA decay gate: log decay g <= 0 per token, head and key channel (the one definition, used by the
layer ``k3core.modeling.layers.kda`` and by the weight-only analysis ``analysis.weights.decay``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATE_FORMS = ("lower_bound", "softplus")


def kda_decay_gate(
    z: torch.Tensor, a_log: torch.Tensor, form: str = "lower_bound", lower_bound: float = -5.0
) -> torch.Tensor:
    """g = log alpha from the gate input ``z`` (``dt_bias`` already added) and ``a_log`` (broadcast against z,
    one value per head):

        lower-bound gate (K3):        g = lb * sigmoid(exp(A_log) * z)      g in (lb, 0)
        softplus gate (Kimi Linear):  g = -exp(A_log) * softplus(z)         g in (-inf, 0)

    Computed in z's dtype (the layer passes fp32; the analysis fp64). Raises ValueError for another form."""
    a = a_log.exp()
    if form == "lower_bound":
        return lower_bound * torch.sigmoid(a * z)
    if form == "softplus":
        return -a * F.softplus(z)
    raise ValueError(f"unknown KDA gate {form!r} (expected one of {GATE_FORMS})")
