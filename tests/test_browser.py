"""The app in a real browser: the server as a subprocess, driven by Playwright with the system Chromium.

Skips cleanly when /usr/bin/chromium or playwright is missing (never downloads a browser). The server
is started as ``k3lab app`` starts it (``python -m app.serve``) on a free port with a fresh HOME, and
offers the shipped samples. Every wait is on a condition (the health URL, an element, the script run
finishing). The timings (cold open to the first chart, page switches on the loaded run) are printed
(run with ``-s`` to see them); they never fail the test. Set K3LAB_SCREENSHOTS to a folder to keep
copies of the screenshots.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from benchmarks.bench_app import (
    CHART,
    CHROMIUM,
    CHROMIUM_ARGS,
    EXCEPTION,
    RENDER_TIMEOUT_MS,
    REPO,
    app_server,
    open_page,
    settle,
    switch_page,
)

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

SAMPLE = "k3-full"  # the first shipped sample: the default run
OTHER = "plain-moe"
ERROR = '[data-testid="stAlertContentError"]'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    env = {"K3LAB_RUNS": "", "K3LAB_HOME": str(root / "k3lab-home")}
    with app_server(REPO, root, env) as (url, log):
        yield url, log


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _keep(path: Path) -> None:
    target = os.environ.get("K3LAB_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def _no_errors(page, log: Path) -> None:
    assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
    assert page.locator(ERROR).count() == 0, page.locator(ERROR).all_inner_texts()


def _body(page) -> str:
    return page.locator('[data-testid="stMain"]').inner_text()


def test_cold_open_page_switches_and_export(server, browser, tmp_path):
    """The first session on a fresh server: Overview with a chart, then pages on the loaded run; timed."""
    url, log = server
    page, cold = open_page(browser, url)
    try:
        _no_errors(page, log)
        assert page.get_by_role("heading", name=SAMPLE, exact=True, level=3).count() == 1  # the default run
        shot = tmp_path / "k3lab_overview.png"
        page.screenshot(path=str(shot), full_page=True)
        _keep(shot)

        times = {"cold open to first chart": cold}
        times["switch to LatentMoE (first visit)"] = switch_page(page, "LatentMoE", "moe", "LatentMoE")
        _no_errors(page, log)
        assert page.locator(CHART).count() >= 3
        shot = tmp_path / "k3lab_moe.png"
        page.screenshot(path=str(shot), full_page=True)
        _keep(shot)
        times["switch to AttnRes (first visit)"] = switch_page(page, "AttnRes", "attnres", "AttnRes")
        times["switch to Degradation (first visit)"] = switch_page(
            page, "Degradation", "degradation", "Attention degradation"
        )
        times["switch to LatentMoE (again)"] = switch_page(page, "LatentMoE", "moe", "LatentMoE")
        _no_errors(page, log)
        print(f"\nbrowser timings on {SAMPLE} (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores):")
        for name, seconds in times.items():
            print(f"  {name:38s} {seconds:6.2f} s")

        # Export: the popover's CSV button builds the file on click and downloads the figure's table.
        page.get_by_role("button", name="Export").first.click()
        with page.expect_download(timeout=RENDER_TIMEOUT_MS) as download:
            page.get_by_role("button", name="CSV").first.click()
        name = download.value.suggested_filename
        assert name.startswith(f"{SAMPLE}_moe") and name.endswith(".csv"), name
        lines = Path(download.value.path()).read_text().splitlines()
        assert len(lines) >= 2 and "," in lines[0], lines[:2]
    finally:
        page.context.close()


def test_a_copied_link_reopens_the_same_view_in_a_fresh_browser(server, browser):
    url, log = server
    page, _ = open_page(browser, f"{url}/moe?run={OTHER}&text=mqar&tokens=64")
    try:
        _no_errors(page, log)
        assert page.get_by_role("heading", name="LatentMoE").count() == 1
        assert f"{OTHER} · 64 tokens of MQAR" in _body(page)
        link = page.url
    finally:
        page.context.close()
    query = parse_qs(urlparse(link).query)
    assert urlparse(link).path.endswith("/moe")
    assert {k: v[0] for k, v in query.items() if k in ("run", "text", "tokens")} == {
        "run": OTHER,
        "text": "mqar",
        "tokens": "64",
    }

    fresh, _ = open_page(browser, link)  # a new context: no cookies, no session state
    try:
        _no_errors(fresh, log)
        assert fresh.get_by_role("heading", name="LatentMoE").count() == 1
        assert f"{OTHER} · 64 tokens of MQAR" in _body(fresh)
    finally:
        fresh.context.close()


def test_deep_links_and_unknown_values(server, browser):
    url, log = server
    page, _ = open_page(browser, f"{url}/overview")
    try:
        _no_errors(page, log)
        assert "Page not found" not in page.content()
        assert page.get_by_role("heading", name=SAMPLE, exact=True, level=3).count() == 1
    finally:
        page.context.close()

    page, _ = open_page(browser, f"{url}/attnres?run=no-such-run&tokens=64")
    try:
        settle(page)
        _no_errors(page, log)
        assert page.get_by_role("heading", name="AttnRes").count() == 1
        warning = page.locator('[data-testid="stAlertContentWarning"]').all_inner_texts()
        assert any("'no-such-run'" in w for w in warning), warning
        assert f"{SAMPLE} · 64 tokens" in _body(page)  # fell back to the default run
    finally:
        page.context.close()
