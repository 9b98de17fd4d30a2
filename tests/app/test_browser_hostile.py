"""Hostile uploads and links in a real browser (issue 14): `k3lab app` as users start it, Chromium through Playwright.

A few representative inputs of tests/repo/test_hostile_inputs.py go through the Runs library's upload form: each gets
its message in an error box (never a traceback, never a server path), leaves the library empty, and the next page
load works; a link carrying Markdown shows it as text. The server answers its health check at the end. Waits are
on conditions, never fixed sleeps. Skips like the other browser tests without Chromium or Playwright.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest
import torch

from app.library.store import RunsLibrary
from benchmarks.bench_app import CHROMIUM, EXCEPTION, RENDER_TIMEOUT_MS, settle
from k3core.modeling.model import K3ForCausalLM
from tests.app.library.test_browser_library import DROPZONE, _k3lab_app, _wait_text, chromium, open_library_page
from tests.repo.test_hostile_inputs import _deflated_pickle, _own, _tiktoken_files, _zip_of_zeros

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("browser tests need /usr/bin/chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright")
ERROR_BOX = '[data-testid="stAlertContentError"]'


def _hostile_uploads(tmp_path, good) -> dict[str, tuple[list, str]]:
    """Per case: the files to drop on the upload form and a phrase of the expected message."""
    layers = tmp_path / "layers"
    layers.mkdir()
    (layers / "config.json").write_text(json.dumps(_own(num_hidden_layers=20_000)))
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    (pickle / "config.json").write_bytes((good / "config.json").read_bytes())
    _deflated_pickle(pickle / "pytorch_model.bin", 5_000_000)
    tok = tmp_path / "tok"
    tok.mkdir()
    _tiktoken_files(tok, {"1000000": {"content": "<|far|>"}})
    return {
        "20,000 layers": ([layers / "config.json", good / "model.safetensors"], "over k3lab's limit of 256"),
        "deflated pickle": ([pickle / "config.json", pickle / "pytorch_model.bin"], "is compressed"),
        "tiktoken id 10**6": (
            [good / "config.json", good / "model.safetensors", tok / "tiktoken.model", tok / "tokenizer_config.json"],
            "ids up to 1,000,000",
        ),
        "zip of small bombs": ([_zip_of_zeros(tmp_path / "bomb.zip", 40)], "zip bomb"),
    }


def test_hostile_uploads_and_links_in_a_browser(tmp_path):
    torch.manual_seed(0)
    good = K3ForCausalLM.from_config("k3-nano").save_pretrained(tmp_path / "nano-good")
    cases = _hostile_uploads(tmp_path, good)
    home = tmp_path / "k3lab-home"
    log = tmp_path / "k3lab-app.log"

    with chromium() as browser:
        with _k3lab_app(home, good, log) as url:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            for case, (files, expected) in cases.items():
                open_library_page(page, url)
                page.locator(DROPZONE).set_input_files([str(f) for f in files])
                page.wait_for_function(
                    "n => document.querySelectorAll('[data-testid=\"stFileChip\"]').length === n",
                    arg=len(files),
                    timeout=RENDER_TIMEOUT_MS,
                )
                page.get_by_role("button", name="Add run").click()
                _wait_text(page, "This checkpoint cannot be used")
                settle(page)
                shown = page.locator(ERROR_BOX).first.inner_text()
                assert expected in shown, (case, shown)
                body = page.locator("body").inner_text()
                assert page.locator(EXCEPTION).count() == 0, (case, log.read_text()[-3000:])
                assert "Traceback" not in body and str(tmp_path) not in body, case
                assert RunsLibrary(home).entries() == [], case
                assert list((home / "runs").iterdir()) == [], case

                page.goto(f"{url}/overview")  # the next page load works
                page.get_by_role("heading", name="nano-good").wait_for(timeout=RENDER_TIMEOUT_MS)
                settle(page)
                assert page.locator(EXCEPTION).count() == 0 and page.locator(ERROR_BOX).count() == 0, case

            evil = urllib.parse.quote("![x](http://evil.example/i) [a](http://phish.example)")
            page.goto(f"{url}/overview?run={evil}")
            _wait_text(page, "is not known here")
            settle(page)
            assert page.locator("img[src*='evil.example']").count() == 0
            assert page.locator("a[href*='phish.example']").count() == 0
            shown = page.locator("body").inner_text().replace("\u200b", "")  # the invisible unlinking space
            assert "![x](http://evil.example/i) [a](http://phish.example)" in shown  # shown as text

            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=30) as reply:  # still serving
                assert reply.read() == b"ok"
