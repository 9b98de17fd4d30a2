"""Headless report, inspect and run loading, end to end on real k3-nano checkpoints saved to tmp_path."""

from __future__ import annotations

import html
import json
import re

import pandas as pd
import pytest
import torch

from analysis.output.export import read_csv_with_provenance
from analysis.runs import loading as runs
from analysis.runs import texts
from analysis.views.catalogue import all_views
from analysis.weights import checkpoint_summary
from k3core.data.batches import IGNORE_INDEX
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.presets import from_preset
from k3lab import inspect as insp
from k3lab import report
from tests.conftest import nano_model

METRICS = {
    "history": [
        {"step": 0, "tokens": 0, "loss": 5.5, "moe": {"maxvio": [1.0, 2.0], "cv": [0.4, 0.5]}},
        {"step": 10, "tokens": 2048, "loss": 3.1, "val_bpb": 3.4, "moe": {"maxvio": [0.6, 0.9], "cv": [0.2, 0.3]}},
    ]
}
FAST = ["--no-static", "--max-tokens", "40", "--skip-model-views", "--quiet"]


def save_nano(path, seed: int, metrics: dict | None = None):
    nano_model(seed, kda_chunk_size=16).save_pretrained(path)
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return save_nano(root / "nano-a", 0, METRICS), save_nano(root / "nano-b", 1)


def selected_views():
    return [v for v in all_views() if not v.needs_model]


# ----------------------------------------------------------------------------- report
MINE = ("degradation", "history")  # the sections this test file's owner maintains; others have their own tests


def test_single_run_report(ckpts, tmp_path, capsys):
    out = tmp_path / "rep"
    rc = report.main([str(ckpts[0]), "--out", str(out), *FAST])
    page = (out / "report.html").read_text()
    printed = capsys.readouterr()
    # a view that crashes is reported (exit 1, "Failed:" in the page), never loses the report
    assert rc in (0, 1) and ((rc == 1) == ("<p class='err'>Failed:" in page)), printed.err
    assert not any(f"FAILED {v.key}:" in printed.err for v in selected_views() if v.section in MINE), printed.err
    assert not re.search(r"<script[^>]+src=", page), "the report must not load scripts from the network"
    assert page.count("<script type='text/javascript'>") == 1  # plotly.js inline once
    for view in selected_views():
        assert f"id='view-{view.key}'" in page, view.key
        if (out / "figures" / f"{view.key}.csv").exists():
            assert f'id="fig-{view.key}"' in page, view.key
    for key in ("degradation_entropy", "degradation_rank_collapse", "history_curves", "history_moe"):
        assert f'id="fig-{key}"' in page and (out / "figures" / f"{key}.json").is_file(), key
    assert not list((out / "figures").glob("*.png"))  # --no-static
    headline = json.loads((out / "headline.json").read_text())
    h = headline["runs"][0]
    assert h["tokens"] == 40 and h["bits_per_byte"] > 0 and 0 <= h["sink_rate"] <= 1
    assert "k3-nano" in page and "Headline numbers" in page
    assert "wrote" in printed.out
    # the checkpoint's absolute path on the machine that wrote it stays out of a shared page (its name is shown)
    assert str(ckpts[0].resolve()) not in page and str(ckpts[0]) not in page and ckpts[0].name in page
    for written in out.rglob("*"):  # nor in any other file of the folder (the app's "Download all" zips it)
        if written.is_file():
            data = written.read_bytes()
            assert str(ckpts[0].resolve()).encode() not in data and str(ckpts[0]).encode() not in data, written
    assert headline["checkpoints"][0]["folder"] == ckpts[0].name
    # every CSV is plain: pandas.read_csv with no options gets the columns its JSON names (the provenance is there)
    csvs = sorted((out / "figures").glob("*.csv"))
    assert len(csvs) >= 10
    for path in csvs:
        doc = json.loads(path.with_suffix(".json").read_text())
        table = pd.read_csv(path)
        assert list(table.columns) == doc["columns"] and len(table) == len(doc["rows"]), path.name
        assert doc["runs"] == ["nano-a"] and "view" in doc, path.name


def test_two_run_comparison_report(ckpts, tmp_path):
    out = tmp_path / "cmp"
    args = [str(ckpts[0]), str(ckpts[1]), "--out", str(out), "--sample", "repeat", "--views", ",".join(MINE)]
    assert report.main([*args, *FAST]) == 0
    page = (out / "report.html").read_text()
    for key in ("degradation_entropy", "degradation_kda_state_rank", "degradation_rank_collapse"):
        assert f'id="fig-{key}__side"' in page and f'id="fig-{key}__diff"' in page, key
    assert 'id="fig-history_curves"' in page  # overlaid, not side by side
    curves = json.loads((out / "figures" / "history_curves.json").read_text())
    assert {r["run"] for r in curves["rows"]} == {"nano-a"}  # run B has no metrics.json
    headline = json.loads((out / "headline.json").read_text())
    assert len(headline["runs"]) == 2
    a, b = headline["runs"]
    assert headline["delta_a_minus_b"]["loss"] == pytest.approx(a["loss"] - b["loss"])
    assert "delta (A - B)" in page
    # the loss difference's noise floor travels with it, as on the Compare page (analysis.metrics.loss_noise)
    noise = headline["loss_noise"]
    assert noise["delta_nats"] == pytest.approx(a["loss"] - b["loss"], abs=1e-6)
    assert noise["paired"] is True and noise["n_windows"] >= 2 and noise["ci95_nats"] > 0
    assert noise["within_noise"] == (abs(noise["delta_nats"]) <= noise["ci95_nats"])
    assert headline["ci95_a_minus_b"]["loss"] == pytest.approx(noise["ci95_nats"])
    assert noise["separate_training"] is True and "seed" in noise["statement"]  # two checkpoints trained apart
    assert noise["statement"].startswith("A - B = ") and "95% CI" in noise["statement"]
    assert "± (95% CI)" in page and html.escape(noise["statement"]) in page


def test_report_bad_inputs_exit_2(ckpts, tmp_path, capsys):
    assert report.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert report.main([str(broken), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "config.json" in capsys.readouterr().err
    assert report.main([str(ckpts[0]), "--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "no such text file" in capsys.readouterr().err


def test_report_on_a_text_file(ckpts, tmp_path):
    """Through the k3lab command, with the device options generate has: the run is loaded as asked."""
    from k3lab.cli import main as k3lab_main

    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 3)
    out = tmp_path / "txt"
    args = [str(ckpts[1]), "--text", str(text), "--out", str(out), "--views", "degradation"]
    assert k3lab_main(["report", *args, "--device", "cpu", "--dtype", "float32", *FAST]) == 0
    page = (out / "report.html").read_text()
    assert "To be, or not to be" in page and 'id="fig-degradation_sink"' in page
    # every figure file says what it was computed on: the text and its token count (analysis.output.export.provenance),
    # in the JSON beside the plain CSV
    tokens = json.loads((out / "headline.json").read_text())["runs"][0]["tokens"]
    table, head = read_csv_with_provenance(out / "figures" / "degradation_sink.csv")
    assert head["text"].startswith("To be, or not to be") and head["tokens"] == tokens and len(table)
    meta = json.loads((out / "figures" / "degradation_sink.json").read_text())
    assert meta["text"].startswith("To be, or not to be") and meta["tokens"] == tokens
    assert 'id="fig-history_curves"' not in page  # not selected
    checkpoint = json.loads((out / "headline.json").read_text())["checkpoints"][0]
    assert (checkpoint["device"], checkpoint["dtype"]) == ("cpu", "float32")


@pytest.mark.browser
@pytest.mark.slow
def test_report_with_static_images(ckpts, tmp_path):
    from analysis.output.export import static_export_available

    ok, why = static_export_available()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "static"
    args = [str(ckpts[0]), "--out", str(out), "--max-tokens", "32", "--views", "degradation_entropy,degradation_sink"]
    assert report.main([*args, "--quiet"]) == 0
    for key in ("degradation_entropy", "degradation_sink"):
        assert (out / "figures" / f"{key}.png").stat().st_size > 1000
        assert "<svg" in (out / "figures" / f"{key}.svg").read_text()[:500]


# ----------------------------------------------------------------------------- runs
def test_load_run_and_samples(ckpts):
    run = runs.load_run(ckpts[0])
    assert run.metrics == METRICS and run.card["training"]["final_val_bpb"] == 3.4
    assert run.card["parameters"] == run.model.num_parameters() and len(run.fingerprint) == 64
    other = runs.load_run(ckpts[1])
    assert other.metrics is None and any("metrics.json" in n for n in other.card["notes"])
    shakespeare = texts.sample_input("shakespeare", run.config, 64)
    assert shakespeare.input_ids.shape == (1, 64) and shakespeare.text.startswith("ANTONY:")
    mqar = texts.sample_input("mqar", run.config, 64)
    assert (mqar.targets != IGNORE_INDEX).sum() > 0
    ctx = runs.trace_run(run, mqar)
    nll = ctx.trace["token_nll"][0]
    assert torch.isfinite(torch.as_tensor(nll)).sum() == (mqar.targets != IGNORE_INDEX).sum()  # loss on answers only
    with pytest.raises(ValueError, match="unknown sample"):
        texts.sample_input("nope", run.config)
    with pytest.raises(ValueError, match="vocab"):
        texts.encode_text("hello", from_preset("k3-nano", vocab_size=512))
    with pytest.raises(CheckpointError):
        runs.load_run(ckpts[0] / "missing")


# ----------------------------------------------------------------------------- inspect
def test_inspect_prints_config_params_and_layer_map(ckpts, capsys):
    assert insp.main([str(ckpts[0])]) == 0
    text = capsys.readouterr().out
    cfg = from_preset("k3-nano")
    assert "-- layer map" in text and "attnres block" in text and "+-- block 1" in text
    for i in range(cfg.num_hidden_layers):
        mixer = "MLA" if cfg.is_mla_layer(i) else "KDA"
        assert re.search(rf"^\s+{i}\s+{mixer}\s", text, re.M), (i, mixer)
    assert "final_val_bpb" in text and "MoE routed experts" in text


def test_inspect_parameter_counts_add_up(ckpts, capsys):
    model = runs.load_run(ckpts[0]).model
    parts = checkpoint_summary.parameter_breakdown(model)
    assert sum(v["total"] for v in parts.values()) == model.num_parameters()
    assert sum(v["active"] for v in parts.values()) == model.num_parameters(active=True)
    assert insp.main([str(ckpts[0]), "--json", "--sample", "shakespeare", "--max-tokens", "32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["headline"]["tokens"] == 32 and len(data["layer_map"]) == model.config.num_hidden_layers
    # --dtype reaches the model: bf16 weights move the loss a little, never by much
    args = [str(ckpts[0]), "--json", "--sample", "shakespeare", "--max-tokens", "32", "--device", "cpu"]
    assert insp.main([*args, "--dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)["headline"]["loss"]
    assert bf16 != data["headline"]["loss"] and bf16 == pytest.approx(data["headline"]["loss"], rel=1e-2)
    assert insp.main(["k3-mini"]) == 0 and "preset k3-mini" in capsys.readouterr().out
    assert insp.main([str(ckpts[0] / "nope")]) == 2
