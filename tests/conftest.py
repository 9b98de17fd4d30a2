"""Shared fixtures for the k3core tests: tiny real models (no mocks), seeded."""

from __future__ import annotations

import os

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.presets import from_preset

# The tests run tiny models on a small shared CPU: with several threads per process every small op pays for
# thread hand-offs (measured 20-50x slower under load), so the suite uses one thread unless told otherwise.
torch.set_num_threads(int(os.environ.get("K3LAB_TEST_THREADS", "1")))


def nano_config(**overrides) -> K3Config:
    """The k3-nano preset (every mechanism on) with a small KDA chunk so that short inputs stay cheap."""
    overrides.setdefault("kda_chunk_size", 8)
    return from_preset("k3-nano", **overrides)


def nano_model(seed: int = 0, **overrides) -> K3ForCausalLM:
    """A freshly initialised k3-nano (eval mode), deterministic for a given seed."""
    torch.manual_seed(seed)
    return K3ForCausalLM.from_config(nano_config(**overrides)).eval()


def randomize_attnres_queries(model: K3ForCausalLM, std: float = 0.5, seed: int = 1) -> None:
    """Give every AttnRes pseudo-query (zero at init) a random value, so depth mixes are not uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def nano() -> K3ForCausalLM:
    return nano_model()


@pytest.fixture
def tokens() -> torch.Tensor:
    """[2, 7] random byte ids."""
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(123))
