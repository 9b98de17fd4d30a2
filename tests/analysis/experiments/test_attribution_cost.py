"""analysis.experiments.attribution.attribution_forwards, the cost Compare shows before an attribution runs, against
the sequences a real k3-nano (MoE) runs through the model: every forward's batch rows counted, three for a row with
gradients (its forward and its backward)."""

from __future__ import annotations

import pytest
import torch

from analysis.experiments import attribution
from analysis.experiments.attribution_inputs import AttributionError
from analysis.experiments.layer_attribution import layer_attribution
from k3core.modeling.model import K3ForCausalLM


@pytest.fixture(scope="module")
def counted():
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config("k3-nano").eval()
    rows: list[int] = []

    def count(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        rows.append(ids.shape[0] * (3 if torch.is_grad_enabled() else 1))

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model, rows


@pytest.mark.parametrize(("n", "m", "steps"), [(5, 2, 8), (4, 3, 4)])
@pytest.mark.parametrize("method", [*attribution.METHODS, "layers"])
def test_the_estimate_is_the_count_of_sequences_run(counted, method, n, m, steps):
    model, rows = counted
    x, y = torch.randint(0, 256, (n,)), torch.randint(0, 256, (m,))
    rows.clear()
    if method == "layers":
        layer_attribution(model, x, y, steps)
    else:
        attribution.token_attribution(model, x, y, method, 0, None, steps, 3, 0)
    low, high = attribution.attribution_forwards(method, n, m, steps, samples=3, moe=True)
    if method == "ig_frozen_routing":  # adaptive: within its range
        assert low <= sum(rows) <= high, (sum(rows), low, high)
    else:
        assert sum(rows) == low == high


def test_an_unknown_method_is_named():
    with pytest.raises(AttributionError, match="unknown method 'lime'"):
        attribution.attribution_forwards("lime", 4, 2)
