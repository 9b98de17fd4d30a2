"""The Streamlit app, run headless with streamlit.testing's AppTest on real k3-nano checkpoints (no mocks).

Every page must render without an exception; bad input (a corrupt checkpoint, NaN weights, empty text,
a bad upload) must show an st.error element and leave the app running. Texts are cut to a few tokens
so the whole file stays fast.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from app import caching, cards, inputs, uploads
from app.settings import HOME_ENV
from k3core.model import K3ForCausalLM

APP = Path(__file__).resolve().parent.parent / "app" / "main.py"
PAGES = ("density", "attnres", "moe", "degradation", "compare", "history", "generate", "upload")
SECTION_PAGES = ("density", "attnres", "moe", "degradation")
TIMEOUT = 180  # seconds per script run: generous for a loaded CI machine; typical runs take 1-5 s
MAX_TOKENS = 48

METRICS = {
    "history": [
        {"step": 0, "loss": 5.6, "val_bpb": 8.0, "tokens": 0},
        {"step": 50, "loss": 3.1, "val_bpb": 4.4, "tokens": 12800},
        {"step": 100, "loss": 2.6, "val_bpb": 3.7, "tokens": 25600},
    ]
}


def _save_nano(path: Path, seed: int, metrics: dict | None = None) -> Path:
    torch.manual_seed(seed)
    K3ForCausalLM.from_config("k3-nano").save_pretrained(path)
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))
    (path / "README.md").write_text(f"# nano seed {seed}\n\nA random-init k3-nano for the app tests.\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    good = _save_nano(root / "nano-a", 0, METRICS)
    other = _save_nano(root / "nano-b", 1, METRICS)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    shutil.copy(good / "config.json", corrupt / "config.json")
    (corrupt / "model.safetensors").write_bytes(b"definitely not safetensors")
    torch.manual_seed(2)
    model = K3ForCausalLM.from_config("k3-nano")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    nan = model.save_pretrained(root / "nan-weights")
    return {"good": good, "other": other, "corrupt": corrupt, "nan": Path(nan)}


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    """Point the app at given checkpoint folders only (no shipped samples)."""

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "k3lab-home"))  # the runs library of this test only

    def use(*folders: Path) -> None:
        monkeypatch.setenv(uploads.RUNS_ENV, os.pathsep.join(str(f) for f in folders))
        empty = tmp_path / "no-samples"
        empty.mkdir(exist_ok=True)
        monkeypatch.setattr(uploads, "SAMPLES_DIR", empty)

    return use


def _app(max_tokens: int = MAX_TOKENS) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = max_tokens
    return at


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def _charts(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"app_pages/{name}.py").run()


def test_overview_renders_by_default_and_every_page_runs(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = _app()
    at.session_state["k3lab_cmp_section"] = "attnres"  # density (importance) is covered on its own page
    at.run()
    assert not at.exception, at.exception
    assert _errors(at) == []
    # The first preloaded run is selected and the Overview renders without any click.
    assert at.session_state["k3lab_run"] == "nano-a"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Layers"] == "4"
    assert metrics["Parameters"].endswith("K")
    assert "loss (nats/token)" in metrics and metrics["loss (nats/token)"] != "n/a"
    assert any("nano seed 0" in m.value for m in at.markdown)  # the model card

    for name in PAGES:
        _page(at, name)
        assert not at.exception, (name, [e.value for e in at.exception])
        assert _errors(at) == [], (name, _errors(at))
        if name in SECTION_PAGES:
            assert _charts(at) >= 2, name
    # Compare defaulted to the other run; history overlays both runs' metrics.json.
    _page(at, "compare")
    assert at.selectbox(key="k3lab_cmp_run_b").value == "nano-b"
    assert len(at.dataframe) >= 1  # headline delta table
    _page(at, "history")
    assert _charts(at) >= 1


def test_compare_one_run_on_two_texts(app_env, runs):
    app_env(runs["good"])
    at = _app()
    at.session_state["k3lab_cmp_mode"] = "One run, two texts"
    at.session_state["k3lab_cmp_section"] = "moe"
    at.run()
    _page(at, "compare")
    assert not at.exception
    assert _errors(at) == []
    assert at.selectbox(key="k3lab_cmp_text_source").value == inputs.TEXT_MQAR
    assert _charts(at) >= 2
    assert any("B: MQAR" in c.value for c in at.caption)


@pytest.mark.parametrize(("which", "message"), [("corrupt", "not a safetensors file"), ("nan", "NaN or Inf")])
def test_bad_checkpoint_shows_error_not_exception(app_env, runs, which, message):
    app_env(runs[which], runs["good"])
    at = _app().run()
    assert not at.exception
    assert any(message in e for e in _errors(at)), _errors(at)
    _page(at, "moe")
    assert not at.exception
    assert any(message in e for e in _errors(at))
    # The app keeps running: the other run still works.
    at.session_state["k3lab_run"] = "nano-a"
    _page(at, "overview")
    assert not at.exception and _errors(at) == []


def test_empty_and_huge_text(app_env, runs):
    app_env(runs["good"])
    at = _app()
    at.session_state["k3lab_text_source"] = inputs.TEXT_PASTE
    at.run()
    assert not at.exception
    assert any("The text is empty" in e for e in _errors(at))
    _page(at, "degradation")
    assert any("The text is empty" in e for e in _errors(at))
    assert _charts(at) == 0

    at.session_state["k3lab_paste"] = "to be or not to be " * 500  # 9,500 bytes
    at.run()
    assert not at.exception and _errors(at) == []
    assert any(f"first {MAX_TOKENS} of 9,500 tokens" in w.value for w in at.warning)
    assert _charts(at) >= 2


def test_generate_page(app_env, runs):
    app_env(runs["good"])
    at = _app().run()
    _page(at, "generate")
    at.text_area(key="k3lab_prompt").input("ROMEO:")
    at.slider(key="k3lab_gen_tokens").set_value(12)
    at.button[0].click().run()
    assert not at.exception and _errors(at) == []
    out = [c.value for c in at.code]
    assert out and out[-1].startswith("ROMEO:")
    assert {m.label for m in at.metric} >= {"New tokens", "Decode cache"}
    assert [m.value for m in at.metric if m.label == "New tokens"] == ["12"]


# ------------------------------------------------------------------------------------ pure helpers
def test_discover_runs_order_dedupe_and_problems(tmp_path, runs):
    samples = tmp_path / "samples"
    samples.mkdir()
    shutil.copytree(runs["good"], samples / "nano-a")  # same name as a preloaded run: gets a suffix
    (samples / "not-a-run").mkdir()
    env = os.pathsep.join([str(runs["other"]), str(tmp_path / "missing"), str(runs["other"])])
    uploaded = [uploads.RunRef("up", str(runs["good"]), "uploaded")]
    found, problems = uploads.discover_runs(env, samples, uploaded)
    assert [(r.label, r.origin) for r in found] == [("nano-b", "preloaded"), ("nano-a", "sample"), ("up", "uploaded")]
    assert len(problems) == 1 and "missing" in problems[0]
    found, _ = uploads.discover_runs(str(runs["good"]), samples)
    assert [r.label for r in found] == ["nano-a", "nano-a (2)"]
    # A folder of runs expands to its checkpoint folders.
    found, problems = uploads.discover_runs(str(runs["good"].parent), None)
    assert [r.label for r in found] == ["corrupt", "nan-weights", "nano-a", "nano-b"] and not problems


def test_text_checks_and_token_digest():
    with pytest.raises(inputs.InputError, match="empty"):
        inputs.check_text(inputs.TextChoice(inputs.TEXT_PASTE, 64, "  \n"))
    with pytest.raises(inputs.InputError, match="between 2 and"):
        inputs.check_text(inputs.TextChoice(inputs.TEXT_SHAKESPEARE, inputs.MAX_TOKENS_CAP + 1))
    with pytest.raises(inputs.InputError, match="binary"):
        inputs.decode_upload(b"abc\x00def", "x.txt")
    with pytest.raises(inputs.InputError, match="not UTF-8"):
        inputs.decode_upload(b"caf\xe9", "x.txt")
    ids = torch.arange(5)[None]
    assert inputs.token_digest(ids) == inputs.token_digest(ids.clone())
    assert inputs.token_digest(ids) != inputs.token_digest(ids, torch.full_like(ids, -100))
    assert inputs.token_digest(ids) != inputs.token_digest(torch.arange(1, 6)[None])
    # Same text and length, same cache key; any change, a new key.
    a = inputs.TextChoice(inputs.TEXT_PASTE, 64, "hello")
    assert a.key() == inputs.TextChoice(inputs.TEXT_PASTE, 64, "hello").key()
    assert a.key() != inputs.TextChoice(inputs.TEXT_PASTE, 65, "hello").key()
    assert a.key() != inputs.TextChoice(inputs.TEXT_PASTE, 64, "hellp").key()


def test_options_are_checked():
    inputs.check_options({"seq_len": 4096})
    with pytest.raises(inputs.InputError, match="unknown option"):
        inputs.check_options({"seqlen": 4096})
    with pytest.raises(inputs.InputError, match="seq_len"):
        inputs.check_options({"seq_len": 10})


def test_exports_without_chromium_offer_html_csv_json(app_env, runs, monkeypatch):
    from analysis import export

    monkeypatch.setattr(export, "find_chromium", lambda: None)
    cards.static_export_status.cache_clear()
    try:
        app_env(runs["good"])
        at = _app().run()
        _page(at, "attnres")
        assert not at.exception and _errors(at) == []
        keys = [b.key for b in at.get("download_button")]
        formats = {k.rsplit("-", 1)[-1] for k in keys}
        assert formats == {"html", "csv", "json"}, keys
        assert any("need Chromium" in c.value or "needs Chromium" in c.value for c in at.caption)
        # The export files themselves (built on click in the browser) hold the figure's data.
        run = uploads.RunRef("nano-a", str(runs["good"]), "preloaded")
        loaded = caching.load(run, inputs.TextChoice(inputs.TEXT_SHAKESPEARE, 32))
        fig, df = caching.build_view(cards.section_views("attnres")[0], loaded)
        assert cards.figure_bytes(fig, df, "t", "csv").decode().splitlines()[0].split(",") == list(df.columns)
        assert b"<html" in cards.figure_bytes(fig, df, "t", "html")[:500].lower()
    finally:
        cards.static_export_status.cache_clear()
