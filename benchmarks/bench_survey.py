"""A corpus survey's memory and speed: ``k3lab survey`` of the sample corpus on one thread, peak RSS and tokens/s.

    .venv/bin/python -m benchmarks.bench_survey                       # 2,000,000 tokens of k3-full (long)
    .venv/bin/python -m benchmarks.bench_survey --tokens 100000       # a shorter row, extrapolated

The survey runs in a fresh process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: interpreter, imports, model,
corpus and state included) on one torch thread. Target: peak RSS under 1.5 GB for 2 million tokens. The state is
bounded (its arrays do not grow with the tokens), so peak RSS at fewer tokens plus the corpus ids' extra bytes
(4 per token) bounds the full run's; the row says when it is such an extrapolation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_TOKENS = 2_000_000
RSS_LIMIT = 1.5e9

CHILD = """
import json, resource, sys, time, torch
from analysis.survey import engine as sv
from analysis.survey.plan import corpus_ids, make_plan, sample_corpus_text
from analysis.survey.state import state_size_bytes
from analysis.runs.loading import load_run
from analysis.runs.texts import text_tokenizer
run = load_run(sys.argv[1]); torch.set_num_threads(1)
ids = corpus_ids(sample_corpus_text("shakespeare"), text_tokenizer(run.config, run.tokenizer), int(sys.argv[2]))
plan = make_plan(ids, "shakespeare", run.fingerprint, sv.default_seq_len(run), batch_size=8)
start = time.perf_counter()
state = sv.run_survey(run, ids, plan, sys.argv[3], save_every=64)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(tokens=plan.tokens, seconds=seconds, peak_rss=peak, state_bytes=state_size_bytes(state))))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default=str(REPO / "sample_checkpoints" / "k3-full"))
    p.add_argument("--tokens", type=int, default=TARGET_TOKENS)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", CHILD, args.run, str(args.tokens), str(Path(tmp) / "s")],
                              cwd=REPO, capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    speed = row["tokens"] / row["seconds"]
    # whole sequences only: 2M requested surveys 1,999,872 (7,812 x 256); a shorter run is extrapolated: the state
    # is bounded, only the corpus ids (4 bytes a token) grow
    measured = args.tokens >= TARGET_TOKENS
    full_rss = row["peak_rss"] + (0 if measured else (TARGET_TOKENS - row["tokens"]) * 4)
    note = "" if measured else f" (extrapolated from {row['tokens']:,} tokens)"
    print(
        f"survey {Path(args.run).name}: {row['tokens']:,} tokens in {row['seconds']:.1f} s = {speed:,.0f} tokens/s "
        f"on 1 thread; peak RSS {row['peak_rss'] / 1e9:.3f} GB; state {row['state_bytes'] / 1e6:.2f} MB"
    )
    print(
        f"2M-token row{note}: peak RSS {full_rss / 1e9:.3f} GB (limit {RSS_LIMIT / 1e9:.1f} GB: "
        f"{'PASS' if full_rss < RSS_LIMIT else 'FAIL'}), {TARGET_TOKENS / speed / 3600:.2f} h at {speed:,.0f} tokens/s"
    )
    return 0 if full_rss < RSS_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
