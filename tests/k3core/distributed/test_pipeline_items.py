"""The pipeline-parallel trace (3 processes under torchrun, gloo) holds every item the single-process trace holds, for
what="default" and what="all": the comparison walks the single-process trace's own names (so an item added to the
recorder later is compared too), and every value is equal, bit for bit. On the k3-full sample (exact Gram matrices) and
on a model wider than ``EXACT_GRAM_MAX_WIDTH`` (the Gram sketch: the pair of depths across a rank boundary is
sketched by rank 0 with the same projection)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.runs import loading as runs_mod
from analysis.runs.trace_writer import read_inputs, write_run_traces
from k3core.interp.hidden_moments import EXACT_GRAM_MAX_WIDTH
from k3core.interp.trace import names
from k3core.interp.trace_folder import read_trace_dir
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset

REPO = Path(__file__).resolve().parents[3]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
MAX_TOKENS = 40
pytestmark = pytest.mark.slow  # torchrun launches 3 processes per test


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-items")
    (root / "text.txt").write_text(TEXT)
    torch.manual_seed(5)
    wide = from_preset("k3-nano", hidden_size=EXACT_GRAM_MAX_WIDTH + 16)
    return {
        "k3-full": REPO / "sample_checkpoints" / "k3-full",
        "wide": K3ForCausalLM.from_config(wide).save_pretrained(root / "wide"),
        "text": root / "text.txt",
    }


def _pipeline(path: Path, text: Path, what: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "-m", "tests.pipeline_what", what, str(path), "--text", str(text), "--max-tokens", str(MAX_TOKENS),
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "K3LAB_BACKEND": "gloo", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name,what", [("k3-full", "default"), ("k3-full", "all"), ("wide", "default")])
def test_three_processes_write_every_item_one_process_writes(inputs, tmp_path, name, what):
    _pipeline(inputs[name], inputs["text"], what, tmp_path / "pipeline")
    got = read_trace_dir(tmp_path / "pipeline").trace(0)

    torch.set_num_threads(1)  # as torchrun runs each rank: the same summation order in the matmuls
    run = runs_mod.load_run(inputs[name])
    chosen = read_inputs(run, [inputs["text"]], None, MAX_TOKENS)
    write_run_traces(run, chosen, tmp_path / "single", what=what)
    want = read_trace_dir(tmp_path / "single").trace(0)

    assert names.hidden_bins("count") in want.arrays  # the moments are among the compared items
    wide = name == "wide"
    assert (names.hidden_bins("sketch_gram") in want.arrays) == wide
    assert (names.hidden_bins("gram") in want.arrays) != wide
    assert sorted(got.arrays) == sorted(want.arrays)
    for item in want.arrays:  # the single-process trace's names: whatever it holds is compared
        assert got.axes[item] == want.axes[item], item
        assert got[item].dtype == want[item].dtype, item
        np.testing.assert_array_equal(got[item], want[item], err_msg=item)
    assert got.meta["coverage"] == want.meta["coverage"]
    assert got.meta.get("hidden_sketch") == want.meta.get("hidden_sketch")
