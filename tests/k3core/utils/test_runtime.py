"""k3core.utils.runtime.configure_threads: the environment wins, small CPU models get one thread."""

import pytest
import torch

from k3core.modeling.model import K3ForCausalLM
from k3core.utils.runtime import SMALL_MODEL_PARAMETERS, configure_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_environment_variable_wins(monkeypatch):
    monkeypatch.setenv("K3LAB_THREADS", "2")
    assert configure_threads(K3ForCausalLM.from_config("k3-nano")) == 2


def test_small_cpu_model_runs_on_one_thread(monkeypatch):
    monkeypatch.delenv("K3LAB_THREADS", raising=False)
    torch.set_num_threads(2)
    model = K3ForCausalLM.from_config("k3-nano")
    assert model.num_parameters() < SMALL_MODEL_PARAMETERS
    assert configure_threads(model) == 1


def test_large_model_keeps_the_default(monkeypatch):
    monkeypatch.delenv("K3LAB_THREADS", raising=False)
    torch.set_num_threads(2)
    big = torch.nn.Linear(5000, 5000)  # 25M parameters
    assert configure_threads(big) == 2
    assert configure_threads(None) == 2
