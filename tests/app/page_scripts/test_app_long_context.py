"""The Long context page, headless (AppTest) on a real k3-nano checkpoint: the estimate and the length chooser
first, nothing run until asked; Run draws every trace view; the cost measurement draws its figure; no exception."""

from __future__ import annotations

import pytest
import torch
from streamlit.testing.v1 import AppTest

from app.library import run_list
from app.server.settings import HOME_ENV
from k3core.modeling.model import K3ForCausalLM
from tests.app.apptest_helpers import APP, TIMEOUT
from tests.app.serving import serve_only


@pytest.fixture
def nano_app(monkeypatch, tmp_path) -> AppTest:
    torch.manual_seed(0)
    folder = K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path / "nano-long")
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(folder))
    empty = tmp_path / "no-samples"
    empty.mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", empty)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 48
    at.run()
    return at.switch_page("page_scripts/long_context.py").run()


def test_long_context_page_estimates_first_then_runs_on_request(nano_app):
    at = nano_app
    assert not at.exception, [e.value for e in at.exception]
    assert any("Estimate for 1,024 tokens" in i.value for i in at.info)
    assert at.select_slider(key="k3lab_long_length").value == 1024
    assert len(at.get("plotly_chart")) == 0  # nothing runs before the user asks
    run = next(b for b in at.button if b.label.startswith("Run on"))
    at = run.click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == 5, [e.value for e in at.info]  # loss, KDA state, horizon, MLA, KDA distance
    at.multiselect(key="k3lab_long_cost_lengths").set_value([256]).run()
    cost = next(b for b in at.button if b.label.startswith("Measure one forward"))
    at = cost.click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == 6
    assert [e.value for e in at.error] == []


def _no_question_left(at: AppTest) -> None:
    """Nothing of the question asked before the run is left on the page: no Run button, no banner."""
    assert not [b.label for b in at.button if b.label.startswith("Run on")]
    assert not [w.value for w in at.warning if "will read" in w.value]


def test_the_run_button_is_gone_once_the_run_is_done(nano_app):
    at = nano_app
    at = next(b for b in at.button if b.label.startswith("Run on")).click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == 5
    _no_question_left(at)


def test_a_long_recorded_text_asks_first_and_the_question_goes_once_answered(monkeypatch, tmp_path):
    """A trace folder whose recorded text is longer than LONG_INPUT_TOKENS: the page asks first (a banner and a Run
    button); once Run is clicked the charts are drawn and neither the banner nor its button is left above them."""
    from app.state.inputs import LONG_INPUT_TOKENS
    from k3lab.cli import main as k3lab

    torch.manual_seed(0)
    nano = K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path / "nano")
    n = LONG_INPUT_TOKENS + 52
    (tmp_path / "long.txt").write_text(("To be, or not to be, that is the question. " * 60)[:n])
    folder = tmp_path / "long-trace"
    assert k3lab(["trace", str(nano), "--text", str(tmp_path / "long.txt"), "--max-tokens", str(n),
                  "--out", str(folder)]) == 0  # fmt: skip
    serve_only(monkeypatch, tmp_path, str(folder), str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.run()
    at = at.switch_page("page_scripts/long_context.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(f"will read {n:,} tokens" in w.value for w in at.warning), [w.value for w in at.warning]
    assert len(at.get("plotly_chart")) == 0
    at = next(b for b in at.button if b.label == f"Run on {n:,} tokens").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) > 0 and [e.value for e in at.error] == [], [
        (type(e).__name__, getattr(e, "value", None)) for e in at.main.children.values()
    ]
    _no_question_left(at)
