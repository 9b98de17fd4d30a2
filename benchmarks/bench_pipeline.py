"""Pipeline-parallel trace overhead on CPU: the same model and texts traced by `k3lab trace --pipeline` under
torchrun with 1 process and with 2 (gloo), side by side, alternating, best of ``--rounds``.

    .venv/bin/python -m benchmarks.bench_pipeline       # k3-small (random init, vocab 256), 4 texts x 256 tokens
    .venv/bin/python -m benchmarks.bench_pipeline --preset k3-mini --tokens 128 --rounds 2

Timed: rank 0's wall clock from the moment every rank has loaded its layers (a barrier) until every trace part
is gathered on rank 0 (the run card's ``made.ranks[0].forward_and_gather_seconds``): forward, hand-offs and the
gather, not imports or loading. Printed: both times, their ratio (2 processes / 1), and the tensor bytes each rank
read against the checkpoint's total (each rank reads its own layers only). torchrun gives every rank one thread
(OMP_NUM_THREADS=1), so the single process runs on one core and the two ranks on two: with several texts the
stages overlap, and the hand-off and gather are the overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_once(ckpt: Path, texts: list[Path], tokens: int, nproc: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "k3lab", "trace", str(ckpt), "--pipeline", "--max-tokens", str(tokens), "--out", str(out)]  # fmt: skip
    for t in texts:
        cmd += ["--text", str(t)]
    # one thread per process in both (torchrun sets it only for several processes; threads hand-offs on a loaded
    # machine are slow and would favour the pipeline)
    env = {**os.environ, "K3LAB_BACKEND": "gloo", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    card = json.loads((out / "run_card.json").read_text())
    shutil.rmtree(out)
    return card["made"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--texts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from analysis.runs.texts import shakespeare_passage
    from k3core.loading.folder import CheckpointFiles
    from k3core.modeling.model import K3ForCausalLM
    from k3core.modeling.presets import from_preset

    with tempfile.TemporaryDirectory(prefix="k3lab-bench-pipeline-") as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        # byte-level (vocab 256), so the texts are read without a tokenizer file
        config = from_preset(args.preset, vocab_size=256)
        ckpt = K3ForCausalLM.from_config(config).save_pretrained(root / args.preset)
        passage = shakespeare_passage(8 * args.tokens * args.texts)
        texts = []
        for i in range(args.texts):
            texts.append(root / f"text{i}.txt")
            texts[-1].write_text(passage[i * 4 * args.tokens :])
        total = CheckpointFiles.open(ckpt).bytes_total
        best: dict[int, float] = {}
        read: dict[int, list[int]] = {}
        for r in range(args.rounds):
            for nproc in (1, 2) if r % 2 == 0 else (2, 1):
                made = run_once(ckpt, texts, args.tokens, nproc, root / "out")
                seconds = made["ranks"][0]["forward_and_gather_seconds"]
                best[nproc] = min(best.get(nproc, float("inf")), seconds)
                read[nproc] = [rk["bytes_read"] for rk in made["ranks"]]
                print(f"  round {r}: {nproc} process(es) {seconds:.3f} s", flush=True)
        print(f"\npipeline trace of {args.preset}, {args.texts} texts x {args.tokens} tokens, gloo on CPU, best of "
              f"{args.rounds} (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")  # fmt: skip
        print(f"  1 process : {best[1]:.3f} s   (read {read[1][0]:,} of {total:,} bytes)")
        print(f"  2 processes: {best[2]:.3f} s   (read {', '.join(f'{b:,}' for b in read[2])} bytes; "
              f"sum {sum(read[2]):,})")  # fmt: skip
        print(f"  ratio 2 processes / 1: {best[2] / best[1]:.2f}x")
        for rank, b in enumerate(read[2]):
            print(f"  rank {rank} read {b / total:.1%} of the checkpoint's tensor bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
