"""analysis.runs.job_memory's measured side: the bytes a finished job's result holds (held_bytes, context_bytes), which
the server's kept results count (issue 28). The estimates are checked against measured peaks in
tests/app/server/test_job_budget.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from analysis.runs import texts
from analysis.runs.job_memory import context_bytes, held_bytes
from analysis.runs.loading import load_run, trace_run
from k3core.interp.trace_size import WHAT_ALL

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
MB = 1024**2


def test_each_buffer_is_counted_once_however_it_is_seen():
    a = np.zeros((1024, 256))  # 2 MiB
    assert held_bytes(a) == a.nbytes
    assert held_bytes(a[:10], a[5:], a.T) == a.nbytes  # views hold the whole owner, once
    assert held_bytes({"x": a[:1]}) - held_bytes({"x": 0}) == a.nbytes  # a slice keeps its owner alive
    t = torch.zeros(512, 512)  # 1 MiB of torch memory, seen through numpy as Trace.add keeps it
    assert held_bytes(t.numpy(), t[:3].numpy(), t) == 512 * 512 * 4
    assert held_bytes(a, t) == a.nbytes + 512 * 512 * 4


def test_tables_figures_and_nesting_are_measured():
    df = pd.DataFrame({"x": np.arange(100_000, dtype=np.float64), "name": ["token"] * 100_000})
    assert held_bytes(df) == int(df.memory_usage(deep=True).sum()) > 100_000 * 8
    fig = go.Figure(go.Heatmap(z=np.ones((500, 500))))
    assert 500 * 500 * 8 <= held_bytes(fig) < 500 * 500 * 8 + MB  # its data, not the template
    deep: list = []
    for _ in range(50_000):  # nested far past the recursion limit
        deep = [deep]
    assert held_bytes(deep) > 50_000 * 56
    assert held_bytes(torch.nn.Linear(512, 512)) == 0  # a model is not a result
    assert held_bytes(None, 3, 2.5, True) == 0


def test_a_context_counts_its_trace_tokens_and_later_results_not_its_model():
    run = load_run(SAMPLE)
    ctx = trace_run(run, texts.sample_input("shakespeare", run.config, 256, run.tokenizer), what=list(WHAT_ALL))
    arrays = sum(a.nbytes for a in ctx.trace.arrays.values())
    measured = context_bytes(ctx)
    assert arrays <= measured < arrays + MB  # the arrays, their names, axes and meta
    assert context_bytes(ctx.with_options(label="other", seq_len=4096)) == measured  # a copy shares the trace
    ctx.once("experiment", lambda: np.zeros((256, 1024)))  # a result computed on it later
    assert 0 <= context_bytes(ctx) - measured - 256 * 1024 * 8 < 1024  # the array, its key and the dict's growth
    params = sum(p.numel() * p.element_size() for p in run.model.parameters())
    assert params > 5 * MB and measured < arrays + MB  # the 6 MB of weights are not in it
