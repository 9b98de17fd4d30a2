"""Trace folders (k3core.interp.trace_folder): `k3lab trace` writes one whole or not at all; `k3lab report DIR`, the app
and the runs library open it with the checkpoint folder gone (trace views drawn, weight views saying they need it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.runs import loading as runs_mod
from analysis.runs import texts as texts_mod
from analysis.runs.trace_writer import read_inputs
from k3core.interp.trace import Trace
from k3core.interp.trace_folder import CARD_NAME, is_trace_dir, read_trace_dir, write_trace_dir
from k3core.loading.tensor_info import CheckpointError
from k3lab.cli import main as k3lab

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict[str, Path]:
    """`k3lab trace` of a copy of k3-full on two texts; the copy is then deleted (the folder travels alone)."""
    root = tmp_path_factory.mktemp("traced")
    ckpt = root / "k3-full"
    shutil.copytree(SAMPLE, ckpt)
    texts = []
    for i, text in enumerate(("ROMEO:\nBut soft, what light through yonder window breaks?", "To be, or not to be.")):
        texts += ["--text", str(root / f"text{i}.txt")]
        (root / f"text{i}.txt").write_text(text)
    out = root / "trace"
    assert k3lab(["trace", str(ckpt), *texts, "--max-tokens", str(MAX_TOKENS), "--out", str(out)]) == 0
    run = runs_mod.load_run(ckpt)
    reference = [
        runs_mod.trace_run(run, chosen, what="all").trace
        for chosen in read_inputs(run, [root / "text0.txt", root / "text1.txt"], None, MAX_TOKENS)
    ]
    shutil.rmtree(ckpt)
    return {"out": out, "root": root, "reference": reference}


def test_trace_folder_holds_traces_equal_to_a_direct_trace_and_a_run_card(traced):
    out = traced["out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "README.md",
            CARD_NAME,
            "config.json",
            "metrics.json",
            "trace-0.npz",
            "trace-1.npz",
        ]
    )
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".trace.partial")]
    folder = read_trace_dir(out)
    card = folder.card
    assert card["config"]["num_hidden_layers"] == traced["reference"][0].config["num_hidden_layers"]
    assert {"host", "device", "dtype", "k3lab_version", "source_fingerprint", "time"} <= set(card["made"])
    assert card["edits"] is None
    for i, want in enumerate(traced["reference"]):
        entry = card["texts"][i]
        assert entry["tokens"] == [int(t) for t in want["tokens"][0]]
        assert len(entry["token_strings"]) == len(entry["tokens"])
        got = folder.trace(i)
        assert sorted(got.arrays) == sorted(want.arrays)
        for name, array in want.arrays.items():
            assert got.axes[name] == want.axes[name], name
            np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_report_opens_the_folder_without_the_checkpoint(traced, tmp_path):
    out = tmp_path / "report"
    assert k3lab(["report", str(traced["out"]), "--out", str(out), "--no-static", "--quiet"]) == 0
    html = (out / "report.html").read_text()
    headline = json.loads((out / "headline.json").read_text())
    assert headline["input"]["tokens"] == len(read_trace_dir(traced["out"]).texts[0]["tokens"])
    assert len(list((out / "figures").glob("*.csv"))) > 10  # the trace views are drawn
    assert "needs the checkpoint" in html  # weight views and importance say why they are not drawn
    # the recorded loss is the reference's
    want = traced["reference"][0].meta["run"]["loss"]
    assert headline["runs"][0]["loss"] == pytest.approx(want, rel=1e-6)


def test_a_trace_folder_run_has_no_model_and_refuses_another_text(traced):
    run = runs_mod.load_run(traced["out"])
    assert run.model is None and run.recorded is not None
    chosen = runs_mod.recorded_input(run, 1)
    ctx = runs_mod.trace_run(run, chosen)
    np.testing.assert_array_equal(ctx.trace["tokens"], traced["reference"][1]["tokens"])
    assert ctx.token_strings is not None and len(ctx.token_strings) == chosen.n
    other = texts_mod.sample_input("mqar", run.config, 16)
    with pytest.raises(ValueError, match="needs the checkpoint"):
        runs_mod.trace_run(run, other)


def test_writing_is_all_or_nothing(traced, tmp_path):
    folder = read_trace_dir(traced["out"])
    good = folder.trace(0)
    bad = Trace(arrays=dict(good.arrays), axes=dict(good.axes), meta={"x": object()})  # meta not JSON: save fails
    card = {"config": folder.card["config"], "texts": [folder.texts[0], folder.texts[1]]}
    out = tmp_path / "out"
    with pytest.raises(TypeError):
        write_trace_dir(out, [good, bad], card, "{}")
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no partial folder, no staging left
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        write_trace_dir(tmp_path / "full", [good], {"config": {}, "texts": [{}]}, "{}")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_a_changed_trace_file_is_a_clear_error(traced, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(traced["out"], copy)
    data = (copy / "trace-0.npz").read_bytes()
    (copy / "trace-0.npz").write_bytes(data[: len(data) // 2])
    run = runs_mod.load_run(copy)
    with pytest.raises(CheckpointError, match="does not match its run card"):
        runs_mod.trace_run(run, runs_mod.recorded_input(run))
    (copy / CARD_NAME).write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError, match="not a k3lab run card"):
        runs_mod.load_run(copy)


def test_trace_refuses_a_non_empty_out_and_a_trace_folder_as_input(traced, tmp_path, capsys):
    assert k3lab(["trace", str(traced["out"]), "--out", str(tmp_path / "again")]) == 2
    assert "already a trace folder" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    assert k3lab(["trace", str(SAMPLE), "--out", str(traced["out"])]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_runs_library_keeps_trace_folders(traced, tmp_path):
    from app.library.run_folders import summary_text
    from app.library.store import RunsLibrary

    lib = RunsLibrary(tmp_path / "home")
    by_path = lib.add_path(traced["out"], "my-trace")
    assert by_path.source == "path" and "no weights" in summary_text(by_path.summary)
    files = [(p.name, p.read_bytes()) for p in traced["out"].iterdir()]
    uploaded, skipped = lib.add_files(files, name="uploaded-trace")
    assert skipped == [] and is_trace_dir(uploaded.path)
    assert runs_mod.load_run(uploaded.path).recorded is not None
    renamed = lib.rename(uploaded.id, "renamed-trace")
    assert renamed.name == "renamed-trace"
    lib.delete(renamed.id)
    assert [e.name for e in lib.entries()] == ["my-trace"]


APP = Path(__file__).resolve().parents[3] / "app" / "main.py"


def test_the_app_opens_a_trace_folder_without_the_checkpoint(traced, monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from app.library import run_list
    from app.server.settings import HOME_ENV

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(traced["out"]))
    (tmp_path / "no-samples").mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", tmp_path / "no-samples")
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == []
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Layers"] == str(read_trace_dir(traced["out"]).card["config"]["num_hidden_layers"])
    want = traced["reference"][0].meta["run"]["loss"]
    assert any(f"loss {want:.3f}" in c.value and "recorded" in c.value for c in at.caption)  # the recorded forward
    for name in ("density", "attnres", "moe", "degradation"):
        at.switch_page(f"page_scripts/{name}.py").run()
        assert not at.exception, (name, at.exception)
        assert [e.value for e in at.error] == [], name
        assert len(at.get("plotly_chart")) >= 2, name
    at.switch_page("page_scripts/density.py").run()
    assert any("needs the checkpoint" in i.value for i in at.info), [i.value for i in at.info]
    at.switch_page("page_scripts/weights.py").run()
    assert any("needs the checkpoint" in e.value for e in at.error)
    at.switch_page("page_scripts/generate.py").run()
    assert not at.exception and any("needs the checkpoint" in i.value for i in at.info)
    at.switch_page("page_scripts/experiment.py").run()
    shown = [i.value for i in at.info] + [e.value for e in at.error] + [w.value for w in at.warning]
    assert not at.exception and any("needs the checkpoint" in v for v in shown), shown


def test_upload_and_open_by_path_of_a_trace_folder_in_the_app(traced, monkeypatch, tmp_path):
    """The runs library page: a trace folder uploaded file by file, and one opened by path, become runs whose
    pages draw the recorded trace."""
    from streamlit.testing.v1 import AppTest

    from app.library import home as library_home
    from app.library import run_list
    from app.server.settings import HOME_ENV, ROOTS_ENV

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(ROOTS_ENV, str(traced["out"].parent))
    monkeypatch.setenv(run_list.RUNS_ENV, "")
    (tmp_path / "no-samples").mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", tmp_path / "no-samples")
    library_home._library.clear()
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.run()
    at.switch_page("page_scripts/runs_library.py").run()
    uploader = at.get("file_uploader")[0]
    for file in sorted(traced["out"].iterdir()):
        uploader.upload(file.name, file.read_bytes())
    at.text_input(key="k3lab_upload_name").input("uploaded-trace")
    at.button(key="k3lab_upload_add").click().run()
    assert not at.exception and [e.value for e in at.error] == []
    assert at.session_state["k3lab_run"] == "uploaded-trace"
    at.switch_page("page_scripts/moe.py").run()
    assert not at.exception and [e.value for e in at.error] == []
    assert len(at.get("plotly_chart")) >= 2

    at.switch_page("page_scripts/runs_library.py").run()
    at.text_input(key="k3lab_open_path").input(str(traced["out"]))
    at.button(key="k3lab_open_check").click().run()
    assert not at.exception and [e.value for e in at.error] == []
    assert any("A trace folder" in c.value and "no weights" in c.value for c in at.caption)
    at.button(key="k3lab_open_add").click().run()
    assert not at.exception and [e.value for e in at.error] == []
    assert at.session_state["k3lab_run"] == "trace"


def test_trace_of_an_edited_forward_lists_its_edits(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?")
    args = ["trace", str(SAMPLE), "--text", str(text), "--max-tokens", str(MAX_TOKENS)]
    assert k3lab([*args, "--out", str(tmp_path / "base")]) == 0
    assert k3lab([*args, "--edit", "attnres.uniform site=1.attn", "--out", str(tmp_path / "edited")]) == 0
    base, edited = read_trace_dir(tmp_path / "base"), read_trace_dir(tmp_path / "edited")
    assert base.card["edits"] is None
    [listed] = edited.card["edits"]
    assert listed["kind"] == "attnres" and listed["site"] == "1.attn"
    weights = edited.trace(0)["blocks.1.attn_res.weights"]
    np.testing.assert_allclose(weights, 1.0 / weights.shape[-1], rtol=1e-6)  # the edit is in the trace
    assert not np.allclose(base.trace(0)["blocks.1.attn_res.weights"], weights)
    assert k3lab([*args, "--edit", "moe.ban layer=99 experts=1", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


OLD_NAMES = Path(__file__).resolve().parent / "data" / "old_names_trace"


def test_a_trace_folder_of_the_older_names_opens_in_the_hook_namespace():
    """data/old_names_trace was written by `write_run_traces` before trace arrays took the hook points' names
    (``kda.0.g``, ``attnres.1.attn``, ``moe.1.load``, ...; k3-full, what = kda, mla, attnres, moe, loss; its values
    were recorded again, under the same names and layout, when the trained samples replaced the first k3-full). It opens
    through the renaming table, and every array equals today's recording of the same tokens under its new name (fp32:
    rtol 1e-5, atol 1e-6, as the engine's fused fast paths may round differently from the code that wrote it)."""
    folder = read_trace_dir(OLD_NAMES)
    old = folder.trace(0)
    assert not any(n.startswith(("kda.", "mla.", "moe.", "attnres.", "residual.")) for n in old.arrays)
    renamed = {"blocks.0.kda.g", "blocks.3.mla.attn.entropy", "blocks.1.attn_res.weights", "output_res.weights",
               "blocks.1.moe.experts.load", "blocks.1.moe.selection_bias", "blocks.0.kda.chunk_state.norm"}  # fmt: skip
    assert renamed <= set(old.arrays)
    assert set(old.meta["coverage"]) <= set(old.arrays) and "blocks.0.kda.g" in old.meta["coverage"]
    run = runs_mod.load_run(SAMPLE)
    tokens = folder.card["texts"][0]["tokens"]
    now = runs_mod.trace_run(run, torch.tensor([tokens]), what=old.meta["what"]).trace
    assert set(now.arrays) == set(old.arrays) and now.axes == old.axes
    for name, array in now.arrays.items():  # names exact; values to fp32 rounding
        np.testing.assert_allclose(array, old[name], rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=name)
    assert now.meta["coverage"] == old.meta["coverage"]
