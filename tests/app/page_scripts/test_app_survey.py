"""The Survey page under Streamlit's AppTest: the cost is shown before anything runs; a survey folder of the same
plan is drawn (load map, atlas card, cache curves ...) with no error; the app's survey job runs, stops and continues."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
from analysis.survey.folder import is_survey_dir, read_survey
from analysis.survey.plan import corpus_ids, make_plan, sample_corpus_text
from app.library import run_list
from app.server import survey_jobs
from app.server.settings import HOME_ENV
from tests.app.apptest_helpers import APP, REPO

SAMPLE = REPO / "sample_checkpoints" / "k3-full"


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "k3lab-home"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(SAMPLE))
    empty = tmp_path / "no-samples"
    empty.mkdir()
    monkeypatch.setattr(run_list, "SAMPLES_DIR", empty)
    return tmp_path / "k3lab-home"


def _page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=240)
    at.run()
    return at.switch_page("page_scripts/survey.py").run()


def test_cost_first_then_results_of_a_saved_survey(home):
    at = _page()
    assert not at.exception and not at.error
    cost = [m.value for m in at.markdown if m.value.startswith("**Cost:**")]
    assert cost and "tokens" in cost[0] and "about" in cost[0]
    assert any(i.label == "Corpus tokens" for i in at.number_input)
    assert not at.get("plotly_chart")  # nothing has run yet
    run = load_run(SAMPLE)
    ids = corpus_ids(sample_corpus_text("shakespeare"), text_tokenizer(run.config, None), 50_000)
    plan = make_plan(ids, "shakespeare", run.fingerprint, 256, 8)
    folder = survey_jobs.surveys_dir() / f"k3-full-shakespeare-{plan.tokens}-256"
    job = survey_jobs.start(run, ids, plan, folder, save_every=1)
    while not is_survey_dir(folder):  # the first batch saved (the job keeps running)
        job.thread.join(0.2)
    job.stop.set()
    job.thread.join()
    assert job.finished and not job.error and 0 < len(read_survey(folder).state.done) < plan.batches
    at = _page()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(at.get("plotly_chart")) >= 6
    assert any("survey of k3-full on shakespeare" in c.value for c in at.caption)
