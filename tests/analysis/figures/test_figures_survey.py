"""Survey views (analysis.figures.survey) drawn from a real survey of a sample checkpoint: each figure's table
holds the survey's numbers, the load map's marks carry (layer, expert) for the atlas card, Compare draws two."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.figures import survey as fs
from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
from analysis.survey import engine as sv
from analysis.survey.folder import read_survey
from analysis.survey.plan import corpus_ids, make_plan, sample_corpus_text
from analysis.views.view import NotApplicable

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"


@pytest.fixture(scope="module")
def surveys(tmp_path_factory):
    run = load_run(SAMPLE)
    tok = text_tokenizer(run.config, run.tokenizer)
    out = {}
    for name, text in (("a", sample_corpus_text("shakespeare-val")[:1500]), ("b", "1, 2, 3; (4) [5]! " * 60)):
        ids = corpus_ids(text, tok, 200)
        plan = make_plan(ids, name, run.fingerprint, 32, batch_size=2, top_contexts=3, reservoir=2)
        folder = tmp_path_factory.mktemp(name) / "s"
        sv.run_survey(run, ids, plan, folder)
        out[name] = read_survey(folder)
    return out


def test_every_survey_view_draws_its_numbers(surveys):
    survey = surveys["a"]
    ctx = fs.survey_context(survey)
    for view in fs.VIEWS:
        fig, df = view.build(ctx)
        assert len(fig.data) and len(df), view.key
    fig, df = fs.load_map(ctx)
    s = survey.state.sums
    for i in survey.layout.moe_layers:
        assert df[df.layer == i].tokens.tolist() == s[f"moe.{i}.load"].tolist()
    # Streamlit turns a click into a selection only with clickmode "select" and a dragmode other than select/lasso
    assert "select" in fig.layout.clickmode and fig.layout.dragmode not in ("select", "lasso")
    marks = fig.data[0].customdata
    assert {(int(a), int(b)) for a, b in marks[:, :2]} == {(i, e) for i in survey.layout.moe_layers for e in range(8)}
    layer, expert = int(marks[5, 0]), int(marks[5, 1])  # a selected mark opens that expert's card
    card, table = fs.atlas_card(ctx.with_options(layer=layer, expert=expert))
    assert f"Layer {layer} expert {expert}" in card.layout.title.text
    top = table[table.kind == "top"]
    assert sorted(top.position) == sorted(survey.state.tops[f"moe.{layer}.top_contexts"].id[expert].tolist())
    assert all("[" in c and "]" in c for c in card.data[0].cells.values[1])
    fig, cache = fs.cache_curves(ctx.with_options(budget_bytes=200_000))
    belady = cache[(cache.scope == "model") & (cache.policy == "belady")].hit_rate.to_numpy()
    lru = cache[(cache.scope == "model") & (cache.policy == "lru")].hit_rate.to_numpy()
    assert (belady >= lru - 1e-12).all() and np.all(np.diff(belady) >= 0)
    assert any(shape.line.dash == "dot" for shape in fig.layout.shapes)
    with pytest.raises(NotApplicable):
        fs.atlas_card(ctx.with_options(layer=0, expert=0))  # layer 0 is dense
    with pytest.raises(NotApplicable, match="no survey"):
        fs.load_map(ctx.with_options(survey=None))


def test_compare_two_surveys(surveys):
    fig, df = fs.compare_surveys(surveys["a"], surveys["b"], "prose", "digits")
    assert set(df.survey) == {"prose", "digits"} and len(fig.data) == 6
