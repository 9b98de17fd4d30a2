"""The papers' figures that run a model (analysis.experiments.paper_runs) on fixtures with known answers: an oracle
recall model (MQAR accuracy 1 within its reach, then falling), and a real AttnRes model whose depth mix has one
source at weight 0 (removing it changes nothing, exactly)."""

from __future__ import annotations

import numpy as np
import torch

from analysis.experiments.paper_runs import attnres_source_effects, mqar_by_length
from k3core.data.mqar import mqar_chance
from k3core.interp.edit_kinds import AttnResEdit
from k3core.interp.interventions import intervene
from tests.conftest import nano_model, random_ids


class RecallOracle(torch.nn.Module):
    """Predicts, at a key token, the value that followed the same key within the last ``reach`` tokens (else the
    filler): MQAR accuracy 1 when every pair is within reach."""

    def __init__(self, reach: int, vocab: int = 256):
        super().__init__()
        self.reach, self.config = reach, type("C", (), {"vocab_size": vocab})()
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b in range(B):
            seen: dict[int, tuple[int, int]] = {}
            for t in range(T):
                tok = int(ids[b, t])
                if tok in seen and t - seen[tok][0] <= self.reach:
                    logits[b, t, seen[tok][1]] = 1.0
                if t + 1 < T and tok >= 128 and tok not in seen:
                    seen[tok] = (t, int(ids[b, t + 1]))
        return logits


def test_mqar_accuracy_is_one_within_reach_and_falls_beyond():
    table = mqar_by_length(RecallOracle(reach=300), lengths=(256, 2048), examples=4, pairs=16)
    short, long = table.set_index("length").loc[256], table.set_index("length").loc[2048]
    assert short["accuracy"] == 1.0 and short["queries"] == 64 and short["ci_high"] == 1.0
    assert 0.9 < short["ci_low"] < 1.0  # Wilson: 64 of 64 is not certainty
    assert long["accuracy"] < 0.5 and long["ci_low"] <= long["accuracy"] <= long["ci_high"]
    assert table["chance"].eq(mqar_chance(256)).all()


def test_a_zero_weight_source_has_zero_effect():
    model = nano_model(residual="block_attnres")
    ids = random_ids(48, B=2)
    site, silenced = "2.mlp", 0  # the embedding source of a later site, held at weight 0 for the whole forward
    with intervene(model, [AttnResEdit(site=site, mode="mask", sources=[silenced])]):
        table = attnres_source_effects(model, ids, sites=[site, "output"])
    rows = table[table["site"] == site].set_index("source")
    assert rows.loc[silenced, "weight"] == 0.0 and rows.loc[silenced, "effect"] == 0.0
    assert (rows.drop(silenced)["weight"] > 0).all()
    assert (rows.drop(silenced)["effect"].abs() > 0).any()
    out = table[table["site"] == "output"]
    np.testing.assert_allclose(out["weight"].sum(), 1.0, rtol=1e-5)  # a site's mean weights sum to 1
    assert np.isfinite(table["noise"]).all()


def test_paper_views_build_on_a_model_and_say_when_they_cannot():
    from analysis.figures import papers
    from analysis.runs.loading import run_from_model, trace_run
    from analysis.views.catalogue import all_views
    from analysis.views.view import NotApplicable

    keys = {v.key for v in all_views()}
    assert {"long_mqar_length", "attnres_causal_sources", "degradation_sink_rate"} <= keys
    model = nano_model(residual="block_attnres")
    ctx = trace_run(run_from_model(model), random_ids(40, B=1), what="default", label="nano")
    ctx.options.update(mqar_lengths=(64, 128), mqar_examples=2)
    fig, df = papers.build_mqar_by_length(ctx)
    assert list(df["length"]) == [64, 128] and "arXiv 2510.26692" in fig.layout.title.text
    fig, df = papers.VIEWS[0].build(ctx)
    assert set(df["site"]) >= {"output"} and "arXiv 2606.13168" in fig.layout.title.text
    plain = trace_run(run_from_model(nano_model(residual="plain")), random_ids(40, B=1), what="default", label="p")
    try:
        papers.VIEWS[0].build(plain)
        raise AssertionError("a plain-residual model has no AttnRes site")
    except NotApplicable as exc:
        assert "AttnRes" in str(exc)


class Stopped(Exception):
    """Streamlit's Stop, as the app's progress bar raises it."""


def test_model_runs_report_progress_and_a_stopped_run_keeps_nothing():
    from analysis.figures import papers
    from analysis.runs.loading import run_from_model, trace_run

    model = nano_model(residual="block_attnres")
    ctx = trace_run(run_from_model(model), random_ids(24, B=1), what="default", label="nano")
    ctx.options.update(mqar_lengths=(64, 128, 256), mqar_examples=2)
    seen: list[tuple[int, int]] = []

    def stop_at_two(done: int, total: int) -> None:
        seen.append((done, total))
        if done == 2:
            raise Stopped

    def note(done: int, total: int) -> None:
        seen.append((done, total))

    for key, run in papers.MODEL_RUNS.items():
        try:
            run.table(ctx, stop_at_two)
            raise AssertionError(f"{key}: the stop did not end the run")
        except Stopped:
            pass
        assert not run.measured(ctx), key  # nothing kept: the next press runs it again
        seen.clear()
        table = run.table(ctx, note)
        assert run.measured(ctx) and len(table) > 0, key
        total = seen[-1][1]
        assert seen == [(n, total) for n in range(1, total + 1)], (key, seen)
        assert "forward passes" in run.cost(ctx)
    attnres = papers.MODEL_RUNS["attnres_causal_sources"]
    at_most = int(attnres.cost(ctx).split("at most ")[1].split()[0].replace(",", ""))
    assert 1 + len(attnres.table(ctx, None)) <= at_most  # the cost stated first bounds the forwards run
