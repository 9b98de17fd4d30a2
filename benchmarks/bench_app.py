"""The app in a real browser, timed: cold open to the first chart, and page switches on a loaded run.

    .venv/bin/python -m benchmarks.bench_app                           # this checkout
    .venv/bin/python -m benchmarks.bench_app --before /tmp/k3lab-before  # and an older checkout, side by side

Each app (``streamlit run app/main.py`` of that checkout, on a free port, with a fresh HOME) is started,
waited on through its health URL, then opened in a fresh Chromium context (the system Chromium at
/usr/bin/chromium). Times are wall-clock seconds from the action to the condition:

- cold open: ``page.goto`` -> the first drawn plotly chart (model load, tokens, trace and figure included;
  the server process is up, nothing is cached);
- page switch (first visit): a sidebar link click -> the page's heading, its charts, and the script run
  finished, on the run the Overview loaded (model and trace cached, this page's figures not);
- page switch (again): back to each page already drawn (everything cached);
- where Degradation draws its first figures and the rest on request (app.render.page_scaffold.render_section): the
  toggle click -> the other figures drawn, and a switch back to the page with all of them shown.

With ``--before`` both apps run one after the other in one process, on the same sample, and the table
gives after / before. The test suite uses the same driver (tests/app/test_browser.py) and prints its times.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from app import page_registry
from app.server.settings import STREAMLIT_OPTIONS

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CHART = '[data-testid="stPlotlyChart"] .js-plotly-plot'  # a drawn plotly figure, not the loading skeleton
EXCEPTION = '[data-testid="stException"]'
RENDER_TIMEOUT_MS = 180_000
SWITCH_PAGES = tuple(page_registry.page(name) for name in ("attnres", "degradation", "moe"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll the health endpoint until it answers 'ok', the server dies, or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200 and resp.read().strip() == b"ok":
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # poll interval, not a synchronisation sleep
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def served_group(cmd: list[str], env: dict[str, str], log: Path, port: int, timeout: float, cwd: Path = REPO):
    """Run a server command in its own process group (``k3lab app`` runs streamlit as a child: both must stop), wait
    until its health endpoint answers; yields the process; stops the whole group after (SIGTERM, then SIGKILL)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, log, timeout)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@contextmanager
def app_server(
    repo: Path,
    workdir: Path,
    env_extra: dict[str, str],
    timeout: float = 120,
    preload: bool = True,
    options: dict[str, str] | None = None,
):
    """The app of ``repo`` on a free port; yields (base url, log path); stops it after.

    ``preload``: start it with ``python -m app.server.serve`` (libraries imported before the server listens, as
    ``k3lab app`` does) where the checkout has it; else ``streamlit run app/main.py``. ``options``: Streamlit
    options over those ``k3lab app`` serves with (this checkout's app.server.settings.STREAMLIT_OPTIONS, for an older
    checkout too); ``{"runner.postScriptGC": "true"}`` serves Streamlit's default."""
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        STREAMLIT_BROWSER_GATHER_USAGE_STATS="false",
        OMP_NUM_THREADS=env.get("K3LAB_TEST_THREADS", "1"),
        PYTHONPATH=str(repo),
    )
    env.update(env_extra)
    log = workdir / f"streamlit-{port}.log"
    # app/server/serve.py since the subsystem layout, app/serve.py in older checkouts (--before)
    serve = next((m for m in ("app.server.serve", "app.serve") if (repo / f"{m.replace('.', '/')}.py").is_file()), None)
    start = (
        [sys.executable, "-m", serve]
        if preload and serve
        else [sys.executable, "-m", "streamlit", "run", "app/main.py"]
    )
    served = {key: str(value).lower() for key, value in STREAMLIT_OPTIONS.items()}
    cmd = [
        *start,
        "--server.headless", "true",
        "--server.port", str(port),
        "--server.address", "127.0.0.1",
        "--server.fileWatcherType", "none",
        "--browser.gatherUsageStats", "false",
        *(arg for key, value in {**served, **(options or {})}.items() for arg in (f"--{key}", value)),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, log, timeout)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


# The page is done: the script run is over (Streamlit's own state attribute and its running widget),
# no element of the previous run is left (stale), and every chart box holds a drawn plotly figure.
DONE_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  const state = app && app.getAttribute('data-test-script-state');
  if (!app || state === 'running' || state === 'rerunRequested') return false;
  if (document.querySelector('[data-testid="stStatusWidget"]')) return false;
  if (document.querySelector('[data-stale="true"]')) return false;
  const boxes = document.querySelectorAll('[data-testid="stPlotlyChart"]').length;
  const drawn = document.querySelectorAll('[data-testid="stPlotlyChart"] .js-plotly-plot').length;
  return boxes === drawn;
}"""


def settle(page, timeout_ms: int = RENDER_TIMEOUT_MS) -> None:
    """Wait until the script run is over and the page is fully drawn (DONE_JS)."""
    page.wait_for_function(DONE_JS, timeout=timeout_ms)


def open_page(browser, url: str, timeout_ms: int = RENDER_TIMEOUT_MS):
    """A fresh browser context (no cookies, no session) at ``url``; returns (page, seconds to the first chart)."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    start = time.perf_counter()
    page.goto(url)
    page.wait_for_selector(CHART, timeout=timeout_ms)
    seconds = time.perf_counter() - start
    settle(page, timeout_ms)
    return page, seconds


def switch_page(page, entry: page_registry.Page, timeout_ms: int = RENDER_TIMEOUT_MS) -> float:
    """Click a registered page's sidebar link (``app.page_registry``); seconds until its heading is shown, its script
    run is over and every chart on it is drawn (DONE_JS)."""
    start = time.perf_counter()
    page.get_by_role("link", name=entry.title, exact=True).click()
    page.wait_for_url(f"**/{entry.url_path}*", timeout=timeout_ms)
    page.get_by_role("heading", name=entry.title).first.wait_for(timeout=timeout_ms)
    page.wait_for_selector(CHART, timeout=timeout_ms)
    settle(page, timeout_ms)
    return time.perf_counter() - start


def show_the_rest(page, timeout_ms: int = RENDER_TIMEOUT_MS) -> float | None:
    """On a page that draws its first figures and the rest on request (app.render.page_scaffold.render_section), turn
    the rest on; seconds until they are drawn. None where the page has no such toggle (it draws everything at once)."""
    toggle = page.get_by_text(re.compile(r"^Show the other \d+ figures$"))
    if toggle.count() == 0:
        return None
    before = page.locator(CHART).count()
    start = time.perf_counter()
    toggle.first.click()
    page.wait_for_function(
        f"() => document.querySelectorAll('{CHART}').length > {before}", timeout=timeout_ms, polling="raf"
    )
    settle(page, timeout_ms)
    return time.perf_counter() - start


def measure(url: str, pw) -> dict[str, float | None]:
    """Cold open, first-visit switches to SWITCH_PAGES, then to each of them again (cached), then Degradation's
    other figures on request and Degradation again with all of them shown, in seconds (None: not offered)."""
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    try:
        page, cold = open_page(browser, url)
        times = {"cold open to first chart": cold}
        for visit in ("first visit", "again"):
            for entry in SWITCH_PAGES:
                times[f"switch to {entry.title} ({visit})"] = switch_page(page, entry)
        # Degradation's other figures, on request, then the page again with all of them shown
        entry = SWITCH_PAGES[1]
        switch_page(page, entry)
        times[f"{entry.title}: the other figures, on request"] = shown = show_the_rest(page)
        switch_page(page, SWITCH_PAGES[0])
        times[f"switch to {entry.title} (again, all shown)"] = switch_page(page, entry) if shown else None
        return times
    finally:
        browser.close()


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout of k3lab to time side by side (e.g. a worktree)")
    parser.add_argument(
        "--run", type=Path, default=REPO / "sample_checkpoints" / "k3-full", help="checkpoint folder to open"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/k3lab-bench-app"))
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds (a fresh server and browser each, the apps in turn); each time is the median, with its range",
    )
    parser.add_argument(
        "--streamlit-run",
        action="store_true",
        help="also time this checkout served by `streamlit run app/main.py` (by default only `python -m "
        "app.server.serve`, "
        "as `k3lab app` serves it; --before is served the same way where it has app/server/serve.py)",
    )
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    apps = [("before", args.before.resolve(), True)] if args.before else []
    if args.streamlit_run:
        apps.append(("after, streamlit run", REPO, False))
    apps.append(("after, app.server.serve", REPO, True))
    results: dict[str, dict[str, list[float]]] = {}
    env = {"K3LAB_RUNS": str(args.run.resolve())}
    with sync_playwright() as pw:
        for round_ in range(args.repeat):  # alternating order, so slow phases of a shared machine hit every app alike
            for name, repo, preload in apps if round_ % 2 == 0 else apps[::-1]:
                folder = args.workdir / name.replace(" ", "").replace(",", "-")
                with app_server(repo, folder, env, preload=preload) as (url, _log):
                    times = measure(url, pw)
                kept = results.setdefault(name, {})
                for key, seconds in times.items():
                    kept.setdefault(key, [])
                    if seconds is not None:
                        kept[key].append(seconds)
    load = os.getloadavg()[0]
    print(
        f"app timings, {args.run.name}, wall seconds, median of {args.repeat} (min-max) "
        f"(load average {load:.1f} on {os.cpu_count()} cores)"
    )
    print(f"  {'':44s}" + "".join(f"{name:>26s}" for name in results) + ("   ratio to before" if args.before else ""))
    for key in results["after, app.server.serve"]:
        row = [results[name].get(key) or [] for name in results]
        medians = [statistics.median(v) if v else None for v in row]
        ratios = "   " + " ".join(_ratio(v, medians[0]) for v in medians[1:]) if args.before else ""
        cells = "".join(f"{_median_range(v):>26s}" for v in row)
        print(f"  {key:44s}" + cells + ratios)
    return 0


def _median_range(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    if len(seconds) == 1:
        return f"{seconds[0]:.2f} s"
    return f"{statistics.median(seconds):.2f} s ({min(seconds):.2f}-{max(seconds):.2f})"


if __name__ == "__main__":
    sys.exit(main())
