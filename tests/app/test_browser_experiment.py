"""The Experiment page in a real browser (Playwright, system Chromium; skips without them): an edit built from
the menus, run, its per-token loss change checked against k3core, the link reopened in a fresh browser context;
a token picked and its experts and top-k read back and checked against the trace. Waits are on conditions."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
import torch

from app import page_registry
from benchmarks.bench_app import CHROMIUM, EXCEPTION, RENDER_TIMEOUT_MS, REPO, settle
from tests.app import test_browser
from tests.app.test_browser import _array  # plotly's typed-array spec, decoded

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

SAMPLE = "k3-full"
TOKENS = 32
QUERY = f"run={SAMPLE}&text=shakespeare&tokens={TOKENS}"
LOSS_FIGURE_JS = """() => {
  const plots = Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"] .js-plotly-plot'));
  const fig = plots.find(p => p.layout && p.layout.title && String(p.layout.title.text).includes('Per-token loss'));
  return fig ? fig.data[0].y : null;
}"""


TABLES_JS = """() => Array.from(document.querySelectorAll('[data-testid="stTable"] table')).map(table => {
  const rows = Array.from(table.querySelectorAll('tr')).map(
    r => Array.from(r.querySelectorAll('th, td')).map(c => c.innerText.trim()));
  const header = rows[0];
  return rows.slice(1).map(r => Object.fromEntries(header.map((h, i) => [h, r[i]])));
})"""


server, browser = test_browser.server, test_browser.browser  # the same fixtures: a fresh server, Chromium


@pytest.fixture(scope="module")
def reference():
    """The sample run, its tokens as the app reads them, and the model (k3core directly, no app)."""
    from analysis.runs.loading import load_run
    from analysis.runs.texts import sample_input

    run = load_run(REPO / "sample_checkpoints" / SAMPLE)
    ids = sample_input("shakespeare", run.config, TOKENS, run.tokenizer).input_ids
    return run, ids


def _open(browser, url: str):
    context = browser.new_context(viewport={"width": 1440, "height": 1400})
    page = context.new_page()
    page.goto(url)
    page.get_by_role("heading", name=page_registry.page("experiment").title).first.wait_for(timeout=RENDER_TIMEOUT_MS)
    settle(page)
    return page


def _pick(page, label: str, option: str, multi: bool = False) -> None:
    """Choose ``option`` in the select box (or, ``multi``, the multiselect) labelled ``label``, and wait until the
    widget holds it: a pick made while a rerun redraws the widget can be lost (seen in loaded full-suite runs, never
    alone), so a lost pick is made again, at most three times. Escape closes a multiselect's menu, which stays open
    after a pick; a select box's menu closes by itself, and an Escape there can revert a pick not yet committed."""
    from playwright.sync_api import expect

    box = page.get_by_role("combobox", name=label, exact=True).first
    widget = page.get_by_test_id("stMultiSelect").filter(has=box)
    held = widget.locator(f'[data-tag][aria-label="{option}"]') if multi else None
    for attempt in range(3):
        settle(page)
        box.click()
        page.get_by_role("option", name=option, exact=True).first.click()
        if multi:
            page.keyboard.press("Escape")
        try:
            if multi:
                expect(held).to_have_count(1, timeout=15_000)
            else:
                expect(box).to_have_value(option, timeout=15_000)
            return
        except AssertionError:
            if attempt == 2:
                shown = widget.locator("[data-tag]").all_inner_texts() if multi else box.input_value()
                raise AssertionError(f"{label}: picked {option!r} three times; the widget holds {shown!r}") from None


def _no_errors(page, log) -> None:
    assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
    errors = page.locator('[data-testid="stAlertContentError"]')
    assert errors.count() == 0, errors.all_inner_texts()


def _loss_change(page) -> np.ndarray:
    page.wait_for_function(f"() => ({LOSS_FIGURE_JS})() !== null", timeout=RENDER_TIMEOUT_MS)
    settle(page)
    return _array(page.evaluate(LOSS_FIGURE_JS)).astype(np.float64)


def test_an_edit_from_the_menus_runs_and_its_link_reopens_it(server, browser, reference):
    url, log = server
    run, ids = reference
    page = _open(browser, f"{url}/experiment?{QUERY}")
    try:
        _no_errors(page, log)
        _pick(page, "Edit", "MoE routing")
        settle(page)
        moe_layers = [i for i in range(run.config.num_hidden_layers) if run.config.is_moe_layer(i)]
        layer = moe_layers[-1]
        _pick(page, "Layer", str(layer))
        _pick(page, "Operation", "ban experts (never selected)")
        _pick(page, "Experts", "0", multi=True)
        _pick(page, "Experts", "1", multi=True)
        page.get_by_role("button", name="Add edit").click()
        page.get_by_text(f"moe ban layer={layer} experts=[0, 1]").wait_for(timeout=RENDER_TIMEOUT_MS)
        settle(page)
        page.get_by_role("button", name="Run experiment").click()
        got = _loss_change(page)
        _no_errors(page, log)
        link = page.url
    finally:
        page.context.close()

    from analysis.experiments.effects import run_experiment, token_losses
    from k3core.interp.edit_kinds import MoEEdit

    exp = run_experiment(run.model, ids, [MoEEdit("ban", layer=layer, experts=[0, 1])])
    want = (token_losses(exp.edited_logits, ids) - token_losses(exp.base_logits, ids)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0
    edits = parse_qs(urlparse(link).query)["edits"][0]
    assert '"experts":[0,1]' in edits and f'"layer":{layer}' in edits

    fresh = _open(browser, link)  # a new context: no cookies, no session state
    try:
        fresh.get_by_text(f"moe ban layer={layer} experts=[0, 1]").wait_for(timeout=RENDER_TIMEOUT_MS)
        again = _loss_change(fresh)
        _no_errors(fresh, log)
    finally:
        fresh.context.close()
    np.testing.assert_array_equal(again, got)


def test_a_picked_token_shows_its_experts_and_top_k_as_the_trace_has_them(server, browser, reference):
    url, log = server
    run, ids = reference
    position = 7
    page = _open(browser, f"{url}/experiment?{QUERY}")
    try:
        page.get_by_text("Token", exact=True).first.click()  # the section radio
        page.get_by_role("combobox", name="Token", exact=True).wait_for(timeout=RENDER_TIMEOUT_MS)
        settle(page)
        _pick(page, "Token", f"{position}: {_label(run, int(ids[0, position]))}")
        page.get_by_text(re.compile(rf"^Token {position}: ")).first.wait_for(timeout=RENDER_TIMEOUT_MS)
        settle(page)
        _no_errors(page, log)
        top, experts = page.evaluate(TABLES_JS)[:2]
    finally:
        page.context.close()

    from k3core.interp.recorder import record

    with torch.no_grad(), record(run.model, what="moe") as trace:
        logits = run.model(ids).logits
    top_ids = [int(row["token_id"]) for row in top]
    assert top_ids == logits[0, position].topk(5).indices.tolist()
    shown = {}
    for row in experts:
        shown.setdefault(int(row["layer"]), []).append(int(row["expert"]))
    want = {i: trace[f"blocks.{i}.moe.experts"][0, position].tolist() for i in trace.layer_indices("moe")}
    assert shown == want


def _label(run, token: int) -> str:
    from app.state.experiment_choices import token_labeler

    return token_labeler(run)(token)
