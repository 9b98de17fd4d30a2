"""Record what the five shipped samples draw, as digests: tests/data/figure_baseline.json.

    .venv/bin/python -m scripts.record_figure_baseline            # write tests/data/figure_baseline.json
    .venv/bin/python -m scripts.record_figure_baseline --check    # compare with it, print every difference

For each sample (sample_checkpoints/*) on the same input (the Shakespeare sample text, TOKENS tokens, CPU float32):
the sha256 of every trace array (keyed by its trace name) and of the figure JSON and table CSV of every view the
report draws from a trace or the weights (views that rerun the model: the importance ablations, the experiments and
the long-context runs are left out, they are covered by their own tests); for k3-full also the sha256 of every file
``k3lab report`` writes (``analysis.output.report.write_report``, static images off; report.html with its date and
timings blanked). tests/analysis/output/test_figure_baseline.py recomputes the digests and names every view, report
file and trace array that differs. A deliberate change of figures (or a rename of trace items: only keys, never
values) is recorded again with this script.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_checkpoints"
BASELINE = REPO / "tests" / "data" / "figure_baseline.json"
TOKENS = 64
FULL = "k3-full"  # the sample whose report is digested too
# what the report says about when it was made, how long it took and the run's fingerprint (a cache key over file
# sizes and mtimes: it differs between two checkouts of the same files), not what it drew: blanked before the digest
VOLATILE = re.compile(rb"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d|timings \(s\):[^<]*|fingerprint\W+[0-9a-f]{16,64}")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sample_names() -> list[str]:
    return sorted(p.name for p in SAMPLES.iterdir() if (p / "config.json").is_file())


def sample_digests(name: str) -> dict[str, dict[str, str]]:
    """{"trace": {array name: sha256}, "views": {view key: sha256 of figure JSON + table CSV, or "n/a: reason"}}."""
    import numpy as np
    import torch

    from analysis.runs import loading, texts
    from analysis.views.catalogue import all_views
    from analysis.views.view import NotApplicable

    torch.manual_seed(0)
    run = loading.load_run(SAMPLES / name, "cpu", "float32")
    inp = texts.sample_input("shakespeare", run.config, TOKENS, run.tokenizer)
    ctx = loading.trace_run(run, inp, label=name)
    trace = {}
    for key in sorted(ctx.trace.arrays):
        arr = np.ascontiguousarray(ctx.trace[key])
        trace[key] = _sha(f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes())
    views = {}
    for view in all_views():
        if view.needs_model:
            continue
        try:
            fig, df = view.build(ctx)
        except NotApplicable as exc:
            views[view.key] = f"n/a: {exc}"
            continue
        views[view.key] = _sha(fig.to_json().encode() + b"\0" + df.to_csv(index=False).encode())
    return {"trace": trace, "views": views}


def report_digests() -> dict[str, str]:
    """{file of k3-full's report folder: sha256} (static images off: no Chromium needed; ``VOLATILE`` blanked, and
    the checkout's folder, which headline.json names in the run's path, written as REPO)."""
    from analysis.output.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        write_report(
            [SAMPLES / FULL], out, sample="shakespeare", max_tokens=TOKENS, static=False, skip_model_views=True
        )
        return {
            p.relative_to(out).as_posix(): _sha(VOLATILE.sub(b"", p.read_bytes()).replace(str(REPO).encode(), b"REPO"))
            for p in sorted(out.rglob("*"))
            if p.is_file()
        }


def compute(samples: list[str] | None = None, report: bool = True) -> dict:
    """The baseline document: settings, then per sample its digests, then k3-full's report files."""
    from analysis.runs.loading import load_run  # noqa: F401 - the packages import before any timing

    names = samples or sample_names()
    doc: dict = {"tokens": TOKENS, "text": "shakespeare", "device": "cpu", "dtype": "float32", "samples": {}}
    for name in names:
        doc["samples"][name] = sample_digests(name)
    if report:
        doc["report"] = report_digests()
    return doc


def differences(expected: dict, actual: dict) -> list[str]:
    """Every difference, one line each: the sample and the view, trace array or report file. A trace array whose
    digest moved to another name is reported as a rename (keys only)."""
    out = []
    for name, got in actual.get("samples", {}).items():
        want = expected.get("samples", {}).get(name)
        if want is None:
            out.append(f"{name}: not in the baseline")
            continue
        for key in sorted(set(want["views"]) | set(got["views"])):
            a, b = want["views"].get(key), got["views"].get(key)
            if a != b:
                out.append(f"{name}: view {key}: {'missing' if b is None else 'new' if a is None else 'differs'}")
        by_digest = {v: k for k, v in want["trace"].items()}
        for key in sorted(set(want["trace"]) | set(got["trace"])):
            a, b = want["trace"].get(key), got["trace"].get(key)
            if a == b:
                continue
            if a is None and b in by_digest and by_digest[b] not in got["trace"]:
                out.append(f"{name}: trace array {by_digest[b]} renamed to {key} (same values)")
            elif b is None and a in set(got["trace"].values()):
                continue  # the other end of a rename, reported above
            else:
                what = "missing" if b is None else "new" if a is None else "differs"
                out.append(f"{name}: trace array {key}: {what}")
    if "report" in actual:
        want, got = expected.get("report", {}), actual["report"]
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                what = "missing" if key not in got else "new" if key not in want else "differs"
                out.append(f"{FULL} report: {key}: {what}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the recorded baseline instead")
    args = parser.parse_args(argv)
    doc = compute()
    if args.check:
        diffs = differences(json.loads(BASELINE.read_text(encoding="utf-8")), doc)
        print("\n".join(diffs) or "identical")
        return 1 if diffs else 0
    BASELINE.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    json.dump(doc, buf, indent=1, sort_keys=True)
    BASELINE.write_text(buf.getvalue() + "\n", encoding="utf-8")
    n_views = sum(len(s["views"]) for s in doc["samples"].values())
    print(f"wrote {BASELINE.relative_to(REPO)}: {len(doc['samples'])} samples, {n_views} views", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
