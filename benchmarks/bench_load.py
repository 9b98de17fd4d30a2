"""Checkpoint loading: k3lab's streaming ``from_pretrained`` vs transformers' own, on the same files.

    .venv/bin/python -m benchmarks.bench_load                     # ~1.1B params, bf16 shards under /tmp
    .venv/bin/python -m benchmarks.bench_load --folder D --rounds 3 --cleanup

Once (cached in ``--folder``), transformers' ``KimiLinearForCausalLM`` with a ~1.1B-parameter config is
built on the meta device, given cheap random bf16 values, and written by transformers' own
``save_pretrained`` as bf16 safetensors shards (the published key layout). Then each loader runs in a
fresh Python process per round, alternating, loading in bf16 on the CPU; each child reports its load
time (wall clock around ``from_pretrained`` only; imports excluded) and its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which includes the interpreter and imports). Best time
and lowest peak over the rounds are compared; targets: k3lab peak RSS <= transformers', load time
<= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ~1.1B parameters: 8 layers (MLA at 4 and 8), 16 experts of 1024, a dense first layer, vocab 32000.
CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    moe_intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_local_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    linear_attn_config={
        "full_attn_layers": [4, 8],
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "num_heads": 16,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    first_k_dense_replace=1,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

CHILD = r"""
import json, resource, sys, time
import torch
which, path = sys.argv[1], sys.argv[2]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
if which == "k3lab":
    from k3core.modeling.model import K3ForCausalLM
    c0, t0 = cpu(), time.perf_counter()
    model = K3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
else:
    from transformers import KimiLinearForCausalLM
    c0, t0 = cpu(), time.perf_counter()
    model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
params = sum(p.numel() for p in model.parameters())
# VmHWM: this process's peak resident set (reset by exec, unlike ru_maxrss, which a child inherits).
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss": hwm, "params": params,
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_checkpoint(folder: Path) -> Path:
    """transformers' own save_pretrained of a random ~1.1B Kimi Linear, bf16 shards (cached).

    Runs in a child process so that this (parent) process stays small: the loaders are its children."""
    if not (folder / ".complete").is_file():
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        code = "import sys; from benchmarks.bench_load import _write; _write(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=env)
    return folder


def _write(folder: str | Path) -> None:
    folder = Path(folder)
    done = folder / ".complete"
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = KimiLinearConfig(**CONFIG)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "layernorm" in name or "norm.weight" in name:
                p.fill_(1.0)
            elif name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.1)
            else:  # cheap random values: a small table repeated, not 1e9 fresh normals
                block = torch.randn(1 << 16, generator=gen).mul_(0.02).to(p.dtype)
                flat = p.view(-1)
                for i in range(0, flat.numel(), block.numel()):
                    n = min(block.numel(), flat.numel() - i)
                    flat[i : i + n] = block[:n]
    model.save_pretrained(folder, max_shard_size="700MB")
    done.write_text("ok\n")


def run_child(which: str, path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which, str(path)], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{which} loader failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "k3lab-bench-load")
    p.add_argument("--rounds", type=int, default=3, help="fresh-process loads per loader (alternating)")
    p.add_argument("--cleanup", action="store_true", help="delete the checkpoint folder afterwards")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = write_checkpoint(args.folder)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"checkpoint: {path} ({size / 1e9:.2f} GB in {len(list(path.glob('*.safetensors')))} shards; "
          f"ready in {time.perf_counter() - t0:.0f} s)")  # fmt: skip
    results: dict[str, list[dict]] = {"k3lab": [], "transformers": []}
    for r in range(args.rounds):
        for which in ("k3lab", "transformers") if r % 2 == 0 else ("transformers", "k3lab"):
            results[which].append(run_child(which, path))
            res = results[which][-1]
            print(
                f"  round {r + 1} {which:<12} {res['seconds']:6.2f} s wall {res['cpu_s']:6.2f} s CPU  "
                f"peak RSS {res['peak_rss'] / 1e9:5.2f} GB"
            )
    best = {w: min(x["seconds"] for x in rs) for w, rs in results.items()}
    median = {w: statistics.median(x["seconds"] for x in rs) for w, rs in results.items()}
    cpu = {w: min(x["cpu_s"] for x in rs) for w, rs in results.items()}
    peak = {w: min(x["peak_rss"] for x in rs) for w, rs in results.items()}
    params = results["k3lab"][0]["params"]
    t_ratio, m_ratio = best["k3lab"] / best["transformers"], peak["k3lab"] / peak["transformers"]
    print(f"\n{params / 1e9:.2f}B parameters, bf16, CPU, best of {args.rounds} fresh processes each\n")
    print("| loader | load time, best (s) | median (s) | CPU time, best (s) | peak RSS (GB) |")
    print("|---|---|---|---|---|")
    for w in ("k3lab", "transformers"):
        print(f"| {w} `from_pretrained` | {best[w]:.2f} | {median[w]:.2f} | {cpu[w]:.2f} | {peak[w] / 1e9:.2f} |")
    c_ratio, md_ratio = cpu["k3lab"] / cpu["transformers"], median["k3lab"] / median["transformers"]
    print(
        f"| **ratio k3lab / transformers** | **{t_ratio:.2f}** (target <= 1.5) | {md_ratio:.2f} | {c_ratio:.2f} "
        f"| **{m_ratio:.2f}** (target <= 1.0) |"
    )
    ok = t_ratio <= 1.5 and m_ratio <= 1.0
    print(f"\ntargets {'met' if ok else 'NOT met'}")
    if args.cleanup:
        shutil.rmtree(path, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
