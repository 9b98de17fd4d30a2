"""A walk over every page of the app, single run and Compare, in a real browser (Playwright, system Chromium; skips
without them), on one server:

- each page opens without an exception or an error box and draws every figure (the rest turned on);
- the figures as Streamlit draws them pass the figure check (benchmarks/figure_check.py: overlapping or cut text,
  points outside their axis, scrolling legends, empty panels); pages that draw only after a click (Long context,
  Experiment) are opened here and drawn in their own tests (below, and test_browser_experiment.py);
- no request leaves the server (fonts, favicon, scripts);
- the server log of the whole walk holds no deprecation warning (Streamlit's ``use_container_width`` notice was
  printed 144 times).

A full-page screenshot is taken of each page: K3LAB_SCREENSHOTS=DIR keeps them as taken, K3LAB_FIGURE_SHOTS=DIR
keeps them shrunk to 800 px in 256 colours, small enough to commit (docs/screenshots holds the committed ones).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app import page_registry
from benchmarks.bench_app import CHART, CHROMIUM, EXCEPTION, RENDER_TIMEOUT_MS, settle, show_the_rest
from benchmarks.figure_check import app_page_problems
from tests.app import test_browser

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

server, browser = test_browser.server, test_browser.browser  # the same fixtures: a fresh server, Chromium
RUN, OTHER = "k3-full", "plain-moe"
QUERY = f"run={RUN}&text=shakespeare&tokens=64"
DEPRECATION = re.compile(r"deprecat|use_container_width", re.IGNORECASE)
WIDTH = 1280
# sections that draw their figures only after a click: opened by the walk, drawn in their own tests. Pages without a
# section (Survey, Generate, Runs library) draw nothing until asked either; Overview, the default page, draws at once.
DRAW_ON_CLICK = ("long_context", "experiment")

# no element of the page is still a loading placeholder (a metric or chart drawn after the script run)
NOTHING_PENDING_JS = "() => document.querySelectorAll('[data-testid=\"stSkeleton\"]').length === 0"


def _outside(request_url: str, host: str) -> bool:
    parsed = urlparse(request_url)
    return parsed.scheme in ("http", "https", "ws", "wss") and parsed.netloc != host


def _shot(page, shot: Path) -> None:
    """The whole page (the window made as tall as Streamlit's scrolling main area, at most 9000 px) to ``shot``, and
    where K3LAB_SCREENSHOTS / K3LAB_FIGURE_SHOTS say (module docstring)."""
    tall = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": WIDTH, "height": min(max(int(tall) + 40, 1000), 9000)})
    settle(page)
    page.screenshot(path=str(shot))
    if target := os.environ.get("K3LAB_SCREENSHOTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(target) / shot.name)
    if target := os.environ.get("K3LAB_FIGURE_SHOTS"):
        from PIL import Image

        Path(target).mkdir(parents=True, exist_ok=True)
        image = Image.open(shot)
        image = image.resize((800, max(1, round(image.height * 800 / image.width))), Image.LANCZOS)
        image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(
            Path(target) / shot.name, optimize=True
        )


def _draws_on_open(section: str | None, default: bool = False) -> bool:
    return (section is not None or default) and section not in DRAW_ON_CLICK


def _visit(
    browser, url: str, heading: str, charts: bool, shot: Path, outside: list[str]
) -> tuple[str, dict[str, list[str]]]:
    """Open ``url`` in a fresh context, wait for ``heading`` and the page to be drawn (with any figures past the
    first on; at least one where ``charts``), check it, screenshot it; the main area's text and the figure check's
    problems by chart."""
    page = browser.new_context(viewport={"width": WIDTH, "height": 1000}).new_page()
    host = urlparse(url).netloc
    page.on("request", lambda r: outside.append(r.url) if _outside(r.url, host) else None)
    try:
        page.goto(url)
        page.get_by_role("heading", name=heading).first.wait_for(timeout=RENDER_TIMEOUT_MS)
        settle(page)
        show_the_rest(page)
        page.wait_for_function(NOTHING_PENDING_JS, timeout=RENDER_TIMEOUT_MS)
        settle(page)
        assert page.locator(EXCEPTION).count() == 0, url
        errors = page.locator('[data-testid="stAlertContentError"]').all_inner_texts()
        assert not errors, (url, errors)
        problems = {key: list(dict.fromkeys(found))[:6] for key, found in app_page_problems(page).items() if found}
        if charts:
            assert page.locator(CHART).count() >= 1, url
        text = page.locator('[data-testid="stMain"]').inner_text()
        _shot(page, shot)
        return text, problems
    finally:
        page.context.close()


def test_every_page_and_compare_section_opens_draws_passes_the_figure_check_and_stays_local(server, browser, tmp_path):
    url, log = server
    texts, bad, outside = {}, {}, []
    visits = []  # (link, heading, draws on open, name)
    for entry in page_registry.PAGES:
        if entry.name != "compare":
            charts = _draws_on_open(entry.section, entry == page_registry.DEFAULT)
            visits.append((f"{url}/{entry.url_path}?{QUERY}", entry.title, charts, entry.name))
    compare = page_registry.page("compare")
    for section in page_registry.COMPARE_SECTIONS:
        link = f"{url}/{compare.url_path}?{QUERY}&b={OTHER}&mode=runs&section={section}"
        visits.append((link, compare.title, _draws_on_open(section), f"compare_{section}"))
    for link, heading, charts, name in visits:
        texts[name], problems = _visit(browser, link, heading, charts, tmp_path / f"{name}.png", outside)
        bad.update({f"{name} {key}": found for key, found in problems.items()})
    shots = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(shots) == len(page_registry.PAGES) - 1 + len(page_registry.COMPARE_SECTIONS), shots
    assert "Beside its untrained twin" in texts["degradation"]
    assert "balanced routing" in texts["moe"] or "balanced-routing" in texts["overview"]
    assert not outside, f"requests to other hosts: {sorted(set(outside))[:10]}"
    assert not bad, "\n".join(f"{where}:\n  " + "\n  ".join(p) for where, p in bad.items())
    warned = [line for line in log.read_text(errors="replace").splitlines() if DEPRECATION.search(line)]
    assert not warned, warned[:5]


COST_JS = """() => {
  const gd = document.querySelector('.st-key-fig-long_cost_length .js-plotly-plot');
  const full = gd._fullLayout;
  const axis = a => ({type: a.type, range: Array.from(a.range), title: (a.title && a.title.text) || '',
                      ticktext: Array.from(a.ticktext || [])});
  return {yaxis: axis(full.yaxis), xaxis: axis(full.xaxis), names: gd.data.map(t => t.name || ''),
          titles: (full.annotations || []).map(a => a.text), points: gd._fullData[0]._length};
}"""


@pytest.mark.slow
def test_long_context_page_draws_and_passes_the_figure_check(server, browser, tmp_path):
    """The Long context page on the k3-full sample: the estimate first, then (after Run) every trace view and the
    cost measurement drawn by Streamlit, no exception on the page, and the figure check on its charts."""
    url, _log = server
    page = browser.new_context(viewport={"width": WIDTH, "height": 1000}).new_page()
    try:
        page.goto(f"{url}/long_context?run=k3-full&text=shakespeare&tokens=256")
        run = page.get_by_role("button", name="Run on")
        run.first.wait_for(timeout=RENDER_TIMEOUT_MS)
        assert "Estimate for 1,024 tokens" in page.inner_text('[data-testid="stMain"]')
        run.first.click()
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=\"stPlotlyChart\"] .js-plotly-plot').length >= 4",
            timeout=RENDER_TIMEOUT_MS * 3,
        )
        page.get_by_role("button", name="Measure one forward").first.click()
        # the cost figure itself (the trace views alone are five charts now: a chart count would not wait)
        page.locator(".st-key-fig-long_cost_length .js-plotly-plot").first.wait_for(timeout=RENDER_TIMEOUT_MS * 3)
        settle(page)
        assert page.locator(EXCEPTION).count() == 0
        bad = {key: problems for key, problems in app_page_problems(page).items() if problems}
        assert set(app_page_problems(page)) >= {"fig-long_loss_by_position", "fig-long_cost_length"}
        assert not bad, bad
        # the cost figure as drawn: one unit in its panel title, legend and axis (ms), time from zero on a linear
        # axis (timings under load 10-20% apart are no trend), one tick label per measured length at most
        cost = page.evaluate(COST_JS)
        assert cost["yaxis"]["type"] == "linear" and cost["yaxis"]["range"][0] == 0, cost["yaxis"]
        assert "milliseconds" in cost["titles"][0] and "ms per token" in cost["yaxis"]["title"]
        assert all("ms" in name for name in cost["names"][:1]) and not any("seconds" in n for n in cost["names"])
        assert cost["xaxis"]["type"] == "log" and 1 <= len(cost["xaxis"]["ticktext"]) <= cost["points"]
        _shot(page, tmp_path / "long_context.png")
    finally:
        page.context.close()
