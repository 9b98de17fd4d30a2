"""Survey state that cannot disagree with itself (analysis.survey.folder): a writer killed between state.npz and
survey.json continues to the state of an uninterrupted run; edited cards are refused naming the folder; one writer
per folder, and the lock of a killed writer does not block the next."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
from analysis.survey import engine as sv
from analysis.survey.folder import CARD_NAME, LOCK_NAME, STATE_NAME, read_survey, survey_lock
from analysis.survey.plan import SurveyError, corpus_ids, make_plan
from analysis.survey.tables import export_tables

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "sample_checkpoints" / "k3-full"
TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 2
SETUP = f"""
import sys
from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
from analysis.survey.plan import corpus_ids, make_plan
run = load_run({str(SAMPLE)!r})
ids = corpus_ids({TEXT!r}, text_tokenizer(run.config, run.tokenizer))
plan = make_plan(ids, "romeo", run.fingerprint, 24, batch_size=2, top_contexts=3, reservoir=2)
out = sys.argv[1]
"""


@pytest.fixture(scope="module")
def run():
    return load_run(SAMPLE)


@pytest.fixture(scope="module")
def corpus(run):
    ids = corpus_ids(TEXT, text_tokenizer(run.config, run.tokenizer))
    return ids, make_plan(ids, "romeo", run.fingerprint, 24, batch_size=2, top_contexts=3, reservoir=2)


@pytest.fixture(scope="module")
def whole(run, corpus, tmp_path_factory):
    ids, plan = corpus
    out = tmp_path_factory.mktemp("whole") / "s"
    sv.run_survey(run, ids, plan, out)
    return read_survey(out)


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip


def _assert_same_state(a, b):
    assert a.state.done == b.state.done
    for name, arr in b.state.sums.items():
        np.testing.assert_array_equal(a.state.sums[name], arr, err_msg=name)
    for name, top in b.state.tops.items():
        for part in ("score", "id", "payload"):
            np.testing.assert_array_equal(getattr(a.state.tops[name], part), getattr(top, part), err_msg=name)


def test_killed_between_state_and_card_continues_to_the_uninterrupted_state(run, corpus, whole, tmp_path):
    ids, plan = corpus
    assert plan.batches >= 3
    out = tmp_path / "s"
    # kill -9 of the writer right after its third state.npz replace, before the card that goes with it
    child = _python(
        SETUP
        + """
import os, signal
from analysis.survey import engine, folder
real, states = folder.atomic_write_bytes, []
def write(path, data):
    real(path, data)
    if path.name == folder.STATE_NAME:
        states.append(1)
        if len(states) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
folder.atomic_write_bytes = write
engine.run_survey(run, ids, plan, out, save_every=1)
""",
        str(out),
    )
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert json.loads((out / CARD_NAME).read_text())["done_batches"] == [0, 1]  # the card is one save behind
    with pytest.raises(SurveyError, match=f"{out}: survey.json does not describe this state.npz.*continue"):
        read_survey(out)  # a reader is told, not given two disagreeing files
    sv.run_survey(run, ids, plan, out)
    again = read_survey(out)
    assert again.complete and int(again.state.sums["sequences"][0]) == plan.sequences
    _assert_same_state(again, whole)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda card, plan: {**card, "done_batches": list(range(plan.batches)), "complete": True}, "was edited"),
        (lambda card, plan: {**card, "done_batches": [10**18, -1]}, "not one of the plan's"),
        (lambda card, plan: {**card, "done_batches": [0, 0]}, "a batch repeats"),
        (lambda card, plan: {**card, "complete": True}, "was edited"),
        (lambda card, plan: {**card, "done_batches": [0]}, "was edited"),
        (
            lambda card, plan: {**card, "done_batches": list(range(plan.batches)), "state_sha256": "0" * 64},
            "does not describe",
        ),
    ],
)
def test_an_edited_card_is_refused_naming_the_folder(run, corpus, tmp_path, edit, message):
    ids, plan = corpus
    out = tmp_path / "s"
    with pytest.raises(sv.SurveyStopped):
        sv.run_survey(run, ids, plan, out, progress=lambda done, total: done < 2, save_every=1)
    state_before = (out / STATE_NAME).read_bytes()
    card = json.loads((out / CARD_NAME).read_text())
    edited = json.dumps(edit(card, plan))
    (out / CARD_NAME).write_text(edited)
    for attempt in (lambda: read_survey(out), lambda: sv.run_survey(run, ids, plan, out)):
        start = time.perf_counter()
        with pytest.raises(SurveyError, match=message) as caught:
            attempt()
        assert time.perf_counter() - start < 2.0
        assert str(out) in str(caught.value)
    assert (out / CARD_NAME).read_text() == edited and (out / STATE_NAME).read_bytes() == state_before


def test_a_state_whose_counts_disagree_with_its_batches_is_refused(whole, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(whole.path, bad)
    with np.load(bad / STATE_NAME) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["done_batches"] = arrays["done_batches"][:-1]  # one batch fewer than the counts were made of
    np.savez(bad / STATE_NAME, **arrays)
    with pytest.raises(SurveyError, match=f"{bad}: state.npz counts .* sequences"):
        read_survey(bad)


def test_one_writer_per_folder_and_a_killed_writers_lock_does_not_block(run, corpus, whole, tmp_path, capsys):
    ids, plan = corpus
    out = tmp_path / "s"
    holder = _python(
        SETUP
        + """
from analysis.survey.folder import survey_lock
with survey_lock(out):
    print("held", flush=True)
    sys.stdin.readline()
""",
        str(out),
    )
    assert holder.stdout.readline().strip() == "held"
    assert (out / LOCK_NAME).read_text().strip() == str(holder.pid)
    from k3lab import survey as cli

    start = time.perf_counter()
    code = cli.main([str(SAMPLE), "--text", str(_text(tmp_path)), "--out", str(out), "--no-progress"])
    assert code == 2 and time.perf_counter() - start < 2.0
    err = capsys.readouterr().err
    assert f"{out}: another survey (pid {holder.pid}) is writing this folder" in err, err
    with pytest.raises(SurveyError, match="another survey"):
        sv.run_survey(run, ids, plan, out)
    holder.kill()  # kill -9: the file stays, the lock goes with the process
    holder.communicate(timeout=60)
    assert (out / LOCK_NAME).exists()
    sv.run_survey(run, ids, plan, out)
    _assert_same_state(read_survey(out), whole)
    with survey_lock(out), survey_lock(out):  # re-entrant within one process
        pass


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def test_a_refused_survey_leaves_no_folder_behind(tmp_path, capsys):
    from k3lab import survey as cli

    out = tmp_path / "new"
    assert cli.main([str(SAMPLE), "--text", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert not out.exists()


def test_export_refuses_a_folder_of_the_users_files(whole, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(SurveyError, match=f"{mine}: holds files that are not a survey export.s"):
        export_tables(whole, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    written = export_tables(whole, tmp_path / "export")
    assert export_tables(whole, tmp_path / "export") == written  # an earlier export is replaced
