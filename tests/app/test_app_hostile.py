"""Hostile inputs through the app (issue 14), under streamlit.testing's AppTest: an upload of each bad input gets a
clear message (no traceback, no server path), nothing of it stays in the runs library, and the next page load
works; a damaged library index, Markdown in a link or a model card, and a missing tokenizer are shown as text.
The inputs themselves, and their time and memory bounds, are in tests/repo/test_hostile_inputs.py."""

from __future__ import annotations

import json
import re
import shutil
import time
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest

from app.library import home as library_home
from app.library.store import RunsLibrary
from app.render.errors import ZERO_WIDTH, markdown_card, md_escape, plain, strip_paths
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from tests.app.serving import serve_only
from tests.repo.test_hostile_inputs import (
    _deflated_pickle,
    _long_shape_header,
    _own,
    _tiktoken_files,
    _zip_of_zeros,
    write_safetensors,
)

APP = Path(__file__).resolve().parents[2] / "app" / "main.py"
TIMEOUT = 180
COMMONMARK = MarkdownIt("commonmark").enable(["strikethrough", "table"])
# what GFM's literal autolinks start from (remark-gfm links them in text whose escapes are already resolved)
AUTOLINK_STARTS = re.compile(r"(?i)://|www\.|@\w")
PAGE_S = 10.0  # an AppTest rerun of the whole page (sidebar, widgets) on a shared 2-core machine


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-app")
    torch.manual_seed(0)
    good = K3ForCausalLM.from_config("k3-nano").save_pretrained(root / "nano-good")
    (good / "README.md").write_text(
        "# nano\n\n![tracker](http://evil.example/pixel.png) and [a link](http://x.example)\n"
    )
    torch.manual_seed(1)
    wide = K3ForCausalLM.from_config(from_preset("k3-nano", vocab_size=512)).save_pretrained(root / "nano-512")
    named = shutil.copytree(good, root / "nano-named")  # a config name with a backtick and an image
    data = json.loads((named / "config.json").read_text())
    data["name"] = "a`b ![x](http://evil.example/i.png)"
    (named / "config.json").write_text(json.dumps(data))
    return {"good": good, "wide": wide, "named": named, "root": root}


@pytest.fixture
def env(monkeypatch, tmp_path, runs):
    home = serve_only(monkeypatch, tmp_path, f"{runs['good']}:{runs['wide']}:{runs['named']}", str(runs["root"]))
    library_home._library.clear()
    yield home
    library_home._library.clear()


def _shown(value: str) -> str:
    """Markdown-escaped text as the browser shows it (escapes resolved, the invisible unlinking spaces read past)."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", value).replace(ZERO_WIDTH, "")


def _errors(at: AppTest) -> list[str]:
    return [_shown(e.value) for e in at.error]


def _library_page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.run()
    return at.switch_page("page_scripts/runs_library.py").run()


def _hostile(kind: str, good: Path, where: Path) -> list[tuple[str, bytes]]:
    """The files of one hostile upload."""
    where.mkdir(parents=True, exist_ok=True)
    config = (good / "config.json").read_bytes()
    weights = (good / "model.safetensors").read_bytes()
    if kind == "20,000 layers":
        return [("config.json", json.dumps(_own(num_hidden_layers=20_000)).encode()), ("model.safetensors", weights)]
    if kind == "Infinity layers":
        return [
            ("config.json", json.dumps(_own(num_hidden_layers=float("inf"))).encode()),
            ("model.safetensors", weights),
        ]
    if kind == "deflated pickle":
        return [
            ("config.json", config),
            ("pytorch_model.bin", _deflated_pickle(where / "pytorch_model.bin", 5_000_000).read_bytes()),
        ]
    if kind == "long shape header":
        header = write_safetensors(where / "model.safetensors", _long_shape_header(), b"\0" * 4)
        return [("config.json", config), ("model.safetensors", header.read_bytes())]
    if kind == "tiktoken id 10**6":
        _tiktoken_files(where, {"1000000": {"content": "<|far|>"}})
        return [
            ("config.json", config),
            ("model.safetensors", weights),
            ("tiktoken.model", (where / "tiktoken.model").read_bytes()),
            ("tokenizer_config.json", (where / "tokenizer_config.json").read_bytes()),
        ]
    if kind == "zip of 40 small bombs":
        return [("run.zip", _zip_of_zeros(where / "run.zip", 40).read_bytes())]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("20,000 layers", "20,000 is over k3lab's limit of 256"),
        ("Infinity layers", "Infinity is not a JSON value"),
        ("deflated pickle", "is compressed"),
        ("long shape header", "dimension(s) out of range"),
        ("tiktoken id 10**6", "ids up to 1,000,000"),
        ("zip of 40 small bombs", "zip bomb"),
    ],
)
def test_hostile_upload_gets_a_message_leaves_nothing_and_the_app_goes_on(env, runs, tmp_path, kind, expected):
    at = _library_page()
    uploader = at.get("file_uploader")[0]
    for name, data in _hostile(kind, runs["good"], tmp_path / "files"):
        uploader.upload(name, data)
    start = time.perf_counter()
    at.button(key="k3lab_upload_add").click().run()
    seconds = time.perf_counter() - start
    assert not at.exception
    [error] = _errors(at)
    assert error.startswith("This checkpoint cannot be used") and expected in error, error
    assert str(tmp_path) not in error and str(env) not in error and "Traceback" not in error
    assert seconds < PAGE_S, seconds
    lib = RunsLibrary(env)
    assert lib.entries() == [] and list(lib.runs_dir.iterdir()) == [] and list(lib.tmp_dir.iterdir()) == []

    at.switch_page("page_scripts/overview.py").run()  # the next page load works
    assert not at.exception and _errors(at) == []
    assert [s.value for s in at.subheader][0] == "nano-good"


def test_damaged_library_index_is_a_message_on_every_page(env, runs):
    at = _library_page()
    assert not at.exception and _errors(at) == []
    (env / "library.sqlite").write_bytes(b"not a database" * 64)
    at.run()  # damaged while the server runs
    assert not at.exception
    assert any("library.sqlite" in e and "restart the app" in e and "no run is deleted" in e for e in _errors(at))
    assert not any(str(env) in e for e in _errors(at))
    library_home._library.clear()  # the restart the message names: the index is moved aside and rebuilt
    at.run()
    assert not at.exception and _errors(at) == []
    assert any("moved aside" in i.value for i in at.info)
    at.switch_page("page_scripts/overview.py").run()  # the other pages still serve the preloaded runs
    assert not at.exception and _errors(at) == []
    assert [s.value for s in at.subheader][0] == "nano-good"


def test_overview_shows_no_server_path_and_no_remote_images(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.run()
    assert not at.exception and _errors(at) == []
    texts = [m.value for m in at.markdown] + [c.value for c in at.caption]
    assert not any(str(runs["root"]) in t for t in texts)
    [card] = [m.value for m in at.markdown if "tracker" in m.value]
    html = MarkdownIt().render(card)
    assert "<img" not in html and "evil.example" in html  # the image is a link to click, not a load
    assert '<a href="http://x.example">' in html  # ordinary links stay links


def test_generate_without_a_tokenizer_names_no_folder(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.session_state["k3lab_text_source"] = "MQAR sequence"
    at.run()
    at.selectbox(key="k3lab_run").select("nano-512").run()
    at.switch_page("page_scripts/generate.py").run()
    assert not at.exception
    [error] = _errors(at)
    assert "cannot be prompted with text" in error and "512 token ids" in error
    assert str(runs["root"]) not in error and "nano-512" in error


def test_a_link_cannot_put_markdown_in_the_app(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.query_params.update({"run": "![x](http://evil.example/i.png)", "section": "[login](http://phish.example)"})
    at.run()
    assert not at.exception
    notes = [w.value for w in at.warning if "not known here" in _shown(w.value)]
    assert len(notes) == 2
    for note in notes:
        html = MarkdownIt().render(note)
        assert "<img" not in html and "<a" not in html, html
    shown = " ".join(_shown(n) for n in notes)
    assert "![x](http://evil.example/i.png)" in shown and "[login](http://phish.example)" in shown  # as text


def test_markdown_escaping_shows_the_text_exactly():
    for text in (
        "![x](http://e/i.png) [a](http://b) `code` **bold** _em_ <b>html</b> $x$ :red[red] :material/home:",
        "tensor 'w`])<script>' # heading\n- item\n1. item | a | b |",
        "back\\slash & ampersand ~strike~ {curly} http://bare.example www.bare.example mail@bare.example",
    ):
        html = COMMONMARK.render(md_escape(text))
        assert not AUTOLINK_STARTS.search(html), html
        for tag in ("<img", "<a ", "<code", "<strong", "<em", "<h1", "<li", "<b>"):
            assert tag not in html, (text, html)
        assert _shown(md_escape(text)) == text
    assert markdown_card("![a](http://x/y.png)") == "\\![a](http://x/y.png)"
    # a blank header row (drawn as an empty first row) is named; a table with a header keeps it
    card = (Path(__file__).resolve().parents[2] / "sample_checkpoints" / "k3-full" / "README.md").read_text()
    html = COMMONMARK.render(markdown_card(card))
    assert "<th>item</th>" in html and not re.search(r"<th>\s*</th>", html)
    assert markdown_card("| a | b |\n|---|---|\n| 1 | 2 |") == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert strip_paths("/srv/k3/runs/abc/config.json: bad; see /tmp/x/y") == "config.json: bad; see y"
    assert strip_paths("http://host/a/b and 2024/01/02") == "http://host/a/b and 2024/01/02"
    assert "secret" not in plain(FileNotFoundError(2, "No such file or directory", "/srv/secret/run"))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=80))
def test_escaped_text_never_becomes_a_link_an_image_or_markup(text):
    html = COMMONMARK.render(md_escape(text)).replace("<pre><code>", "<pre>")  # indented lines: shown verbatim
    for tag in ("<a ", "<img", "<em", "<strong", "<code>", "<h1", "<script", "<del"):
        assert tag not in html, (text, html)
    assert not AUTOLINK_STARTS.search(html), html
    assert _shown(md_escape(text)) == text


def test_names_from_files_are_shown_as_text(env, runs, tmp_path):
    """A config name with a backtick and an image, and a zip entry's name in "Skipped:", stay text."""
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.run()
    at.selectbox(key="k3lab_run").select("nano-named").run()
    assert not at.exception and _errors(at) == []
    [caption] = [c.value for c in at.caption if "config name" in c.value]
    html = COMMONMARK.render(caption)
    assert "<img" not in html and "<code" not in html and "a`b ![x](http://evil.example/i.png)" in _shown(caption)

    archive = tmp_path / "run.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("config.json", "model.safetensors"):
            zf.write(runs["good"] / name, name)
        zf.writestr("![x](http:evil.example) [a](http:phish.example).txt", "junk")
    page = at.switch_page("page_scripts/runs_library.py").run()
    page.get("file_uploader")[0].upload("run.zip", archive.read_bytes())
    page.button(key="k3lab_upload_add").click().run()
    assert not page.exception and _errors(page) == []
    [done] = [s.value for s in page.success if "Skipped" in s.value]
    html = COMMONMARK.render(done)
    assert "<img" not in html and "<a " not in html and "[a](http:phish.example).txt" in _shown(done)


def test_a_long_pasted_text_is_counted_from_its_first_megabyte(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.session_state["k3lab_text_source"] = "Paste text"
    at.session_state["k3lab_paste"] = "to be or not to be " * 150_000  # 2.85 MB
    at.run()
    assert not at.exception and _errors(at) == []
    assert any("Reading the first 16 of about 2,850,000 tokens" in _shown(w.value) for w in at.warning), [
        w.value for w in at.warning
    ]


def test_a_ten_megabyte_prompt_is_refused_and_not_written_back(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.run()
    at.switch_page("page_scripts/generate.py").run()
    at.text_area(key="k3lab_prompt").input("a" * 10_000_000)
    start = time.perf_counter()
    at.button[0].click().run()
    seconds = time.perf_counter() - start
    assert not at.exception
    [error] = _errors(at)
    assert "10,000,000 characters, over the limit of 1,000,000" in error
    assert seconds < PAGE_S and not any(len(c.value) > 100_000 for c in at.code)  # nothing echoed into the page


def test_a_link_with_edits_nested_fifty_thousand_deep_is_a_note(env, runs):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["k3lab_max_tokens"] = 16
    at.query_params["edits"] = "[" * 50_000 + "]" * 50_000
    at.run()
    assert not at.exception and _errors(at) == []
    assert any("nested more than 16 levels" in _shown(w.value) for w in at.warning)
