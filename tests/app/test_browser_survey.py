"""The Survey page in Chromium: cost first, Start runs a survey of a sample whose results fill in (load map, atlas
card, cache curves, ...), and the browser figure check finds nothing wrong with the page's charts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks.bench_app import CHART, CHROMIUM, EXCEPTION, REPO, app_server, settle

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser-survey")
    env = {"K3LAB_RUNS": "", "K3LAB_HOME": str(root / "k3lab-home")}
    with app_server(REPO, root, env) as (url, log):
        yield url, log


def test_survey_page_runs_and_draws_its_results(server, tmp_path):
    from benchmarks.figure_check import app_page_problems
    from tests.app.library.test_browser_library import chromium

    url, log = server
    with chromium() as browser:
        page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
        page.goto(f"{url}/survey")
        page.get_by_text("Cost:").wait_for(timeout=180_000)
        settle(page)
        tokens = page.get_by_label("Corpus tokens", exact=True)
        tokens.fill("2000")
        tokens.press("Enter")
        page.get_by_text("2,048 tokens").or_(page.get_by_text("1,792 tokens")).first.wait_for(timeout=120_000)
        settle(page)
        page.get_by_role("button", name="Start", exact=True).first.click()
        page.wait_for_selector(CHART, timeout=180_000)
        page.get_by_text("Layer ").first.wait_for(timeout=180_000)
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=\"stPlotlyChart\"] .js-plotly-plot').length >= 6",
            timeout=180_000,
        )
        page.get_by_text("survey of k3-full on shakespeare: 1,792 of 1,792").wait_for(timeout=180_000)
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
        settle(page)
        assert page.locator(EXCEPTION).count() == 0
        problems = {k: v for k, v in app_page_problems(page).items() if v}
        assert not problems, problems
        titles = page.evaluate("() => Array.from(document.querySelectorAll('.gtitle')).map(e => e.textContent)")
        assert any(t.startswith("Layer ") and "specialisation" in t for t in titles), titles  # the atlas card
        assert any(t.startswith("Expert-cache hit rate") for t in titles), titles
        page.screenshot(path=str(tmp_path / "survey.png"), full_page=True)
        _keep(tmp_path / "survey.png")
        _click_a_load_mark_opens_its_card(page, tmp_path)


# the drawn SVG mark of the load map (x = expert, y = layer) that is not the expert whose card is shown now
_OTHER_MARK_JS = """() => {
  const plots = Array.from(document.querySelectorAll('[data-testid="stPlotlyChart"] .js-plotly-plot'));
  const map = plots.find(g => (g.layout.title.text || '').startsWith('Expert load'));
  const card = plots.map(g => g.layout.title.text || '').find(t => /^Layer \\d+ expert \\d+:/.test(t));
  const points = Array.from(map.querySelectorAll('.scatterlayer .point'));
  const other = points.filter(p => !card.startsWith(`Layer ${p.__data__.y} expert ${p.__data__.x}:`));
  return other[Math.floor(other.length / 2)];
}"""


def _click_a_load_mark(page, mark) -> tuple[int, int]:
    """A real mouse click at the centre of one drawn mark; returns its (layer, expert)."""
    mark.scroll_into_view_if_needed()
    layer, expert = page.evaluate("m => [m.__data__.y, m.__data__.x]", mark)
    box = mark.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    # plotly clicks the point it hovers: move there and wait for its hover label before pressing
    page.mouse.move(x - 3, y - 3)
    page.mouse.move(x, y)
    page.locator(".hoverlayer .hovertext").filter(has_text=f"layer {layer} expert {expert}").first.wait_for(
        timeout=10_000
    )
    page.mouse.down()
    page.mouse.up()
    return int(layer), int(expert)


def _click_a_load_mark_opens_its_card(page, tmp_path) -> None:
    """Clicking a layer x expert mark of the load map opens the atlas card of exactly that layer and expert."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # Under load a click can land while plotly is still binding its handlers after a redraw, and no selection event
    # is sent (seen in full-suite runs; never alone): click again, at most three times, until the card says so.
    # Each try starts from an idle page and a mark found again (a rerun redraws the map, and an old handle points at
    # a mark that is gone), and waits for the rerun the click started to end before it looks for the card (a loaded
    # machine took longer than the 30 s the card was once given).
    for attempt in range(3):
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=120_000)
        settle(page)
        mark = page.evaluate_handle(_OTHER_MARK_JS).as_element()
        assert mark is not None
        layer, expert = _click_a_load_mark(page, mark)
        card = page.get_by_text(f"Atlas card of layer {layer} expert {expert} (selected on the load map)")
        try:
            card.wait_for(timeout=15_000)  # the rerun has begun by then, or the click was lost
        except PlaywrightTimeout:
            pass
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=120_000)
        if card.is_visible():
            break
        if attempt == 2:
            card.wait_for(timeout=1_000)  # raises, naming the card that never showed
    settle(page)
    page.wait_for_function(
        "t => Array.from(document.querySelectorAll('.gtitle')).some(e => e.textContent.startsWith(t))",
        arg=f"Layer {layer} expert {expert}:",
        timeout=60_000,
    )
    assert page.locator(EXCEPTION).count() == 0
    page.screenshot(path=str(tmp_path / "survey-selected.png"), full_page=True)
    _keep(tmp_path / "survey-selected.png")


def _keep(path: Path) -> None:
    """A copy of a screenshot where K3LAB_SCREENSHOTS says (docs/screenshots holds the committed ones; a test run
    never writes into the checkout)."""
    target = os.environ.get("K3LAB_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)
