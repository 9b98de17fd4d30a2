"""Trace folders under the server's job budget (issue 36): a text's trace is estimated from its file's zip directory
before anything is inflated and admitted like a model job (``app.render.caching``); one over the running share is
refused with a message, nothing inflated; on a real server, two sessions reading two large texts of one folder at once
stay within ``--job-memory``; and a linked trace file refuses its own text only, with one message."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
from streamlit.testing.v1 import AppTest

from analysis.runs.loading import load_run, recorded_bytes
from app.library import home as library_home
from app.server import job_budget
from app.server.job_budget import JobBudget
from benchmarks.bench_app import free_port, served_group
from k3lab.app import app_command, app_parser
from tests.app.server.test_job_budget import (
    ALLOWANCE,
    MB,
    QUEUED,
    _alerts,
    _answered,
    _rss,
    _RssPeak,
    _visit,
    _wait_idle,
)
from tests.app.serving import serve_only
from tests.k3core.interp.test_trace_hostile import _members_of, _reseal, _stored, _zip, add_big_member, two_text_trace

REPO = Path(__file__).resolve().parents[3]
APP = REPO / "app" / "main.py"


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    return two_text_trace(tmp_path_factory.mktemp("budget-trace"))


@pytest.fixture
def folder(traced, tmp_path) -> Path:
    out = tmp_path / "tr"
    shutil.copytree(traced, out)
    return out


def _grow(folder: Path, index: int, nbytes: int) -> int:
    """trace-<index>.npz with one more array of ``nbytes`` random bytes, stored (every check passes: a large genuine
    trace); the card resealed. Returns the bytes the file declares."""
    npz = folder / f"trace-{index}.npz"
    with np.load(npz, allow_pickle=False) as data:
        header = json.loads(data["__header__"].tobytes())
    header["axes"]["extra"] = ["x"]
    members = [m for m in _members_of(npz) if m[0] != "__header__.npy"]
    members += [_stored("__header__.npy", np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)),
                _stored("a/extra.npy", np.frombuffer(os.urandom(nbytes), dtype=np.uint8))]  # fmt: skip
    npz.write_bytes(_zip(members))
    _reseal(folder, index)
    return sum(m[3] for m in members)


@pytest.fixture
def app_env(monkeypatch, tmp_path, folder):
    serve_only(monkeypatch, tmp_path, str(folder), str(folder))
    library_home._library.clear()
    yield folder
    library_home._library.clear()
    job_budget.reset()


def _overview(text_index: int) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.session_state["k3lab_text_index"] = text_index
    return at.run()


def _errors(at: AppTest) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]  # the page escapes Markdown


def test_a_text_over_the_running_share_is_refused_before_it_is_inflated(app_env):
    declared = add_big_member(app_env, 0, "extra", 1024**3)  # 1 GiB declared, every check passes
    budget = job_budget.reset(256 * MB)
    proc = psutil.Process()
    base = proc.memory_info().rss
    at = _overview(0)
    assert not at.exception, [e.value for e in at.exception]
    shown = _errors(at)
    assert len(shown) == 1 and "Reading the trace of text 0 (12 tokens) needs about" in shown[0], shown
    assert "more than this server runs jobs in (192.0 MiB" in shown[0] and "--max-tokens" in shown[0], shown
    assert proc.memory_info().rss - base < 200 * MB and declared > 1024**3
    assert budget.peak_admitted_bytes == 0
    at = _overview(1)  # the other text reads, admitted for what its file declares
    assert not at.exception and _errors(at) == [], _errors(at)
    assert len(at.get("plotly_chart")) > 0
    assert budget.peak_admitted_bytes == recorded_bytes(load_run(app_env), 1) > 0


def test_a_linked_trace_file_refuses_its_own_text_once_and_the_others_draw(app_env, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(app_env / "trace-1.npz", outside / "secret.npz")
    (app_env / "trace-1.npz").unlink()
    (app_env / "trace-1.npz").symlink_to(outside / "secret.npz")
    at = _overview(0)
    assert not at.exception and _errors(at) == [], _errors(at)
    assert len(at.get("plotly_chart")) > 0
    at = _overview(1)
    assert not at.exception
    assert _errors(at) == [
        "**tr**: trace-1.npz: is a symbolic link; a trace folder's trace files must be the files themselves (copy "
        "the file into the folder)"
    ]


def test_two_sessions_reading_two_large_texts_stay_within_the_job_memory(folder, tmp_path):
    """A real server (``k3lab app --job-memory``) on a trace folder of two texts of about 96 MiB each (every check
    passed), a budget whose running share reads one at a time and whose kept share keeps neither: two sessions open
    one text each at once. The server's resident size never grows past the budget + ALLOWANCE over its size after a
    first visit of a small page, and one of the two reads waited for memory (its page said so)."""
    pytest.importorskip("websockets.sync.client", reason="websocket sessions need the websockets package")
    sizes = [_grow(folder, i, 96 * MB) for i in (0, 1)]
    total = int(1.6 * max(sizes))
    budget = JobBudget(total)
    assert max(sizes) <= budget.jobs_bytes < sum(sizes) and budget.kept.capacity < min(sizes)
    port = free_port()
    args = app_parser().parse_args(["--headless", "--port", str(port), "--home", str(tmp_path / "home"),
                                    "--job-memory", str(total), "--root", str(folder), str(folder)])  # fmt: skip
    cmd, env = app_command(args)
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / ".config"), PYTHONPATH=str(REPO),
               STREAMLIT_SERVER_FILE_WATCHER_TYPE="none", OMP_NUM_THREADS="1")  # fmt: skip
    with served_group(cmd, env, tmp_path / "server.log", port, 120) as proc:
        assert _answered(_visit(port, "upload")) == []  # the baseline: the app imported, a page drawn
        _wait_idle(proc)
        base = _rss(proc)
        results: dict[int, list] = {}

        def visit(i: int) -> None:
            results[i] = _visit(port, "", f"text_index={i}")

        threads = [threading.Thread(target=visit, args=(i,)) for i in (0, 1)]
        with _RssPeak(proc) as sampled:
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            _wait_idle(proc)
        end = _rss(proc)
    grew = sampled.peak - base
    print(f"\ntwo sessions, two texts of {sizes[0] / MB:.0f} MiB: budget {total / MB:.0f} MiB; peak +{grew / MB:.0f} "
          f"MiB, idle +{(end - base) / MB:.0f} MiB")  # fmt: skip
    assert sorted(results) == [0, 1]
    for i in (0, 1):
        assert _answered(results[i]) == [], _answered(results[i])
    assert sum(any(QUEUED in m for m in _alerts(results[i], "INFO")) for i in (0, 1)) == 1
    assert grew <= total + ALLOWANCE, (grew / MB, total / MB)
    assert end - base <= budget.kept.capacity + ALLOWANCE, ((end - base) / MB, budget.kept.capacity / MB)
