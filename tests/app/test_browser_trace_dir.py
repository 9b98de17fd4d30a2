"""A trace folder in a real browser (Playwright, system Chromium): `k3lab trace` of a copied checkpoint, the copy
deleted, the app started on the trace folder alone; its pages draw the recorded trace and the Weights page says
it needs the checkpoint. Every wait is on a condition."""

from __future__ import annotations

import shutil

import pytest

from app import page_registry
from benchmarks.bench_app import CHART, CHROMIUM, EXCEPTION, RENDER_TIMEOUT_MS, REPO, app_server, open_page, settle
from k3lab.cli import main as k3lab
from tests.app.test_browser import browser  # noqa: F401 - the module's Chromium, shared

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

ERROR = '[data-testid="stAlertContentError"]'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser-trace")
    ckpt = root / "ckpt"
    shutil.copytree(REPO / "sample_checkpoints" / "k3-full", ckpt)
    out = root / "k3-full-trace"
    assert k3lab(["trace", str(ckpt), "--sample", "shakespeare", "--max-tokens", "32", "--out", str(out)]) == 0
    shutil.rmtree(ckpt)
    env = {"K3LAB_RUNS": str(out), "K3LAB_HOME": str(root / "k3lab-home")}  # listed first: the default run
    with app_server(REPO, root, env) as (url, log):
        yield url, log


def test_trace_folder_pages_in_a_browser(server, browser):  # noqa: F811
    url, log = server
    page, _ = open_page(browser, url)
    try:
        assert page.get_by_role("heading", name="k3-full-trace", exact=True, level=3).count() == 1
        assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
        assert page.locator(ERROR).count() == 0, page.locator(ERROR).all_inner_texts()
        page.goto(f"{url}/attnres")
        page.get_by_role("heading", name=page_registry.page("attnres").title).first.wait_for(timeout=RENDER_TIMEOUT_MS)
        page.wait_for_selector(CHART, timeout=RENDER_TIMEOUT_MS)
        settle(page)
        assert page.locator(CHART).count() >= 2
        assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
        assert "recorded: shakespeare" in page.locator('[data-testid="stMain"]').inner_text()
        page.goto(f"{url}/weights")
        page.locator(ERROR).first.wait_for(timeout=RENDER_TIMEOUT_MS)
        assert "needs the checkpoint" in page.locator(ERROR).first.inner_text()
    finally:
        page.context.close()
