"""Every page of the app in a real browser, two rounds: the first visit and the second (nothing changed, one user).

    .venv/bin/python -m benchmarks.bench_pages            # this checkout; prints one line per page and visit
    .venv/bin/python -m benchmarks.bench_pages --rounds 3 --against runner.postScriptGC=true
                                                          # median of 3 second visits, served as k3lab serves it and
                                                          # with a Streamlit option changed, side by side

The app is started as ``benchmarks.bench_app`` starts it (fresh HOME, free port, the shipped samples), opened cold
(seconds to the first drawn chart), then each sidebar page is clicked in turn, twice over. A visit's time is wall
clock from the click to the page's heading shown, its script run over and every chart on it drawn
(``bench_app.settle``). Targets (issue 27): first chart within 5 s of a cold open, every second visit within 0.5 s.
Pages that raise show Streamlit's exception box: counted and printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from app import page_registry
from benchmarks.bench_app import CHART, CHROMIUM, CHROMIUM_ARGS, EXCEPTION, REPO, app_server, settle

#: every page, in sidebar order (app.page_registry), the default page last (it is served at "/")
PAGES = (*page_registry.PAGES[1:], page_registry.DEFAULT)
COLD_TARGET_S, AGAIN_TARGET_S = 5.0, 0.5


def visit(page, entry: page_registry.Page, timeout_ms: int = 180_000) -> float:
    """Click a page's sidebar link; seconds until its heading is shown and the page is settled (charts drawn, run
    over)."""
    start = time.perf_counter()
    page.get_by_role("link", name=entry.title, exact=True).first.click()
    if entry != page_registry.DEFAULT:  # the default page is served at "/"
        page.wait_for_url(f"**/{entry.url_path}*", timeout=timeout_ms)
    page.get_by_role("heading", name=entry.title).first.wait_for(timeout=timeout_ms)
    settle(page, timeout_ms)
    return time.perf_counter() - start


def walk(url: str, pw, shots: Path | None = None, rounds: int = 1) -> dict[str, float]:
    """Cold open, a first visit to every page, then ``rounds`` rounds of second visits (each page's median kept)."""
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    try:
        context = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = context.new_page()
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_selector(CHART, timeout=180_000)
        times = {"cold open to first chart": time.perf_counter() - start}
        settle(page)
        again: dict[str, list[float]] = {}
        for visit_name in ("first", *["again"] * rounds):
            for entry in PAGES:
                link, path = entry.title, entry.url_path
                seconds = visit(page, entry)
                print(f"{link} ({visit_name}) {seconds:.2f} s", file=sys.stderr, flush=True)
                if visit_name == "first":
                    times[f"{link} (first)"] = seconds
                else:
                    again.setdefault(link, []).append(seconds)
                errors = page.locator(EXCEPTION).count()
                if errors:
                    times[f"{link} ({visit_name}) EXCEPTIONS"] = float(errors)
                if shots is not None and visit_name == "again":
                    page.screenshot(path=str(shots / f"{path}.png"), full_page=True)
        times.update({f"{link} (again)": statistics.median(seconds) for link, seconds in again.items()})
        return times
    finally:
        browser.close()


def _option(text: str) -> dict[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected a Streamlit option as KEY=VALUE, got {text!r}")
    return {key: value}


def _target(name: str) -> float | None:
    return COLD_TARGET_S if name.startswith("cold") else AGAIN_TARGET_S if "(again)" in name else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/k3lab-bench-pages"))
    parser.add_argument("--screenshots", type=Path, help="save a full-page screenshot of each page's second visit")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of second visits; each page's median is shown")
    parser.add_argument(
        "--against",
        type=_option,
        metavar="KEY=VALUE",
        help="also walk a server with this Streamlit option (e.g. runner.postScriptGC=true) and print both side by "
        "side with their ratio; the targets are checked on the app as served",
    )
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    walks: dict[str, dict[str, float]] = {}
    with sync_playwright() as pw:
        for label, options in [("served", None)] + ([("against", args.against)] if args.against else []):
            with app_server(REPO, args.workdir / label, {}, options=options) as (url, _log):
                walks[label] = walk(url, pw, args.screenshots if label == "served" else None, args.rounds)
    times = walks["served"]
    failed = 0
    if args.against:
        (key, value), other = next(iter(args.against.items())), walks["against"]
        print(f"{'':40s} {'served':>9s} {key + '=' + value:>28s}  ratio")
    for name, seconds in times.items():
        target = _target(name)
        ok = "" if target is None else ("  ok" if seconds <= target else f"  OVER {target} s")
        failed += bool(ok.strip().startswith("OVER")) or "EXCEPTIONS" in name
        versus = ""
        if args.against and name in other:
            versus = f" {other[name]:26.2f} s  {seconds / other[name]:5.2f}"
        print(f"{name:40s} {seconds:7.2f} s{versus}{ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
