"""Record what the shipped samples draw, one per config, as digests: tests/data/figure_baseline.json.

    .venv/bin/python -m scripts.record_figure_baseline            # write tests/data/figure_baseline.json
    .venv/bin/python -m scripts.record_figure_baseline --check    # compare with it, print every difference

For each sample (sample_checkpoints/*, less the second seeds ``<config>-s<seed>``: their code paths are their first
seed's) on the same input (the Shakespeare sample text, TOKENS tokens, CPU float32):
the sha256 of every trace array (keyed by its trace name) and of the figure JSON and table CSV of every view the
report draws from a trace or the weights (views that rerun the model: the importance ablations, the experiments and
the long-context runs are left out, they are covered by their own tests); for k3-full also the sha256 of every file
``k3lab report`` writes (``analysis.output.report.write_report``, static images off; report.html with its date and
timings blanked). tests/analysis/output/test_figure_baseline.py recomputes the digests and names every view, report
file and trace array that differs. A deliberate change of figures (or a rename of trace items: only keys, never
values) is recorded again with this script.

Why fingerprints and not one sha256 of the bytes: float32 results differ in their last bits between CPUs (torch's
kernels take other SIMD paths on AVX2 than on AVX-512), so a byte digest recorded on one machine failed on the next
one with the same code. Each item is therefore split into its *skeleton* (the text with every number and every
plotly base64 array replaced by ``#``, or an array's dtype and shape), digested exactly, and its numbers, of which
only a fingerprint is kept: the count, the L1 norm and three fixed +-1 projections (``fingerprint``). Two items
match when the skeletons are equal and every fingerprint sum agrees within ``RTOL`` (1e-4) of the L1 norm: a change
of any text, label, layout, shape or count is caught exactly, a change of values once it moves them by more than
1e-4 of their L1 norm (float32 rounding between CPUs moves them by about 1e-7); integer and boolean arrays (MoE
selections and loads) must be equal exactly.
"""

from __future__ import annotations

import argparse
import base64
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


#: a fingerprint sum may move by this share of the numbers' L1 norm (float32 rounding between CPUs is ~1e-6)
RTOL = 1e-4
PROJECTIONS = 3
# a number as JSON, CSV and HTML write it, standing alone (not part of a word, a name such as blocks.3.kda or a
# colour such as #1e5dcc); and plotly's typed arrays {"dtype": "f8", "bdata": "<base64>"}
NUMBER = re.compile(rb"(?<![\w#.])-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
TYPED_ARRAY = re.compile(rb'"dtype":"(\w+)","bdata":"([^"]*)"')


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(skeleton: bytes, numbers, exact: bool = False) -> dict:
    """{"skeleton": sha256, "n": count, "l1": sum |x|, "proj": [sum w_k x], "nonfinite": sha256 of where x is not
    finite or over 1e100, and those values} of float64 numbers x, with w_k = +-1 drawn from a fixed seed per k.
    ``exact``: integers, whose values are digested as they are (``"values"``)."""
    import numpy as np

    x = np.asarray(numbers, dtype=np.float64).ravel()
    out: dict = {"skeleton": _sha(skeleton), "n": int(x.size)}
    if exact:
        out["values"] = _sha(x.tobytes())
        return out
    # inf, nan and numbers too large to sum (constants in the plotly.js that report.html carries): digested exactly
    finite = np.abs(x) < 1e100
    out["nonfinite"] = _sha(np.packbits(~finite).tobytes() + x[~finite].tobytes())
    x = np.where(finite, x, 0.0)
    out["l1"] = float(np.abs(x).sum())
    out["proj"] = [float(np.random.default_rng(k).choice([-1.0, 1.0], x.size) @ x) for k in range(PROJECTIONS)]
    return out


def text_fingerprint(data: bytes) -> dict:
    """The fingerprint of a text file or figure JSON: plotly's base64 arrays decoded, then every number in the text."""
    import numpy as np

    parts = []

    def typed(match: re.Match) -> bytes:
        raw = base64.b64decode(match.group(2).replace(rb"\u002f", b"/").replace(rb"\u002b", b"+"))
        parts.append(np.frombuffer(raw, dtype=np.dtype(match.group(1).decode())).astype(np.float64))
        return b'"dtype":"' + match.group(1) + b'","bdata":#'

    text = TYPED_ARRAY.sub(typed, data)
    parts.append(np.array([float(m) for m in NUMBER.findall(text)], dtype=np.float64))
    return fingerprint(NUMBER.sub(b"#", text), np.concatenate(parts) if parts else [])


def same(a, b) -> bool:
    """Two fingerprints (or "n/a: reason" strings) describe the same item: equal skeletons, counts and exact parts,
    and every sum within RTOL of the L1 norm."""
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    if {k: v for k, v in a.items() if k not in ("l1", "proj")} != {
        k: v for k, v in b.items() if k not in ("l1", "proj")
    }:
        return False
    if "l1" not in a:
        return True
    tol = RTOL * max(a["l1"], b["l1"]) + 1e-30
    return abs(a["l1"] - b["l1"]) <= tol and all(abs(p - q) <= tol for p, q in zip(a["proj"], b["proj"], strict=True))


def sample_names() -> list[str]:
    """The shipped samples the baseline covers: every config once (a second seed ``k3-full-s1`` is left out)."""
    from scripts.check_samples import shipped_samples

    return shipped_samples(SAMPLES, one_per_config=True)


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
        exact = arr.dtype.kind in "biu"
        trace[key] = fingerprint(f"{arr.dtype.str}{arr.shape}".encode(), arr, exact=exact)
    views = {}
    for view in all_views():
        if view.needs_model:
            continue
        try:
            fig, df = view.build(ctx)
        except NotApplicable as exc:
            views[view.key] = f"n/a: {exc}"
            continue
        views[view.key] = text_fingerprint(fig.to_json().encode() + b"\0" + df.to_csv(index=False).encode())
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
            p.relative_to(out).as_posix(): text_fingerprint(
                VOLATILE.sub(b"", p.read_bytes()).replace(str(REPO).encode(), b"REPO")
            )
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
            if not same(a, b):
                out.append(f"{name}: view {key}: {'missing' if b is None else 'new' if a is None else 'differs'}")
        gone = [k for k in want["trace"] if k not in got["trace"]]
        for key in sorted(set(want["trace"]) | set(got["trace"])):
            a, b = want["trace"].get(key), got["trace"].get(key)
            if a is not None and b is not None and same(a, b):
                continue
            was = next((k for k in gone if same(want["trace"][k], b)), None) if a is None else None
            if was is not None:
                out.append(f"{name}: trace array {was} renamed to {key} (same values)")
            elif b is None and any(same(a, v) for k, v in got["trace"].items() if k not in want["trace"]):
                continue  # the other end of a rename, reported above
            else:
                what = "missing" if b is None else "new" if a is None else "differs"
                out.append(f"{name}: trace array {key}: {what}")
    if "report" in actual:
        want, got = expected.get("report", {}), actual["report"]
        for key in sorted(set(want) | set(got)):
            if not same(want.get(key), got.get(key)):
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
