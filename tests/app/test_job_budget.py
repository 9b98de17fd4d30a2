"""app.server.job_budget and analysis.runs.job_memory (issue 28): long jobs are admitted while their estimated peaks fit
the server's budget, queue or are refused with a message otherwise, and browsing keeps answering while they run."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from streamlit.testing.v1 import AppTest

from analysis.runs import job_memory
from analysis.runs.loading import load_run
from app.library import home as library_home
from app.library import run_list
from app.server import job_budget
from app.server.job_budget import JobBudget, JobRefused
from app.server.settings import HOME_ENV, JOB_MEMORY_ENV, ROOTS_ENV, job_memory_bytes, machine_memory_bytes
from app.state.inputs import MAX_ATTN_LEN
from k3core.interp.recorder import record
from k3lab.app import app_command, app_parser

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_checkpoints" / "k3-full"
APP = REPO / "app" / "main.py"
MB = 1024**2


def test_the_budget_comes_from_job_memory_or_half_the_machine(tmp_path):
    assert job_memory_bytes({JOB_MEMORY_ENV: "6GB"}) == 6 * 10**9
    assert job_memory_bytes({}) == int(machine_memory_bytes() * 0.5) > 0
    assert job_memory_bytes({JOB_MEMORY_ENV: "lots"}) == job_memory_bytes({})
    _, env = app_command(app_parser().parse_args(["--job-memory", "512MiB"]), {})
    assert env[JOB_MEMORY_ENV] == "512MiB"
    with pytest.raises(SystemExit):
        app_parser().parse_args(["--job-memory", "much"])


def test_a_job_over_the_whole_budget_is_refused_at_once():
    budget = JobBudget(100 * MB)
    start = time.perf_counter()
    with pytest.raises(JobRefused, match=r"needs about 200.0 MiB .* budget for jobs \(100.0 MiB; `k3lab app --job-me"):
        with budget.admit(200 * MB, "The experiment"):
            pass
    assert time.perf_counter() - start < 0.1 and budget.admitted_bytes == 0


def test_jobs_queue_while_the_sum_would_not_fit_and_never_exceed_it():
    budget = JobBudget(100 * MB, wait_s=30)
    first_in, release, order, told = threading.Event(), threading.Event(), [], []

    def first():
        with budget.admit(60 * MB, "first"):
            order.append("first in")
            first_in.set()
            release.wait(10)
            order.append("first out")

    def second():
        first_in.wait(10)
        with budget.admit(60 * MB, "second", told.append):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    while not told:  # the second is queued (told why), not running
        time.sleep(0.01)
    assert budget.admitted_bytes == 60 * MB and "waits for memory: 1 job(s) running use 60.0 MiB" in told[0]
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", "second in"] and budget.peak_admitted_bytes == 60 * MB
    small = [budget.admit(40 * MB, "a"), budget.admit(60 * MB, "b")]  # 100 MB fit side by side
    for job in small:
        job.__enter__()
    assert budget.admitted_bytes == 100 * MB
    for job in small:
        job.__exit__(None, None, None)


def test_a_queued_job_is_refused_after_its_wait():
    budget = JobBudget(100 * MB, wait_s=0.2)
    with budget.admit(80 * MB, "running"):
        with pytest.raises(JobRefused, match="waited 0 s: try again later"):
            with budget.admit(50 * MB, "queued"):
                pass


def _rss_peak(fn) -> int:
    proc = psutil.Process()
    base, peak, stop = proc.memory_info().rss, [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
    return peak[0] - base


def test_the_estimates_cover_a_measured_forward_and_trace():
    run = load_run(SAMPLE)
    ids = torch.randint(0, run.config.vocab_size, (1, 2048))

    def forward():
        with torch.no_grad():
            run.model(ids)

    def traced():
        with torch.no_grad(), record(run.model, what="all", max_attn_len=1024):
            run.model(ids)

    forward()  # allocator warm-up
    measured = {"forward": _rss_peak(forward), "trace": _rss_peak(traced)}
    estimated = {"forward": job_memory.forward_peak_bytes(run.config, 2048),
                 "trace": job_memory.trace_peak_bytes(run.config, 2048, 1024)}  # fmt: skip
    for what in measured:
        assert measured[what] <= estimated[what], (what, measured[what] / MB, estimated[what] / MB)
    assert estimated["forward"] < 4 * max(measured["forward"], 32 * MB)  # conservative, not absurd


# ----------------------------------------------------------------------------------------- the server
@pytest.fixture
def server_env(monkeypatch, tmp_path):
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(ROOTS_ENV, str(REPO / "sample_checkpoints"))
    monkeypatch.setenv(run_list.RUNS_ENV, str(SAMPLE))
    library_home._library.clear()
    yield
    library_home._library.clear()
    job_budget.reset()


def _session(page: str, max_tokens: int) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.session_state["k3lab_max_tokens"] = max_tokens
    if page != "overview":
        at.switch_page(f"app_pages/{page}.py")
    return at


def test_six_sessions_two_long_jobs_stay_in_a_small_budget_and_every_page_answers(server_env):
    """Two sessions trace 1,536-token texts under a budget that holds one such trace; four others browse (the
    runs library, the weights, the history, an overview of 64 tokens). The traces run one after the other, the
    admitted estimates never pass the budget, and every session's page answers without an error."""
    config = load_run(SAMPLE).config
    one = job_memory.trace_peak_bytes(config, 1536, MAX_ATTN_LEN)  # what the page asks for (attention recorded)
    budget = job_budget.reset(int(one * 1.5), wait_s=120)
    sessions = [("overview", 1536), ("overview", 1535), ("runs_library", 64), ("weights", 64), ("history", 64),
                ("overview", 64)]  # fmt: skip
    results: dict[int, tuple[float, AppTest]] = {}
    _session("overview", 64).run()  # the model loaded once (cached for every session), as on a running server

    def serve(i: int, page: str, tokens: int) -> None:
        at = _session(page, tokens)
        start = time.perf_counter()
        at.run()
        results[i] = (time.perf_counter() - start, at)

    threads = [threading.Thread(target=serve, args=(i, p, n)) for i, (p, n) in enumerate(sessions)]

    def run_all():
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)

    grew = _rss_peak(run_all)
    print(
        f"six sessions: RSS +{grew / MB:.0f} MB, budget {budget.total_bytes / MB:.0f} MB, peak admitted "
        f"{budget.peak_admitted_bytes / MB:.0f} MB, seconds {[round(results[i][0], 1) for i in sorted(results)]}"
    )
    assert sorted(results) == list(range(6))
    for i, (_, at) in results.items():
        assert not at.exception, (sessions[i], at.exception)
        assert [e.value for e in at.error] == [], (sessions[i], [e.value for e in at.error])
    assert budget.peak_admitted_bytes <= budget.total_bytes
    assert budget.peak_admitted_bytes >= one  # the long traces went through the budget
    browsing = [results[i][0] for i in (2, 3, 4)]
    assert max(browsing) < 60, browsing  # answered while the traces ran (a page, not the jobs' wait)


def test_a_trace_over_the_budget_is_a_message_on_the_page(server_env):
    job_budget.reset(32 * MB)
    at = _session("overview", 1000)  # a text no other test traced (the trace cache is the process's)
    at.run()
    assert not at.exception
    shown = [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]  # the page escapes Markdown
    assert any("1,000 tokens needs about" in e and "more than this server's budget for jobs" in e for e in shown), shown


def test_a_cost_estimate_is_a_range_that_grows_past_the_measured_length():
    from app.render.caching import forward_seconds_range

    assert forward_seconds_range((1000.0, 2048), 1024) == (1.024, 1.024)  # inside the measured length: linear
    low, high = forward_seconds_range((1000.0, 512), 8192)  # 16x the measured length: up to 16x the linear time
    assert (low, high) == (8.192, 8.192 * 16)
