"""``k3lab report --layer/--head``: the per-layer / per-head views focused on that layer and head, the files named
with the pick, checked against the trace; without a pick the report's tables are the views' full tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import attention as at
from analysis.output.export import read_csv_with_provenance
from analysis.runs import loading as runs
from analysis.runs import texts
from k3core.interp.trace import names
from k3lab import report

from ..output.test_report import FAST, ckpts  # noqa: F401 - the fixture

VIEWS = "degradation_entropy_position,degradation_sink,kda_state_norm,degradation_rank_collapse"


def _trace(path):
    run = runs.load_run(path)
    return runs.trace_run(run, texts.sample_input("shakespeare", run.config, 40), what="all").trace


def test_report_layer_and_head(ckpts, tmp_path, capsys):  # noqa: F811
    trace = _trace(ckpts[0])
    mla = trace.layer_indices("mla")[-1]
    out = tmp_path / "picked"
    args = [str(ckpts[0]), "--out", str(out), "--views", VIEWS, "--layer", str(mla), "--head", "1", *FAST]
    assert report.main(args) == 0
    printed = capsys.readouterr().out
    figures = out / "figures"
    table = read_csv_with_provenance(figures / f"degradation_entropy_position_L{mla}H1.csv")[0]
    expected = at.causal_normalised_entropy(at.causal_row_entropy(trace[names.mla_attn(mla)])).mean(0)[1, 1:]
    assert set(table["layer"]) == {mla} and set(table["head"]) == {1}
    np.testing.assert_allclose(table["entropy_norm"], expected, rtol=1e-6)
    sink = read_csv_with_provenance(figures / f"degradation_sink_L{mla}H1.csv")[0]
    np.testing.assert_allclose(
        sink["first_token_mass"], [at.attention_received(trace[names.mla_attn(mla)]).mean(0)[1, 0]]
    )
    # a KDA view has no layer `mla`: listed as not applicable with the KDA layers; a view without picker: unchanged
    kda = ", ".join(str(i) for i in trace.layer_indices("kda"))
    assert f"skipped kda_state_norm_L{mla}H1: layer {mla} is not one of this run's KDA layers: {kda}" in printed
    assert (figures / "degradation_rank_collapse.csv").is_file()

    plain = tmp_path / "plain"
    assert report.main([str(ckpts[0]), "--out", str(plain), "--views", VIEWS, *FAST]) == 0
    full = read_csv_with_provenance(plain / "figures" / "degradation_entropy_position.csv")[0]
    expected = at.entropy_by_position_table(trace).reset_index(drop=True)
    assert list(full.columns) == [*expected.columns, "uniform_entropy_norm"]  # issue 39's null reference beside it
    pd.testing.assert_frame_equal(full[list(expected.columns)], expected, check_dtype=False)
    assert (plain / "figures" / "degradation_rank_collapse.csv").read_bytes() == (
        figures / "degradation_rank_collapse.csv"
    ).read_bytes()


def test_report_two_runs_one_pick(ckpts, tmp_path):  # noqa: F811
    out = tmp_path / "two"
    args = [str(ckpts[0]), str(ckpts[1]), "--out", str(out), "--views", "degradation_sink", "--head", "0", *FAST]
    assert report.main(args) == 0
    side = read_csv_with_provenance(out / "figures" / "degradation_sink_H0__side.csv")[0]
    assert set(side["head"]) == {0} and side["run"].nunique() == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--views", "degradation_rank_collapse", "--layer", "1"], "none of the selected views has a layer picker"),
        (["--views", "degradation_sink", "--head", "-1"], "argument --head: must be in 0..16,777,216, got -1"),
    ],
)
def test_report_picks_that_cannot_apply_exit_2(ckpts, tmp_path, capsys, extra, message):  # noqa: F811
    try:
        code = report.main([str(ckpts[0]), "--out", str(tmp_path / "o"), *extra, *FAST])
    except SystemExit as exc:  # refused by the parser (a negative head)
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
