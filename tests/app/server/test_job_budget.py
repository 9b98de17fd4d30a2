"""app.server.job_budget, app.server.kept_results and analysis.runs.job_memory (issue 28): long jobs are admitted while
their estimated peaks fit the server's running share of its budget, queue or are refused with a message otherwise; what
they leave behind is kept under the rest of it, by bytes; and a real server with six sessions, two of them starting
long jobs, stays within its budget while every page answers."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
from streamlit.testing.v1 import AppTest

from analysis.runs import job_memory, texts
from analysis.runs.loading import load_run, trace_run
from app.library import home as library_home
from app.library import run_list
from app.render.caching import trace_items
from app.server import job_budget
from app.server.job_budget import KEPT_SHARE, JobBudget, JobRefused
from app.server.settings import HOME_ENV, JOB_MEMORY_ENV, ROOTS_ENV, job_memory_bytes, machine_memory_bytes
from app.state.inputs import MAX_ATTN_LEN
from benchmarks.bench_app import free_port, served_group
from k3core.interp.recorder import record
from k3lab.app import app_command, app_parser

REPO = Path(__file__).resolve().parents[3]
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


def test_the_budget_is_split_between_running_jobs_and_kept_results():
    budget = JobBudget(100 * MB)
    assert budget.kept.capacity == int(100 * MB * KEPT_SHARE) and budget.jobs_bytes == 100 * MB - budget.kept.capacity


def test_a_job_over_the_running_share_is_refused_at_once():
    budget = JobBudget(100 * MB)  # 75 MiB for running jobs, 25 MiB for kept results
    start = time.perf_counter()
    told = r"needs about .* more than this server runs jobs in \(75.0 MiB of its 100.0 MiB job memory, the rest keeps"
    for need in (200 * MB, 80 * MB):  # over the whole budget; over the running share only
        with pytest.raises(JobRefused, match=told + r" finished results; `k3lab app --job-memory SIZE` sets it\)"):
            with budget.admit(need, "The experiment"):
                pass
    assert time.perf_counter() - start < 0.1 and budget.admitted_bytes == 0


def test_jobs_queue_while_the_sum_would_not_fit_and_never_exceed_it():
    budget = JobBudget(120 * MB, wait_s=30)  # 90 MiB for running jobs
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
    assert budget.admitted_bytes == 60 * MB
    assert "waits for memory: 1 job(s) running use 60.0 MiB of the 90.0 MiB this server runs jobs in" in told[0]
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", "second in"] and budget.peak_admitted_bytes == 60 * MB
    small = [budget.admit(30 * MB, "a"), budget.admit(60 * MB, "b")]  # 90 MiB fit side by side
    for job in small:
        job.__enter__()
    assert budget.admitted_bytes == 90 * MB
    for job in small:
        job.__exit__(None, None, None)


def test_a_queued_job_is_refused_after_its_wait():
    budget = JobBudget(100 * MB, wait_s=0.2)
    with budget.admit(60 * MB, "running"):
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


@pytest.mark.parametrize("tokens", [16, 64, 2048])
def test_a_trace_estimate_covers_the_result_it_leaves(tokens):
    """What a trace keeps (the hidden states' Gram sums per position bin are a fixed 6.6 MB at 64 tokens on k3-full)
    is part of its estimated peak, at any length: the job's admission covers its result until it is kept."""
    run = load_run(SAMPLE)
    ctx = trace_run(run, texts.sample_input("shakespeare", run.config, tokens, run.tokenizer),
                    what=list(trace_items(True)), max_attn_len=MAX_ATTN_LEN)  # fmt: skip
    kept = job_memory.context_bytes(ctx)
    assert ctx.input_ids.shape[1] == tokens and kept <= job_memory.trace_peak_bytes(run.config, tokens, MAX_ATTN_LEN)


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
        at.switch_page(f"page_scripts/{page}.py")
    return at


def test_a_trace_over_the_budget_is_a_message_on_the_page(server_env):
    job_budget.reset(32 * MB)
    at = _session("overview", 1000)  # nothing kept: reset made a fresh budget and its kept results
    at.run()
    assert not at.exception
    shown = [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]  # the page escapes Markdown
    assert any("1,000 tokens needs about" in e and "more than this server runs jobs in (24.0 MiB of its 32.0 MiB" in e
               for e in shown), shown  # fmt: skip


def test_a_cost_estimate_is_a_range_that_grows_past_the_measured_length():
    from app.render.caching import forward_seconds_range

    assert forward_seconds_range((1000.0, 2048), 1024) == (1.024, 1.024)  # inside the measured length: linear
    low, high = forward_seconds_range((1000.0, 512), 8192)  # 16x the measured length: up to 16x the linear time
    assert (low, high) == (8.192, 8.192 * 16)


# ----------------------------------------------------------------------------------------- a real server
ALLOWANCE = 32 * MB  # see test_six_sessions_on_a_real_server_stay_within_its_budget
LONG = 2048  # the longest text a page traces without asking first (app.state.inputs.LONG_INPUT_TOKENS)
QUEUED = "waits for memory"


@contextmanager
def _real_server(tmp_path: Path, budget: int):
    """The app as ``k3lab app --job-memory BUDGET`` starts it (``app.server.serve`` with its command line and
    environment) on a free port with a fresh library home; yields (port, its process); stops it after."""
    port = free_port()
    home, samples = str(tmp_path / "home"), str(REPO / "sample_checkpoints")
    args = app_parser().parse_args(
        ["--headless", "--port", str(port), "--home", home, "--job-memory", str(budget), "--root", samples]
    )
    cmd, env = app_command(args)
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / ".config"), PYTHONPATH=str(REPO),
               STREAMLIT_BROWSER_GATHER_USAGE_STATS="false", STREAMLIT_SERVER_FILE_WATCHER_TYPE="none",
               OMP_NUM_THREADS=env.get("K3LAB_TEST_THREADS", "1"))  # fmt: skip
    env.pop(run_list.RUNS_ENV, None)  # the shipped samples, k3-full first
    with served_group(cmd, env, tmp_path / "server.log", port, 120) as proc:
        yield port, proc


def _visit(port: int, page: str, query: str = "") -> list:
    """One browser tab's visit at the websocket level: open a session, ask for ``page`` (its URL path; "" is the
    Overview) with ``query``, and read the server's messages until the script run finished; its ForwardMsgs."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from websockets.sync.client import connect

    messages = []
    with connect(f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=["streamlit"], max_size=None,
                 open_timeout=60) as ws:  # fmt: skip
        back = BackMsg()
        back.rerun_script.page_name, back.rerun_script.query_string = page, query
        ws.send(back.SerializeToString())
        while not (messages and messages[-1].HasField("script_finished")):
            msg = ForwardMsg()
            msg.ParseFromString(ws.recv(timeout=180))
            messages.append(msg)
    return messages


def _alerts(messages: list, kind: str) -> list[str]:
    """Every alert of this format ("INFO", "ERROR") the page drew, also those replaced later (a queue notice)."""
    from streamlit.proto.Alert_pb2 import Alert

    fmt = Alert.Format.Value(kind)
    return [m.delta.new_element.alert.body for m in messages if m.HasField("delta") and
            m.delta.new_element.WhichOneof("type") == "alert" and m.delta.new_element.alert.format == fmt]  # fmt: skip


def _answered(messages: list) -> list[str]:
    """What is wrong with a page as drawn (empty: it answered): its script run's end, exceptions, errors."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from streamlit.testing.v1.element_tree import parse_tree_from_messages

    tree = parse_tree_from_messages(messages)
    wrong = [f"exception: {e.value}" for e in tree.exception] + [f"error: {e.value}" for e in tree.error]
    if messages[-1].script_finished != ForwardMsg.FINISHED_SUCCESSFULLY:
        wrong.append(f"script run ended with {messages[-1].script_finished}")
    if not tree.title:
        wrong.append("no page title")
    return wrong


def _rss(proc: subprocess.Popen) -> int:
    return psutil.Process(proc.pid).memory_info().rss


def _wait_idle(proc: subprocess.Popen, timeout: float = 120.0) -> float:
    """Wait until the server has finished its background work (the figures it builds after a page): none of its
    threads runnable and its CPU time still for 1 s (a starved server has runnable threads); the seconds waited."""
    server, start, still = psutil.Process(proc.pid), time.monotonic(), 0
    last = sum(server.cpu_times()[:2])
    while still < 10:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"the server did not settle in {timeout:.0f} s")
        time.sleep(0.1)  # a poll interval: the condition is the server's state
        now = sum(server.cpu_times()[:2])
        runnable = any(_thread_state(proc.pid, t.id) == "R" for t in server.threads())
        still = still + 1 if now - last < 0.005 and not runnable else 0
        last = now
    return time.monotonic() - start


def _thread_state(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0]
    except OSError:  # the thread ended
        return "X"


class _RssPeak:
    """The server's highest resident size while the block runs (sampled every 5 ms)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.peak, self._stop = proc, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.proc))
            self._stop.wait(0.005)

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_six_sessions_on_a_real_server_stay_within_its_budget(tmp_path):
    """A real server (``k3lab app --job-memory``) on the samples, with a budget whose kept share holds one 2,048-token
    trace and not two, and whose running share runs one such trace at a time. Six sessions at once: two trace
    2,048 / 2,047 tokens of the Overview's text, four browse (the runs library, the weights, the history, an Overview
    of 64 tokens). Then:

    (a) the server's resident size, sampled, never grows past the budget + ALLOWANCE over what it was before the
        sessions, and once its background work is done it has grown by at most the kept share + ALLOWANCE (one trace
        kept, the other evicted and given back);
    (b) every page answers (its script run ends, no exception, no error box), the browsing ones while the traces run;
    (c) of the two long jobs, one waited for memory and its page said so.

    The baseline is the server's size after one visit of each of these pages at 64 tokens (python, streamlit and torch
    imported, the app's modules loaded, the model loaded: its 6 MB of weights are outside the budget) and its
    background work after them. ALLOWANCE is what the sessions leave that is not a kept result: Streamlit keeps each
    session's state for 2 minutes after its tab closes, and heap pages freed after the last trim (9-10 MB beyond the
    kept results, read from the server's own counters after two 1,536-token traces). Measured here: peak +254 to
    +273 MiB, +78 to +83 MiB once idle. With the byte bound disabled (both traces kept) the server ends +159 to
    +162 MiB, and without ``app.server.process_memory.limit_heap_retention`` +114 and +133 MiB (the first within
    2 MiB of the limit, the second past it): this test fails."""
    pytest.importorskip("websockets.sync.client", reason="websocket sessions need the websockets package")
    run = load_run(SAMPLE)
    traced = trace_run(run, texts.sample_input("shakespeare", run.config, LONG, run.tokenizer),
                       what=list(trace_items(True)), max_attn_len=MAX_ATTN_LEN)  # fmt: skip
    one_kept = job_memory.context_bytes(traced)  # what one long session leaves (its figures add a few MB)
    one_job = job_memory.trace_peak_bytes(run.config, LONG, MAX_ATTN_LEN)
    del traced
    total = int(1.2 * one_kept / KEPT_SHARE)
    budget = JobBudget(total)
    assert one_kept <= budget.kept.capacity < 2 * one_kept  # one long trace is kept, not two
    assert one_job <= budget.jobs_bytes < 2 * job_memory.trace_peak_bytes(run.config, LONG - 1, MAX_ATTN_LEN)

    with _real_server(tmp_path, total) as (port, proc):
        for page in ("", "upload", "weights", "history"):  # the baseline: every page imported and drawn once
            assert _answered(_visit(port, page, "tokens=64")) == [], page
        _wait_idle(proc)
        base = _rss(proc)
        sessions = [("", f"tokens={LONG}"), ("", f"tokens={LONG - 1}"), ("upload", ""), ("weights", "tokens=64"),
                    ("history", "tokens=64"), ("", "tokens=64")]  # fmt: skip
        results: dict[int, tuple[float, list]] = {}

        def visit(i: int, page: str, query: str) -> None:
            start = time.perf_counter()
            messages = _visit(port, page, query)
            results[i] = (time.perf_counter() - start, messages)

        threads = [threading.Thread(target=visit, args=(i, *s)) for i, s in enumerate(sessions)]
        with _RssPeak(proc) as sampled:
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            settled = _wait_idle(proc)
        end = _rss(proc)

    grew, kept_grew = sampled.peak - base, end - base
    seconds = [round(results[i][0], 1) for i in sorted(results)]
    print(f"\nsix sessions on a real server: budget {total / MB:.0f} MiB ({budget.jobs_bytes / MB:.0f} running, "
          f"{budget.kept.capacity / MB:.0f} kept; one long trace keeps {one_kept / MB:.1f} MiB), baseline "
          f"{base / MB:.0f} MiB; peak +{grew / MB:.0f} MiB, after the background work ({settled:.1f} s) "
          f"+{kept_grew / MB:.0f} MiB; page seconds {seconds}")  # fmt: skip
    assert sorted(results) == list(range(6))
    for i, (_, messages) in results.items():
        assert _answered(messages) == [], (sessions[i], _answered(messages))
    assert max(results[i][0] for i in (2, 3, 4, 5)) < 60, seconds  # browsing answered while the traces ran
    queued = [i for i in (0, 1) if any(QUEUED in m for m in _alerts(results[i][1], "INFO"))]
    assert len(queued) == 1, [_alerts(results[i][1], "INFO") for i in (0, 1)]
    assert grew <= total + ALLOWANCE, (grew / MB, total / MB)
    assert kept_grew <= budget.kept.capacity + ALLOWANCE, (kept_grew / MB, budget.kept.capacity / MB)
