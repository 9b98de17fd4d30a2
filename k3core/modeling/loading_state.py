"""What loading leaves on a model, as one declared field (``K3ForCausalLM.loading``), and the expert weight source
a model's MoE layers may read from instead of their stacked parameters: declared here, in the model's wing, so the
model knows the shape of what loading attaches without importing ``k3core.loading``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


class ExpertWeightSource(Protocol):
    """One MoE layer's experts, read on demand (``k3core.loading`` supplies one for a streamed run)."""

    def request(self, experts: torch.Tensor) -> None:
        """The experts the router chose ([tokens, k] ids): reads may start now, before ``weights`` asks."""

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of expert ``e``, on the compute device, in the compute dtype."""


@dataclass
class LoadingState:
    """What a model loaded from a checkpoint carries about its loading (None on a model built from a config).

    ``skipped_tensors``: stored tensors that are not the text model (vision, ...); ``placement``: the placement plan
    of ``device="auto"`` (``k3core.loading.placement.Plan``); ``offload_folder``: where that placement put weights
    that fit on no device; ``streaming``: a streamed run's session (``k3core.loading.streamed_run.StreamSession``:
    its plan, expert store, reader and progress)."""

    skipped_tensors: list[str] = field(default_factory=list)
    placement: Any = None
    offload_folder: Path | None = None
    streaming: Any = None
