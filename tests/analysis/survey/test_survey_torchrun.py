"""``k3lab survey`` under torchrun (gloo on CPU): each rank surveys its batches, rank 0 merges; 2 and 3 processes give
the state of one process (counts, histograms and top-k tables exactly, float sums to rounding); and the command line:
cost first, --report and --export of the folder without the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.survey.folder import Survey, read_survey
from analysis.survey.plan import sample_corpus_text
from k3lab.survey import main as survey_main

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "sample_checkpoints" / "k3-full"
pytestmark = pytest.mark.slow  # torchrun launches 2-3 processes per test
ARGS = ["--tokens", "400", "--seq-len", "32", "--batch-size", "2", "--top-contexts", "4", "--reservoir", "3"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(sample_corpus_text("shakespeare-val")[:2000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def single(corpus_file, tmp_path_factory) -> Survey:
    out = tmp_path_factory.mktemp("one") / "s"
    assert survey_main([str(SAMPLE), "--text", str(corpus_file), "--out", str(out), "--threads", "1", "--no-progress",
                        *ARGS]) == 0  # fmt: skip
    return read_survey(out)


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_survey_equals_one_process(single, corpus_file, tmp_path, nproc):
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "k3lab",
           "survey", str(SAMPLE), "--text", str(corpus_file), "--out", str(out), *ARGS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = read_survey(out)
    assert got.complete and got.card["run"]["world_size"] == nproc
    assert single.plan.batches == 6  # 400 tokens -> 12 sequences of 32 -> 6 batches: ranks get 3/3 or 2/2/2
    for name, a in single.state.sums.items():
        if a.dtype.kind == "i":
            np.testing.assert_array_equal(got.state.sums[name], a, err_msg=name)
        else:
            np.testing.assert_allclose(got.state.sums[name], a, rtol=1e-12, atol=1e-12, err_msg=name)
    for name, t in single.state.tops.items():
        assert (got.state.tops[name].id == t.id).all(), name
        assert (got.state.tops[name].payload == t.payload).all(), name


def test_cli_cost_first_report_and_export(single, corpus_file, tmp_path, capsys):
    assert survey_main(["--report", str(single.path), "--export", str(tmp_path / "x")]) == 0
    text = capsys.readouterr().out
    assert "MaxVio" in text and "most specialised" in text and "belady hit rate" in text
    assert (tmp_path / "x" / "atlas.csv").is_file() and (tmp_path / "x" / "cache.json").is_file()
    out = tmp_path / "again"
    assert survey_main([str(SAMPLE), "--text", str(corpus_file), "--out", str(out), "--no-progress", *ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sequences x 32" in lines[0] and "estimated" in lines[1]
    assert survey_main([str(SAMPLE), "--sample", "shakespeare", "--out", str(out), "--tokens", "1"]) == 2
    assert survey_main([str(SAMPLE), "--out", str(out)]) == 2
    assert "give RUN" in capsys.readouterr().err
