"""The app in a real browser: `streamlit run` as a subprocess, driven by Playwright with the system Chromium.

Skips cleanly when /usr/bin/chromium or playwright is missing (never downloads a browser). Set
K3LAB_SCREENSHOTS to a folder to keep copies of the screenshots.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from k3core.model import K3ForCausalLM

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
START_TIMEOUT_S = 120
RENDER_TIMEOUT_MS = 180_000
CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'  # a drawn plotly figure, not the loading skeleton
EXCEPTION = '[data-testid="stException"]'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll the health endpoint until it answers 'ok', the server dies, or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200 and resp.read().strip() == b"ok":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # poll interval, not a synchronisation sleep
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    torch.manual_seed(0)
    run = K3ForCausalLM.from_config("k3-nano").save_pretrained(root / "nano-browser")
    (Path(run) / "metrics.json").write_text(
        json.dumps({"history": [{"step": 0, "loss": 5.6, "val_bpb": 8.0}, {"step": 100, "loss": 2.9, "val_bpb": 4.1}]})
    )
    home = root / "home"
    home.mkdir()
    port = _free_port()
    env = dict(os.environ)
    env.update(
        K3LAB_RUNS=str(run),
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        STREAMLIT_BROWSER_GATHER_USAGE_STATS="false",
        OMP_NUM_THREADS=env.get("K3LAB_TEST_THREADS", "1"),
    )
    log = root / "streamlit.log"
    cmd = [
        sys.executable, "-m", "streamlit", "run", "app/main.py",
        "--server.headless", "true",
        "--server.port", str(port),
        "--server.address", "127.0.0.1",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, log, START_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _settle(page) -> None:
    """Wait until Streamlit has finished the script run (no 'running' status widget)."""
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=RENDER_TIMEOUT_MS
    )


def _keep(path: Path) -> None:
    target = os.environ.get("K3LAB_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def test_app_renders_in_chromium(server, tmp_path):
    url, log = server
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(url)
            # Overview: renders with no click (first preloaded run, Shakespeare sample), with a chart.
            page.wait_for_selector(CHART, timeout=RENDER_TIMEOUT_MS)
            page.wait_for_selector('[data-testid="stMetric"]', timeout=RENDER_TIMEOUT_MS)
            _settle(page)
            assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
            shot = tmp_path / "k3lab_overview.png"
            page.screenshot(path=str(shot), full_page=True)
            _keep(shot)
            assert page.get_by_role("heading", name="nano-browser").count() == 1  # the first preloaded run

            # One more page through the sidebar navigation.
            page.get_by_role("link", name="LatentMoE").click()
            page.wait_for_url("**/moe", timeout=RENDER_TIMEOUT_MS)
            page.get_by_role("heading", name="LatentMoE").wait_for(timeout=RENDER_TIMEOUT_MS)
            page.wait_for_selector(CHART, timeout=RENDER_TIMEOUT_MS)
            _settle(page)
            assert page.locator(EXCEPTION).count() == 0, log.read_text()[-3000:]
            assert page.locator(CHART).count() >= 3
            assert page.locator('[data-testid="stAlertContentError"]').count() == 0
            shot = tmp_path / "k3lab_moe.png"
            page.screenshot(path=str(shot), full_page=True)
            _keep(shot)
            assert shot.stat().st_size > 10_000

            # Export: the popover's CSV button builds the file on click and downloads the figure's table.
            page.get_by_role("button", name="Export").first.click()
            with page.expect_download(timeout=RENDER_TIMEOUT_MS) as download:
                page.get_by_role("button", name="CSV").first.click()
            name = download.value.suggested_filename
            assert name.startswith("nano-browser_moe") and name.endswith(".csv"), name
            lines = Path(download.value.path()).read_text().splitlines()
            assert len(lines) >= 2 and "," in lines[0], lines[:2]
        finally:
            browser.close()
