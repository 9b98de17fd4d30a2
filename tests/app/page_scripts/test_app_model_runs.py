"""The views that run the model (analysis.figures.papers.MODEL_RUNS), headless (AppTest) on a real k3-nano
checkpoint: each is measured on its own button on the page its name says, its cost stated before it runs; pressing
it draws the figure, and the layer-importance button does not."""

from __future__ import annotations

import json

import pytest
import torch
from streamlit.testing.v1 import AppTest

from analysis.figures.papers import MODEL_RUNS, MQAR_VIEW
from app import page_registry
from k3core.modeling.model import K3ForCausalLM
from tests.app.apptest_helpers import APP, TIMEOUT
from tests.app.serving import serve_only

IMPORTANCE = "Measure layer importance"
ATTNRES = MODEL_RUNS["attnres_causal_sources"]
MQAR = MODEL_RUNS[MQAR_VIEW.key]


@pytest.fixture
def nano_app(monkeypatch, tmp_path) -> AppTest:
    torch.manual_seed(0)
    folder = K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path / "nano-runs")
    serve_only(monkeypatch, tmp_path, str(folder), str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 40  # a token count no other test uses: nothing cached yet
    at.run()
    return at


def _page(at: AppTest, name: str) -> AppTest:
    at = at.switch_page(page_registry.page(name).file).run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == []
    return at


def _titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def test_attnres_causal_effects_have_their_own_button_on_the_attnres_page(nano_app):
    at = _page(nano_app, "attnres")
    labels = [b.label for b in at.button]
    assert ATTNRES.button in labels and IMPORTANCE not in labels, labels
    assert any("forward passes on the 40 tokens" in c.value for c in at.caption)  # the cost, before it runs
    assert not any("causal effect" in t for t in _titles(at))
    # the importance ablations (KDA & density) do not draw it
    at = _page(at, "density")
    at = _button(at, IMPORTANCE).click().run()
    assert not at.exception and not any("causal effect" in t for t in _titles(at))
    at = _page(at, "attnres")
    assert ATTNRES.button in [b.label for b in at.button]
    assert not any("causal effect" in t for t in _titles(at))
    at = _button(at, ATTNRES.button).click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == []
    assert sum("routing weight vs causal effect" in t for t in _titles(at)) == 1, _titles(at)
    assert ATTNRES.button not in [b.label for b in at.button]  # the card goes in the run that measured it
    at = _page(at, "moe")
    at = _page(at, "attnres")  # measured once per run and text: drawn again without asking
    assert sum("routing weight vs causal effect" in t for t in _titles(at)) == 1
    assert ATTNRES.button not in [b.label for b in at.button]


def test_mqar_by_length_has_its_own_button_on_the_long_context_page(nano_app):
    at = _page(nano_app, "long_context")
    at = next(b for b in at.button if b.label.startswith("Run on")).click().run()
    assert not at.exception, [e.value for e in at.exception]
    labels = [b.label for b in at.button]
    assert MQAR.button in labels and IMPORTANCE not in labels, labels
    assert any("4 forward passes over 30,720 tokens" in c.value for c in at.caption)  # 8 x (256 + ... + 2,048)
    assert not any("MQAR accuracy" in t for t in _titles(at))
    at = _button(at, MQAR.button).click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == []
    assert sum("MQAR accuracy vs sequence length" in t for t in _titles(at)) == 1, _titles(at)
    assert MQAR.button not in [b.label for b in at.button]  # the card goes in the run that measured it
    at = at.run()  # measured once per run: drawn again without asking
    assert sum("MQAR accuracy vs sequence length" in t for t in _titles(at)) == 1
    assert MQAR.button not in [b.label for b in at.button]


def test_importance_does_not_draw_mqar_on_the_long_context_page(nano_app):
    """The importance ablations measured first (KDA & density): the Long context page still asks for MQAR."""
    at = _page(nano_app, "density")
    at = _button(at, IMPORTANCE).click().run()
    at = _page(at, "long_context")
    at = next(b for b in at.button if b.label.startswith("Run on")).click().run()
    assert MQAR.button in [b.label for b in at.button]
    assert not any("MQAR accuracy" in t for t in _titles(at))
