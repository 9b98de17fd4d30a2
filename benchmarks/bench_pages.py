"""Every page of the app in a real browser: the first visit and the second (nothing changed, one user).

    .venv/bin/python -m benchmarks.bench_pages            # this checkout; prints one line per page and visit

The app is started as ``benchmarks.bench_app`` starts it (fresh HOME, free port, the shipped samples), opened cold
(seconds to the first drawn chart), then each sidebar page is clicked in turn: a first visit, then ``--rounds``
second visits (the median is shown), then each page that draws its first figures and the rest on request
(``app.render.page.draw_lazily``) with the rest shown, which gives the browser's cost of one more chart. A visit's
time is wall clock from the click to the page's heading shown, its script run over and every chart on it drawn
(``bench_app.settle``). Targets (issue 27): first chart within 5 s of a cold open, every second visit within 0.5 s.
Pages that raise show Streamlit's exception box: counted and printed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

from app import pages
from benchmarks.bench_app import CHART, CHROMIUM, CHROMIUM_ARGS, EXCEPTION, REPO, app_server, settle, show_the_rest

#: every page, in sidebar order (app.pages), the default page last (it is served at "/")
PAGES = (*pages.PAGES[1:], pages.DEFAULT)
COLD_TARGET_S, AGAIN_TARGET_S = 5.0, 0.5


def visit(page, entry: pages.Page, timeout_ms: int = 180_000) -> float:
    """Click a page's sidebar link; seconds until its heading is shown and the page is settled (charts drawn, run
    over)."""
    start = time.perf_counter()
    page.get_by_role("link", name=entry.title, exact=True).first.click()
    if entry != pages.DEFAULT:  # the default page is served at "/"
        page.wait_for_url(f"**/{entry.url_path}*", timeout=timeout_ms)
    page.get_by_role("heading", name=entry.title).first.wait_for(timeout=timeout_ms)
    settle(page, timeout_ms)
    return time.perf_counter() - start


def walk(url: str, pw, shots: Path | None = None, rounds: int = 1) -> dict[str, float]:
    """Cold open, a first visit to every page, then ``rounds`` second visits to each (the median is kept: the
    machine is shared), then, on each page that draws its first figures and the rest on request, the rest turned on
    and the page visited again: the added seconds per added chart is the browser's cost of one chart."""
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    try:
        context = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = context.new_page()
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_selector(CHART, timeout=180_000)
        times = {"cold open to first chart": time.perf_counter() - start}
        settle(page)
        charts: dict[str, int] = {}
        again: dict[str, list[float]] = {entry.title: [] for entry in PAGES}
        for visit_name in ("first", *["again"] * rounds):
            for entry in PAGES:
                link, path = entry.title, entry.url_path
                seconds = visit(page, entry)
                charts[link] = page.locator(CHART).count()
                print(f"{link} ({visit_name}) {seconds:.2f} s, {charts[link]} charts", file=sys.stderr, flush=True)
                if visit_name == "first":
                    times[f"{link} (first)"] = seconds
                else:
                    again[link].append(seconds)
                errors = page.locator(EXCEPTION).count()
                if errors:
                    times[f"{link} ({visit_name}) EXCEPTIONS"] = float(errors)
                if shots is not None and visit_name == "again":
                    page.screenshot(path=str(shots / f"{path}.png"), full_page=True)
        for link, seconds in again.items():
            times[f"{link} (again, {charts[link]} charts)"] = statistics.median(seconds)
        for entry in PAGES:  # the per-chart cost: the same page with its other figures shown
            visit(page, entry)
            if show_the_rest(page) is None:
                continue
            elsewhere = PAGES[-1] if entry != PAGES[-1] else PAGES[0]
            shown = []
            for _ in range(rounds):
                visit(page, elsewhere)
                shown.append(visit(page, entry))
            more = page.locator(CHART).count()
            base = times[f"{entry.title} (again, {charts[entry.title]} charts)"]
            per_chart = (statistics.median(shown) - base) / max(more - charts[entry.title], 1)
            times[f"{entry.title} (all {more} charts shown) {1000 * per_chart:.0f} ms/chart"] = statistics.median(shown)
            # turn the rest off again, as a new user finds the page
            page.get_by_text(re.compile(r"^Show the other \d+ figures$")).first.click()
            settle(page)
        return times
    finally:
        browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/k3lab-bench-pages"))
    parser.add_argument("--screenshots", type=Path, help="save a full-page screenshot of each page's second visit")
    parser.add_argument("--rounds", type=int, default=1, help="second visits to each page; the median is shown")
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    with app_server(REPO, args.workdir, {}) as (url, _log), sync_playwright() as pw:
        times = walk(url, pw, args.screenshots, args.rounds)
    failed = 0
    for name, seconds in times.items():
        target = COLD_TARGET_S if name.startswith("cold") else AGAIN_TARGET_S if "(again" in name else None
        ok = "" if target is None else ("  ok" if seconds <= target else f"  OVER {target} s")
        failed += bool(ok.strip().startswith("OVER")) or "EXCEPTIONS" in name
        print(f"{name:40s} {seconds:7.2f} s{ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
