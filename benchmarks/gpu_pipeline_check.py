"""GPU check of the pipeline-parallel trace: NCCL with one GPU per process where the machine has the GPUs.

    python benchmarks/gpu_pipeline_check.py            # a minute; prints one line per run and PASS / FAIL

k3-nano with AttnRes blocks of 3 (blocks straddle the rank boundaries) is saved once, traced by one process on
the first device, and traced by `k3lab trace` under torchrun: with 2+ GPUs, min(GPUs, 3) NCCL ranks, one GPU each;
with one GPU (NCCL cannot put two ranks on one GPU) one NCCL rank (``--pipeline``) and then 2 gloo ranks on the
CPU, saying so; without CUDA, 2 gloo ranks. Every trace array is compared with the single-process trace on the
same kind of device (fp32; TF32 off): max |difference| and PASS within 1e-5 (GPU kernels may sum in another order).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from analysis.runs import loading as runs_mod  # noqa: E402
from analysis.runs import texts  # noqa: E402
from k3core.interp.trace_folder import read_trace_dir  # noqa: E402
from k3core.modeling.model import K3ForCausalLM  # noqa: E402
from k3core.modeling.presets import from_preset  # noqa: E402

TOLERANCE = 1e-5


def torchrun(ckpt: pathlib.Path, text: pathlib.Path, out: pathlib.Path, nproc: int, backend: str) -> str:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*launch, "-m", "k3lab", "trace", str(ckpt), "--text", str(text), "--out", str(out), "--pipeline"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "K3LAB_BACKEND": backend, "NVIDIA_TF32_OVERRIDE": "0"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"FAIL (exit {proc.returncode}): {proc.stderr[-1500:]}"
    return ""


def compare(out: pathlib.Path, want) -> tuple[float, bool]:
    got = read_trace_dir(out).trace(0)
    worst = 0.0
    for name, array in want.arrays.items():
        if array.dtype.kind == "f" and array.size:
            worst = max(worst, float(np.abs(got[name].astype(np.float64) - array).max()))
    same = sorted(got.arrays) == sorted(want.arrays)
    return worst, same and worst <= TOLERANCE


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="k3lab-gpu-pipeline-") as tmp:
        root = pathlib.Path(tmp)
        torch.manual_seed(0)
        ckpt = K3ForCausalLM.from_config(from_preset("k3-nano", attn_res_block_size=3)).save_pretrained(root / "nano")
        text = root / "text.txt"
        text.write_text("ROMEO:\nBut soft, what light through yonder window breaks? It is the east.")
        runs_plan = []
        if gpus >= 2:
            runs_plan.append((min(gpus, 3), "nccl", "cuda"))
        else:
            why = "no CUDA" if gpus == 0 else "one GPU: NCCL puts each rank on its own GPU"
            print(f"pipeline: {why}; NCCL with one GPU per process needs 2+ GPUs", flush=True)
            if gpus == 1:
                runs_plan.append((1, "nccl", "cuda"))
            runs_plan.append((2, "gloo", "cpu"))
        for nproc, backend, device in runs_plan:
            run = runs_mod.load_run(ckpt, device=device)
            chosen = texts.text_input(text.read_text(), run.config, 256, name=text.name)
            want = runs_mod.trace_run(run, chosen, what="all").trace
            out = root / f"out-{backend}-{nproc}"
            problem = torchrun(ckpt, text, out, nproc, backend)
            if problem:
                print(f"pipeline {backend} x{nproc}: {problem}", flush=True)
                failed = True
                continue
            worst, ok = compare(out, want)
            failed |= not ok
            print(f"pipeline {backend} x{nproc} on {device}: max |trace - single process| {worst:.2e} "
                  f"{'PASS' if ok else 'FAIL'} (<= {TOLERANCE:g})", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
