"""Shared fixtures for the k3core tests: tiny real models (no mocks), seeded."""

from __future__ import annotations

import os

import pytest
import streamlit  # noqa: F401 - before analysis: importing streamlit sets plotly's default template to its own
import torch

from app.server.settings import STREAMLIT_OPTIONS
from k3core.interp.recorder import record
from k3core.interp.trace import Trace
from k3core.modeling.config import K3Config
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

# The tests run tiny models on a small shared CPU: with several threads per process every small op pays for
# thread hand-offs (measured 20-50x slower under load), so the suite uses one thread unless told otherwise.
torch.set_num_threads(int(os.environ.get("K3LAB_TEST_THREADS", "1")))
for _key, _value in STREAMLIT_OPTIONS.items():  # AppTest runs the app as `k3lab app` serves it
    streamlit.config.set_option(_key, _value)

# `./k3lab.sh test` runs the suite on two pytest-xdist workers with --dist loadfile: each test module goes to one
# worker as a whole, so its module-scoped fixtures (app servers, checkpoints, replicas) are built once. The modules
# below count as one file: they share the session's sparse_k3 replica (built once), and the multi-GB replica runs
# never run side by side. (xdist's own --dist loadgroup marks do not group under pytest 9.2: pytest-xdist#1386.)
SHARED_GROUPS = {
    "test_weights": "k3-replicas",
    "test_rank_plan": "k3-replicas",
    "test_k3_published": "k3-replicas",
    "test_k3_stream": "k3-replicas",
}


def test_group(nodeid: str) -> str:
    """The unit of work a test goes out in under --dist loadfile: its file, or its SHARED_GROUPS group."""
    file = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(file.rsplit("/", 1)[-1].removesuffix(".py"), file)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    config.option.loadscopereorder = False  # keep the order below, not "most tests first"
    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config, items):
    """On an xdist worker, the groups holding slow or browser tests first (stable order otherwise): the controller
    hands groups out in collection order, and a long group started last would leave one worker running alone."""
    if not hasattr(config, "workerinput"):
        return
    long = {test_group(i.nodeid) for i in items if i.get_closest_marker("slow") or i.get_closest_marker("browser")}
    items.sort(key=lambda i: test_group(i.nodeid) not in long)


def nano_config(**overrides) -> K3Config:
    """The k3-nano preset (every mechanism on) with a small KDA chunk so that short inputs stay cheap."""
    overrides.setdefault("kda_chunk_size", 8)
    return from_preset("k3-nano", **overrides)


def nano_model(seed: int | None = 0, **overrides) -> K3ForCausalLM:
    """A freshly initialised k3-nano (eval mode; ``nano_config``), deterministic for a given seed (None: the global
    generator as it stands). The one small test model: tests build it here rather than spelling the config out."""
    if seed is not None:
        torch.manual_seed(seed)
    return K3ForCausalLM.from_config(nano_config(**overrides)).eval()


def random_ids(T: int = 40, B: int = 2, seed: int = 0) -> torch.Tensor:
    """[B, T] random byte ids from a generator of their own (the global RNG is left alone)."""
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def traced(model: K3ForCausalLM, ids: torch.Tensor) -> Trace:
    """Everything recorded (``what="all"``, both sequences) on one forward with labels."""
    with record(model, what="all", max_batch=2) as trace:
        model(ids, labels=ids)
    return trace


def traced_nano(seed: int = 0, T: int = 40, **overrides) -> tuple[K3ForCausalLM, torch.Tensor, Trace]:
    """The analysis tests' run: a k3-nano (KDA chunk 16 unless given) of ``seed``, traced on [2, T] random ids
    of the same seed."""
    overrides.setdefault("kda_chunk_size", 16)
    model = nano_model(seed, **overrides)
    ids = random_ids(T, 2, seed)
    return model, ids, traced(model, ids)


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


@pytest.fixture(scope="session")
def sparse_k3(tmp_path_factory):
    """The sparse Kimi K3 replica of tests/analysis/weights/test_weights.build_sparse_k3 (BF16, every tensor declared),
    built once for the session: test_weights and test_rank_plan only read it."""
    from .analysis.weights.test_weights import build_sparse_k3

    return build_sparse_k3(tmp_path_factory.mktemp("sparse-k3"))


@pytest.fixture
def tokens() -> torch.Tensor:
    """[2, 7] random byte ids."""
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(123))
