"""k3core.training.load_stats: MoE MaxVio / CV on hand-computed loads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3core.training.load_stats import moe_load_stats


def test_maxvio_and_cv_by_hand():
    # c = [2, 2, 4, 0]: mean 2, max 4 -> MaxVio 4/2 - 1 = 1; population var (0+0+4+4)/4 = 2 -> CV sqrt(2)/2
    for load in (torch.tensor([2, 2, 4, 0]), np.array([2, 2, 4, 0]), [2, 2, 4, 0]):
        stats = moe_load_stats(load)
        assert set(stats) == {"max_vio", "cv"}
        assert stats["max_vio"] == pytest.approx(1.0)
        assert stats["cv"] == pytest.approx(math.sqrt(2) / 2)
    # c = [1, 3]: mean 2, MaxVio 0.5, std 1 -> CV 0.5
    assert moe_load_stats([1, 3]) == pytest.approx({"max_vio": 0.5, "cv": 0.5})


def test_balanced_is_zero_and_empty_is_nan():
    assert moe_load_stats(torch.full((8,), 5)) == {"max_vio": 0.0, "cv": 0.0}
    for empty in ([0, 0, 0], []):
        stats = moe_load_stats(empty)
        assert math.isnan(stats["max_vio"]) and math.isnan(stats["cv"])
