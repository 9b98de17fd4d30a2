"""A walk over every page of the app, single run and Compare, in a real browser (Playwright, system Chromium; skips
without them): each page opens without an exception or an error box, a full-page screenshot is taken of each (kept
in K3LAB_SCREENSHOTS when set), and the server log of the whole walk holds no deprecation warning (Streamlit's
``use_container_width`` notice was printed 144 times)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from app import page_registry
from benchmarks.bench_app import CHROMIUM, RENDER_TIMEOUT_MS, settle, show_the_rest
from tests.app import test_browser

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

server, browser = test_browser.server, test_browser.browser  # the same fixtures: a fresh server, Chromium
RUN, OTHER = "k3-full", "plain-moe"
QUERY = f"run={RUN}&text=shakespeare&tokens=64"
DEPRECATION = re.compile(r"deprecat|use_container_width", re.IGNORECASE)


# no element of the page is still a loading placeholder (a metric or chart drawn after the script run)
NOTHING_PENDING_JS = "() => document.querySelectorAll('[data-testid=\"stSkeleton\"]').length === 0"


def _visit(browser, url: str, heading: str, shot: Path) -> str:
    """Open ``url`` in a fresh context, wait for ``heading`` and the page to be drawn (with any figures past the
    first on), screenshot it, and return the main area's text."""
    page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
    try:
        page.goto(url)
        page.get_by_role("heading", name=heading).first.wait_for(timeout=RENDER_TIMEOUT_MS)
        settle(page)
        show_the_rest(page)
        page.wait_for_function(NOTHING_PENDING_JS, timeout=RENDER_TIMEOUT_MS)
        settle(page)
        assert page.locator('[data-testid="stException"]').count() == 0, url
        errors = page.locator('[data-testid="stAlertContentError"]').all_inner_texts()
        assert not errors, (url, errors)
        # the app scrolls inside its main area: a viewport as tall as that area shows the whole page at once
        tall = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
        page.set_viewport_size({"width": 1440, "height": min(max(int(tall), 1000), 16000)})
        settle(page)
        page.screenshot(path=str(shot), full_page=True)
        target = os.environ.get("K3LAB_SCREENSHOTS")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(target) / shot.name)
        return page.locator('[data-testid="stMain"]').inner_text()
    finally:
        page.context.close()


def test_every_page_and_compare_section_opens_and_the_log_has_no_deprecation(server, browser, tmp_path):
    url, log = server
    texts = {}
    for entry in page_registry.PAGES:
        if entry.name == "compare":
            continue
        texts[entry.name] = _visit(
            browser, f"{url}/{entry.url_path}?{QUERY}", entry.title, tmp_path / f"page_{entry.name}.png"
        )
    compare = page_registry.page("compare")
    for section in page_registry.COMPARE_SECTIONS:
        link = f"{url}/{compare.url_path}?{QUERY}&b={OTHER}&mode=runs&section={section}"
        texts[f"compare_{section}"] = _visit(browser, link, compare.title, tmp_path / f"compare_{section}.png")
    shots = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(shots) == len(page_registry.PAGES) - 1 + len(page_registry.COMPARE_SECTIONS), shots
    assert "Beside its untrained twin" in texts["degradation"]
    assert "balanced routing" in texts["moe"] or "balanced-routing" in texts["overview"]
    warned = [line for line in log.read_text(errors="replace").splitlines() if DEPRECATION.search(line)]
    assert not warned, warned[:5]
