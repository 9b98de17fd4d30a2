"""KDA implicit attention on k3-full: what the per-position statistics and a query window's map cost.

    python -m benchmarks.bench_kda_attention              # T = 2,048 and 16,384
    python -m benchmarks.bench_kda_attention --lengths 2048

Each cell runs in its own subprocess on one thread (clean ``ru_maxrss``; ``growth`` is the peak minus the RSS after
loading and a 64-token warm-up), side by side: a plain forward, the forward inside ``record(what={"kda_attn"})``
(every KDA head's statistics over the whole text) and inside ``record(what={"attn_probs"})`` with a 1,024-query
window at the end of the text (the map, KDA's and MLA's). Printed: time and growth of each and the ratios to the
plain forward, and the bytes of one layer's KDA window map (window x window per head, whatever T).
Targets (issue 40): statistics' growth < 1.5x the plain forward's; the map window-sized.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_checkpoints" / "k3-full"
WINDOW = 1024


def _child(mode: str, T: int) -> dict:
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    from benchmarks.bench_long import _tokens
    from k3core.interp.recorder import record
    from k3core.interp.trace import names
    from k3core.modeling.model import K3ForCausalLM

    model = K3ForCausalLM.from_pretrained(str(SAMPLE)).eval()
    ids = _tokens(T, model.config.vocab_size)
    what = {"plain": None, "stats": {"kda_attn"}, "window": {"attn_probs"}}[mode]

    def forward(x):
        with torch.no_grad():
            if what is None:
                model(x)
                return None
            with record(model, what=what, attn_window=(max(0, x.shape[1] - WINDOW), x.shape[1])) as trace:
                model(x)
            return trace

    forward(ids[:, :64])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.process_time()
    trace = forward(ids)
    seconds = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"seconds": seconds, "growth": peak - base}
    if trace is not None and mode == "window":
        i = trace.layer_indices("kda")[0]
        out["map_bytes"] = int(trace[names.kda_attn(i)].nbytes)
        out["map_shape"] = list(trace[names.kda_attn(i)].shape)
    return out


def measure(mode: str, T: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.bench_kda_attention", "--child", mode, str(T)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]))))
        return
    print("| T | plain: s, growth MB | kda_attn stats: s (x plain), growth MB (x plain) | window 1,024: s, growth MB, "
          "KDA map of one layer |")  # fmt: skip
    print("|---|---|---|---|")
    for T in args.lengths:
        plain, stats, window = (measure(m, T) for m in ("plain", "stats", "window"))
        mb = 2**20
        print(
            f"| {T:,} | {plain['seconds']:.1f} s, {plain['growth'] / mb:.0f} MB | {stats['seconds']:.1f} s "
            f"({stats['seconds'] / plain['seconds']:.1f}x), {stats['growth'] / mb:.0f} MB "
            f"({stats['growth'] / plain['growth']:.2f}x) | {window['seconds']:.1f} s, {window['growth'] / mb:.0f} MB, "
            f"{window['map_shape']} = {window['map_bytes'] / mb:.1f} MB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
