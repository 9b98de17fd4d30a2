"""A trace folder with several texts opens any of them, not only its first: the app's sidebar picks a recorded text
(and its link reopens it), Compare shows two of them, each text's trace is read once, and `k3lab report --text-index`
reports the one asked for (k3-full traced on two different texts, through analysis.runs.trace_writer)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from analysis.output.export import read_csv_with_provenance
from analysis.runs import loading as runs_mod
from analysis.runs.trace_writer import read_inputs, write_run_traces
from app.state.inputs import TEXT_RECORDED, TextChoice
from k3core.interp.trace_folder import TraceDir
from k3lab.cli import main as k3lab

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "sample_checkpoints" / "k3-full"
APP = ROOT / "app" / "main.py"
MAX_TOKENS = 24
TEXTS = ("ROMEO:\nBut soft, what light through yonder window breaks?", "To be, or not to be: [that] is *the* question.")


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    """k3-full traced on two different texts (write_run_traces, as `k3lab trace` does on one process); the
    checkpoint copy is then deleted, so everything below reads the folder alone."""
    root = tmp_path_factory.mktemp("two-texts")
    ckpt = root / "k3-full"
    shutil.copytree(SAMPLE, ckpt)
    files = []
    for i, text in enumerate(TEXTS):
        files.append(root / f"text{i}.txt")
        files[-1].write_text(text)
    run = runs_mod.load_run(ckpt)
    inputs = read_inputs(run, files, None, MAX_TOKENS)
    out = write_run_traces(run, inputs, root / "trace")
    write_run_traces(run, inputs[::-1], root / "reversed")  # the same two texts, in the other order
    shutil.rmtree(ckpt)
    folder = TraceDir(out, json.loads((out / "run_card.json").read_text()))
    tokens = [folder.texts[i]["tokens"] for i in range(2)]
    assert tokens[0] != tokens[1]
    return {"out": out, "folder": folder, "tokens": tokens, "root": root, "reversed": root / "reversed"}


VIEW = "attnres_hidden_rms"  # per depth, the hidden state's RMS over the text's tokens: differs between texts


def _view():
    from analysis.views.catalogue import all_views

    return next(v for v in all_views() if v.key == VIEW)


@pytest.fixture(scope="module")
def direct(traced) -> list[tuple]:
    """(figure, table) of VIEW built straight from each text's trace (label as the app names the run)."""
    run = runs_mod.load_run(traced["out"])
    built = [_view().build(runs_mod.trace_run(run, runs_mod.recorded_input(run, i), label="trace")) for i in (0, 1)]
    assert not np.allclose(built[0][1]["mean"], built[1][1]["mean"])  # the two texts tell apart
    return built


def _values(v) -> np.ndarray:
    """A chart's numbers: a list, or plotly's typed array ({"dtype", "bdata"})."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).astype(float)
    return np.asarray(v, dtype=float)


def _chart_ys(at: AppTest) -> list[np.ndarray]:
    """The y values of every trace of every chart on the page."""
    out = []
    for chart in at.get("plotly_chart"):
        for trace in json.loads(chart.proto.spec)["data"]:
            if "y" in trace:
                try:
                    out.append(_values(trace["y"]))
                except (TypeError, ValueError):
                    continue
    return out


def _shows(at: AppTest, table) -> bool:
    """Whether a chart on the page draws the table's mean column (the app rounds the screen copy to 5 digits)."""
    want = table["mean"].to_numpy(dtype=float)
    return any(y.shape == want.shape and np.allclose(y, want, rtol=5e-4, atol=0) for y in _chart_ys(at))


# ------------------------------------------------------------------------------------------- library
def test_recorded_input_reads_the_asked_text_and_a_bad_index_says_how_many(traced):
    run = runs_mod.load_run(traced["out"])
    assert runs_mod.recorded_count(run) == 2
    for i in (0, 1):
        ctx = runs_mod.trace_run(run, runs_mod.recorded_input(run, i))
        assert [int(t) for t in ctx.input_ids[0]] == traced["tokens"][i]
        np.testing.assert_array_equal(ctx.trace["tokens"][0], traced["tokens"][i])
    for bad in (2, -1):
        with pytest.raises(ValueError, match=r"no text .*recorded 2 text\(s\), numbered 0\.\.1: 0 · text0\.txt"):
            runs_mod.recorded_input(run, bad)
    label = runs_mod.recorded_text_label(traced["folder"].texts[1], 1)
    assert label.startswith("1 · text1.txt · ") and "tokens · To be, or not to be" in label


def test_each_text_trace_is_read_from_its_own_file(traced, monkeypatch):
    run = runs_mod.load_run(traced["out"])
    read = []
    original = TraceDir.trace
    monkeypatch.setattr(
        TraceDir, "trace", lambda self, index=0, **kw: read.append(index) or original(self, index, **kw)
    )
    runs_mod.trace_run(run, runs_mod.recorded_input(run, 1))
    assert read == [1]


# ------------------------------------------------------------------------------------------- app
@pytest.fixture
def app_with(traced, monkeypatch, tmp_path):
    """The app offering only the two-text trace folder (a fresh runs library, no samples); counts trace reads."""
    from app.library import run_list
    from app.server.settings import HOME_ENV

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(traced["out"]))
    (tmp_path / "no-samples").mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", tmp_path / "no-samples")
    reads: list[int] = []
    original = TraceDir.trace

    def counted(self, index=0, **kwargs):
        if self.path == traced["out"]:
            reads.append(index)
        return original(self, index, **kwargs)

    monkeypatch.setattr(TraceDir, "trace", counted)

    def make(params: dict[str, str] | None = None) -> AppTest:
        at = AppTest.from_file(str(APP), default_timeout=180)
        if params:
            at.query_params.update(params)
        return at

    make.reads = reads
    return make


def _plain(text: str) -> str:
    """Text as shown: the app escapes file-controlled text for Markdown; drop the escapes."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)


def _errors(at: AppTest) -> list[str]:
    return [_plain(e.value) for e in at.error]


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"page_scripts/{name}.py").run()


def _shown_loss(at: AppTest) -> float:
    found = [re.search(r"loss (\d+\.\d+)", c.value) for c in at.caption]
    return float(next(m.group(1) for m in found if m))


def test_the_sidebar_picks_text_1_and_its_figures_are_text_1s(app_with, traced, direct):
    at = app_with()
    at.run()
    assert not at.exception and _errors(at) == []
    picker = at.selectbox(key="k3lab_text_index")
    assert picker.options == [runs_mod.recorded_text_label(e, i) for i, e in enumerate(traced["folder"].texts)]
    assert any("has no model, so it cannot read a new text" in c.value for c in at.caption)
    assert not at.get("text_area")  # no text box: nothing could read a new text
    losses = [traced["folder"].texts[i]["loss"] for i in (0, 1)]
    assert _shown_loss(at) == pytest.approx(losses[0], abs=1e-3)
    picker.set_value(1).run()
    assert not at.exception and _errors(at) == []
    assert _shown_loss(at) == pytest.approx(losses[1], abs=1e-3)  # text 1's recorded forward, not text 0's
    assert at.query_params["text_index"] == "1"
    _page(at, "attnres")
    assert not at.exception and _errors(at) == []
    assert _shows(at, direct[1][1]) and not _shows(at, direct[0][1])  # the figure's data is text 1's trace
    # back and forth: each text's trace file is read once
    at.selectbox(key="k3lab_text_index").set_value(0).run()
    assert _shows(at, direct[0][1]) and not _shows(at, direct[1][1])
    at.selectbox(key="k3lab_text_index").set_value(1).run()
    assert not at.exception and _shows(at, direct[1][1])
    assert sorted(app_with.reads) == [0, 1], app_with.reads


def test_a_link_with_the_text_index_reopens_that_text(app_with, traced):
    at = app_with({"text_index": "1"})
    at.run()
    assert not at.exception and _errors(at) == []
    assert at.selectbox(key="k3lab_text_index").value == 1
    assert _shown_loss(at) == pytest.approx(traced["folder"].texts[1]["loss"], abs=1e-3)
    assert not at.warning


@pytest.mark.parametrize(
    "bad, warned",
    [
        ("7", "There is no text 7 in the trace folder trace: it recorded 2 text(s), numbered 0..1. Showing text 0."),
        ("-1", "The link's text_index='-1' is not a whole number in 0..1000000; showing the default."),
        ("one", "The link's text_index='one' is not a whole number in 0..1000000; showing the default."),
    ],
)
def test_a_bad_text_index_in_a_link_warns_and_shows_text_0(app_with, traced, bad, warned):
    at = app_with({"text_index": bad})
    at.run()
    assert not at.exception and _errors(at) == []
    assert at.selectbox(key="k3lab_text_index").value == 0
    assert warned in [_plain(w.value) for w in at.warning]
    assert _shown_loss(at) == pytest.approx(traced["folder"].texts[0]["loss"], abs=1e-3)  # the page keeps running


def test_compare_text_0_with_text_1_of_one_trace_folder(app_with, traced, direct):
    at = app_with({"mode": "texts", "section": "attnres"})
    at.run()
    _page(at, "compare")
    assert not at.exception and _errors(at) == []
    assert at.selectbox(key="k3lab_cmp_text_index").value == 1  # B defaults to the other text
    caption = next(_plain(c.value) for c in at.caption if "**A**" in c.value)
    n0, n1 = (len(t) for t in traced["tokens"])
    assert (
        f"{n0:,} tokens of recorded: text0.txt (text 0)" in caption
        and f"{n1:,} tokens of recorded: text1.txt (text 1)" in caption
    )
    assert at.query_params["text_index_b"] == "1"
    assert _shows(at, direct[0][1]) and _shows(at, direct[1][1])  # side by side: each half its own text's trace
    # a link reopens the comparison of text 1 with text 0
    again = app_with({"mode": "texts", "section": "attnres", "text_index": "1", "text_index_b": "0"})
    again.run()
    _page(again, "compare")
    assert not again.exception and _errors(again) == []
    caption = next(_plain(c.value) for c in again.caption if "**A**" in c.value)
    shown_a, shown_b = caption.split(" · ")
    assert (
        f"{n1:,} tokens of recorded: text1.txt (text 1)" in shown_a
        and f"{n0:,} tokens of recorded: text0.txt (text 0)" in shown_b
    )


def test_a_checkpoint_reads_a_recorded_text_as_pasted_text():
    from app.state.inputs import InputError, check_text

    check_text(TextChoice(TEXT_RECORDED, text="To be", name="b.txt", recorded=1))
    with pytest.raises(InputError, match="no readable text"):
        check_text(TextChoice(TEXT_RECORDED, text=None, recorded=1))
    assert TextChoice(TEXT_RECORDED, name="b.txt", recorded=1).short == "text 1 (b.txt)"


# ------------------------------------------------------------------------------------------- CLI
def _report_means(out: Path) -> np.ndarray:
    table, _ = read_csv_with_provenance(out / "figures" / f"{VIEW}.csv")  # led by the run, text and token count
    return table["mean"].to_numpy(dtype=float)


def test_report_text_index_writes_text_1s_tables(traced, tmp_path, direct):
    out = tmp_path / "r1"
    args = ["report", str(traced["out"]), "--views", VIEW, "--no-static", "--quiet"]
    assert k3lab([*args, "--text-index", "1", "--out", str(out)]) == 0
    headline = json.loads((out / "headline.json").read_text())
    assert headline["input"]["text_index"] == 1
    assert headline["input"]["tokens"] == len(traced["tokens"][1])
    assert headline["runs"][0]["loss"] == pytest.approx(traced["folder"].texts[1]["loss"], rel=1e-6)
    np.testing.assert_allclose(_report_means(out), direct[1][1]["mean"], rtol=1e-6)  # text 1's table
    out0 = tmp_path / "r0"
    assert k3lab([*args, "--out", str(out0)]) == 0  # no --text-index: text 0, as before
    np.testing.assert_allclose(_report_means(out0), direct[0][1]["mean"], rtol=1e-6)


def test_report_text_index_all_writes_one_report_per_text(traced, tmp_path, direct):
    out = tmp_path / "all"
    args = ["report", str(traced["out"]), "--views", VIEW, "--no-static", "--quiet"]
    assert k3lab([*args, "--text-index", "all", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["text-0", "text-1"]
    for i in (0, 1):
        assert json.loads((out / f"text-{i}" / "headline.json").read_text())["input"]["text_index"] == i
        np.testing.assert_allclose(_report_means(out / f"text-{i}"), direct[i][1]["mean"], rtol=1e-6)


def test_report_bad_text_index_exits_2_saying_how_many_texts(traced, tmp_path, capsys):
    out = tmp_path / "bad"
    assert k3lab(["report", str(traced["out"]), "--text-index", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no text 2; the trace folder recorded 2 text(s), numbered 0..1: 0 · text0.txt" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as exited:  # not a number: argparse's usage error
        k3lab(["report", str(traced["out"]), "--text-index", "x", "--out", str(out)])
    assert exited.value.code == 2 and "expected a text number (0, 1, ...) or 'all'" in capsys.readouterr().err
    assert not out.exists()


def test_report_text_index_of_a_checkpoint_exits_2(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert k3lab(["report", str(SAMPLE), "--text-index", "0", "--out", str(out), "--quiet"]) == 2
    assert "is not one (no run_card.json)" in capsys.readouterr().err
    assert not out.exists()


def test_compare_a_trace_folder_with_its_checkpoint_reads_the_same_recorded_text(app_with, traced, direct, monkeypatch):
    """Two runs: the folder's text 1 (A) and the checkpoint it was traced from (B) read the same tokens, so B's
    forward gives A's recorded numbers."""
    from app.library import run_list

    monkeypatch.setenv(run_list.RUNS_ENV, os.pathsep.join([str(traced["out"]), str(SAMPLE)]))
    at = app_with({"mode": "runs", "b": "k3-full", "section": "attnres", "text_index": "1"})
    at.run()
    _page(at, "compare")
    assert not at.exception and _errors(at) == []
    caption = next(_plain(c.value) for c in at.caption if "**A**" in c.value)
    n1 = len(traced["tokens"][1])
    assert f"{n1:,} tokens of recorded: text1.txt (text 1)" in caption and f"**B** = k3-full: {n1:,} tokens" in caption
    want = direct[1][1]["mean"].to_numpy(dtype=float)
    halves = [y for y in _chart_ys(at) if y.shape == want.shape and np.allclose(y, want, rtol=5e-4, atol=0)]
    assert len(halves) >= 2  # the recorded half and the checkpoint's own forward on the same text


def test_names_from_the_run_card_are_shown_as_text(app_with, traced, tmp_path, monkeypatch):
    """A run card's text names are file-controlled: plain text in the picker (selectbox options are not Markdown),
    escaped wherever the page renders Markdown (no link, no emphasis)."""
    from app.library import run_list
    from app.render.errors import md_escape

    hostile = tmp_path / "hostile"
    shutil.copytree(traced["out"], hostile)
    card = json.loads((hostile / "run_card.json").read_text())
    name = "**bold** [link](http://example.com)\nline"
    card["texts"][1]["name"] = name
    (hostile / "run_card.json").write_text(json.dumps(card))
    monkeypatch.setenv(run_list.RUNS_ENV, str(hostile))
    at = app_with({"mode": "texts", "section": "attnres"})
    at.run()
    _page(at, "compare")
    assert not at.exception and _errors(at) == []
    assert (
        at.selectbox(key="k3lab_cmp_text_index").options[1].startswith("1 · **bold** [link](http://example.com) line")
    )
    caption = next(c.value for c in at.caption if "**A**" in c.value)
    assert md_escape(f"recorded: {name} (text 1)") in caption and "](http" not in caption


def test_compare_two_trace_folders_matches_the_text_not_its_number(app_with, traced, direct, monkeypatch):
    """A = text 1 of one folder; B, a folder that traced the same texts in the other order, shows its own text 0
    (the same text), not its text 1."""
    from app.library import run_list

    monkeypatch.setenv(run_list.RUNS_ENV, os.pathsep.join([str(traced["out"]), str(traced["reversed"])]))
    at = app_with({"mode": "runs", "b": "reversed", "section": "attnres", "text_index": "1"})
    at.run()
    _page(at, "compare")
    assert not at.exception and _errors(at) == []
    caption = next(_plain(c.value) for c in at.caption if "**A**" in c.value)
    assert "recorded: text1.txt (text 1)" in caption and "**B** = reversed" in caption
    assert "recorded: text1.txt (text 0)" in caption
    want = direct[1][1]["mean"].to_numpy(dtype=float)
    assert len([y for y in _chart_ys(at) if y.shape == want.shape and np.allclose(y, want, rtol=5e-4, atol=0)]) >= 2


def test_download_all_reports_the_picked_recorded_text(traced):
    """The app's "Download all" zip of a trace folder is the report of the text picked in the sidebar."""
    import io
    import zipfile

    from app.library.run_list import RunRef
    from app.render.download_all import report_zip

    ref = RunRef("trace", str(traced["out"]), "preloaded")
    choice = TextChoice(TEXT_RECORDED, len(traced["tokens"][1]), text=TEXTS[1], name="text1.txt", recorded=1)
    with zipfile.ZipFile(io.BytesIO(report_zip([ref], choice, static=False, skip_model_views=True))) as zf:
        headline = json.loads(zf.read("report/headline.json"))
    assert headline["input"]["text_index"] == 1 and headline["input"]["tokens"] == len(traced["tokens"][1])


def test_the_bad_index_warning_stays_until_a_text_is_picked(app_with):
    at = app_with({"text_index": "7"})
    at.run()
    at.run()  # any rerun (another widget, a page): the warning is still there
    assert any("There is no text 7" in w.value for w in at.warning)
    at.selectbox(key="k3lab_text_index").set_value(1).run()
    assert not at.exception and not [w.value for w in at.warning if "There is no text" in w.value]
    assert at.query_params["text_index"] == "1"
