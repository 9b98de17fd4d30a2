"""GPU check: build a large K3 on one GPU and verify the fast paths there (a few minutes on an H100/H200).

    python benchmarks/gpu_check.py                       # CUDA: k3-large in bf16, 4096 tokens
    python benchmarks/gpu_check.py --preset k3-small     # a smaller model
    python benchmarks/gpu_check.py --preset k3-nano      # no CUDA: the default, fp32 on the CPU

Steps (each prints one line; the exit status is 1 if a check fails):

1. build   K3ForCausalLM.from_config(preset) directly in the target dtype (default dtype set while the
           modules are created, so a 55B-parameter model never exists in fp32).
2. forward tokens/s over ``--tokens`` tokens (best of ``--repeat``), peak memory
           (torch.cuda.max_memory_allocated), and MFU = analytic FLOPs (benchmarks/bench_forward.py,
           ``forward_flops_per_token``) / time / peak, peak = ``--peak-tflops`` (default 989, the H100/H200
           dense bf16 figure; on the CPU the measured fp32 matmul rate).
3. kda     fla's Triton ``chunk_kda`` vs ``kda_chunk(backend="torch")`` on random K3-shaped inputs, max
           relative error (max |diff| / max |ref|) and both timings. Without CUDA or fla: the torch chunked
           form vs the token-by-token recurrence.
4. moe     the first LatentMoE layer: dispatch "grouped" (grouped GEMM when available) vs the masked loop,
           output and gradient (w.r.t. the input and the experts' gate weights) max relative errors.
5. decode  cached decoding (prefill + one token per step) vs one full forward, logits max relative error.
6. stream  (with ``--stream DIR``) the model of step 1 saved as bf16 safetensors shards of 5 GB in DIR (once;
           skipped with a message when the disk cannot hold it), then, in a fresh process, streamed back
           with ``K3ForCausalLM.from_pretrained(DIR, device, dtype)``: load time, peak host RSS (VmHWM; the
           target is about one tensor, not the model), then a forward with ``record()`` tracing.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from k3core.modeling.cache import K3Cache  # noqa: E402
from k3core.modeling.config import K3Config  # noqa: E402
from k3core.modeling.layers.moe import grouped_mm_available  # noqa: E402
from k3core.modeling.model import K3ForCausalLM  # noqa: E402
from k3core.modeling.presets import from_preset  # noqa: E402
from k3core.ops.kda import kda_chunk, kda_recurrent  # noqa: E402
from k3core.ops.kda.chunk import _fla_chunk_kda  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (fp32)."""
    a, ref = a.float(), ref.float()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def count(n: int) -> str:
    """1234567 -> '1.23M', 5.5e10 -> '55.0B'."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def timed(fn, repeat: int, sync) -> tuple[float, object]:
    """Best seconds over ``repeat`` runs after one warm-up, and the last result."""
    out = fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def kda_inputs(B: int, T: int, H: int, d: int, lower_bound: float, device, seed: int = 0):
    """Random KDA inputs: L2-normalised q/k, K3-form gate g in (lower_bound, 0), beta in (0, 1); fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, d, generator=gen), dim=-1)
    v = torch.randn(B, T, H, d, generator=gen)
    g = lower_bound * torch.sigmoid(torch.randn(B, T, H, d, generator=gen) - 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [t.to(device) for t in (q, k, v, g, beta)]


def check_kda(cfg: K3Config, T: int, device, repeat: int, sync) -> dict:
    x = kda_inputs(1, T, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_gate_lower_bound, device)
    t_ref, (o_ref, s_ref) = timed(
        lambda: kda_chunk(*x, output_final_state=True, chunk_size=64, backend="torch"), repeat, sync
    )
    if device.type == "cuda" and _fla_chunk_kda() is not None:
        name = "fla chunk_kda vs kda_chunk(torch)"
        t_new, (o, s) = timed(lambda: kda_chunk(*x, output_final_state=True, backend="fla"), repeat, sync)
        tol = 1e-2  # fla computes in tf32/bf16 tensor-core precision
    else:
        name = "kda_chunk(torch) vs kda_recurrent (no CUDA/fla)"
        t_new = t_ref
        t_ref, (o, s) = timed(lambda: kda_recurrent(*x, output_final_state=True), 1, sync)
        o, o_ref, s, s_ref = o_ref, o, s_ref, s
        tol = 1e-4
    err = max(rel_err(o, o_ref), rel_err(s, s_ref))
    return {
        "name": name,
        "T": T,
        "rel_err": err,
        "ok": err < tol,
        "tol": tol,
        "t_candidate_s": t_new,
        "t_reference_s": t_ref,
    }


def check_moe(model: K3ForCausalLM, tokens: int, device) -> dict:
    moe = model.moe_layers()[0]
    dtype = next(moe.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, model.config.hidden_size, generator=gen).to(device, dtype)
    results = {"grouped_mm": grouped_mm_available(x.view(-1, x.shape[-1]))}
    outs = {}
    for dispatch in ("grouped", "masked"):
        xi = x.clone().requires_grad_()
        y = moe(xi, dispatch=dispatch)
        r = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        gx, gw = torch.autograd.grad((y.float() * r.float()).sum(), [xi, moe.experts.w1])
        outs[dispatch] = (y.detach(), gx, gw)
    (y, gx, gw), (y0, gx0, gw0) = outs["grouped"], outs["masked"]
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    errs = {"out": rel_err(y, y0), "grad_x": rel_err(gx, gx0), "grad_w1": rel_err(gw, gw0)}
    results.update(rel_err=errs, ok=all(e < tol for e in errs.values()), tol=tol)
    return results


def check_decode(model: K3ForCausalLM, prompt: int, steps: int, device) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + steps), generator=torch.Generator().manual_seed(3))
    ids = ids.to(device)
    with torch.inference_mode():
        full = model(ids).logits
        cache = K3Cache.for_config(model.config)
        parts = [model(ids[:, :prompt], cache=cache).logits]
        parts += [model(ids[:, t : t + 1], cache=cache).logits for t in range(prompt, prompt + steps)]
    err = rel_err(torch.cat(parts, dim=1), full)
    tol = 5e-2 if full.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return {"rel_err": err, "ok": err < tol, "tol": tol, "cache_bytes": cache.nbytes()}


def main(argv: list[str] | None = None) -> dict:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset",
        default="k3-large" if cuda else "k3-nano",
        help="model preset (default k3-large on CUDA, k3-nano on the CPU)",
    )
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    ap.add_argument("--tokens", type=int, default=4096 if cuda else 128, help="forward length T (batch 1)")
    ap.add_argument("--repeat", type=int, default=3 if cuda else 1, help="timed forwards (best is reported)")
    ap.add_argument("--kda-len", type=int, default=4096 if cuda else 128, help="length of the KDA kernel check")
    ap.add_argument("--moe-tokens", type=int, default=2048 if cuda else 64)
    ap.add_argument("--decode-steps", type=int, default=8 if cuda else 4)
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense peak for MFU (default 989 on CUDA: H100/H200 bf16; CPU: measured fp32 matmul)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 without CUDA, where shared cores make more erratic)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stream",
        metavar="DIR",
        default=None,
        help="step 6: save the model as bf16 shards in DIR (once) and stream it back in a fresh process "
        "(load time, peak host RSS, traced forward)",
    )
    args = ap.parse_args(argv)
    threads = args.threads if args.threads is not None else (None if cuda else 1)
    if threads is not None:
        if threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(threads)
    for name in ("tokens", "repeat", "kda_len", "moe_tokens", "decode_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cfg = from_preset(args.preset)
    report: dict = {"preset": args.preset, "device": str(device), "dtype": args.dtype}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    print(f"gpu_check: {args.preset} on {report.get('gpu', device)} in {args.dtype}, torch {torch.__version__}")

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    with default_dtype(dtype):
        model = K3ForCausalLM.from_config(cfg, device=device, dtype=dtype).eval()
    sync()
    report["build_s"] = time.perf_counter() - t0
    report["params"] = model.num_parameters()
    report["active_params"] = model.num_parameters(active=True)
    print(
        f"build    {count(report['params'])} parameters ({count(report['active_params'])} active) "
        f"in {report['build_s']:.1f} s"
    )

    from benchmarks.bench_forward import forward_flops_per_token, matmul_peak_gflops

    T = args.tokens
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(args.seed)).to(device)
    with torch.inference_mode():
        sec, _ = timed(lambda: model(ids), args.repeat, sync)
    flops = forward_flops_per_token(cfg, T)["total"] * T
    peak = (
        args.peak_tflops * 1e12
        if args.peak_tflops
        else (989e12 if device.type == "cuda" else matmul_peak_gflops(512, repeat=3) * 1e9)
    )
    report.update(
        tokens=T,
        forward_s=sec,
        tokens_per_s=T / sec,
        achieved_tflops=flops / sec / 1e12,
        peak_tflops=peak / 1e12,
        mfu=flops / sec / peak,
    )
    report["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    mem = "n/a (CPU)" if report["peak_memory_gib"] is None else f"{report['peak_memory_gib']:.1f} GiB"
    print(
        f"forward  T={T}: {report['tokens_per_s']:.0f} tokens/s, {report['achieved_tflops']:.3g} TFLOP/s, "
        f"MFU {report['mfu']:.1%} of {report['peak_tflops']:.3g} TFLOP/s, peak memory {mem}"
    )

    kda = check_kda(cfg, args.kda_len, device, args.repeat, sync)
    report["kda"] = kda
    print(
        f"kda      {kda['name']}, T={kda['T']}: max rel err {kda['rel_err']:.2e} (tol {kda['tol']:g}) "
        f"{'ok' if kda['ok'] else 'FAIL'}; {kda['t_candidate_s'] * 1e3:.1f} ms vs {kda['t_reference_s'] * 1e3:.1f} ms"
    )

    if model.moe_layers():
        moe = check_moe(model, args.moe_tokens, device)
        report["moe"] = moe
        errs = ", ".join(f"{k} {v:.1e}" for k, v in moe["rel_err"].items())
        print(
            f"moe      grouped (grouped_mm={moe['grouped_mm']}) vs masked loop: {errs} (tol {moe['tol']:g}) "
            f"{'ok' if moe['ok'] else 'FAIL'}"
        )

    dec = check_decode(model, min(64, T), args.decode_steps, device)
    report["decode"] = dec
    print(
        f"decode   cached vs full forward: max rel err {dec['rel_err']:.2e} (tol {dec['tol']:g}) "
        f"{'ok' if dec['ok'] else 'FAIL'}; cache {dec['cache_bytes'] / 2**20:.1f} MiB"
    )
    if args.stream:
        saved = save_for_stream(model, pathlib.Path(args.stream))
        del model  # free the device for the fresh process that loads it back
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["stream"] = st = stream_back(saved, device, args.dtype, T)
        print(
            f"stream   {st['message']}"
            if not st["ok"] or "load_s" not in st
            else f"stream   {st['gb']:.1f} GB in {st['load_s']:.1f} s ({st['gb'] / st['load_s']:.2f} GB/s), peak host "
            f"RSS {st['host_peak_gib']:.2f} GiB, traced forward {st['trace_items']} items in {st['forward_s']:.2f} s"
        )
    report["ok"] = all(report[k]["ok"] for k in ("kda", "moe", "decode", "stream") if k in report)
    print("gpu_check:", "all checks passed" if report["ok"] else "SOME CHECKS FAILED")
    return report


_STREAM_CHILD = r"""
import json, sys, time, torch
from k3core.modeling.model import K3ForCausalLM
from k3core.interp.recorder import record
path, device, dtype, T = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
model = K3ForCausalLM.from_pretrained(path, device=device, dtype=dtype)
if device.startswith("cuda"):
    torch.cuda.synchronize()
load_s = time.perf_counter() - t0
hwm = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:"))
ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
t0 = time.perf_counter()
with torch.inference_mode(), record(model) as trace:
    model(ids)
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({"load_s": load_s, "host_peak_gib": hwm / 2**30, "forward_s": time.perf_counter() - t0,
                  "trace_items": len(trace.names())}))
"""


def save_for_stream(model, folder: pathlib.Path) -> dict:
    """Save ``model`` as 5 GB shards in ``folder`` (once; skipped when the disk cannot hold it)."""
    import shutil

    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / ".complete").is_file():
        free = shutil.disk_usage(folder).free
        if free < 1.1 * nbytes:
            return {"folder": None, "message": f"skipped: {nbytes / 1e9:.0f} GB checkpoint, {free / 1e9:.0f} GB "
                    f"free in {folder} (use a smaller --preset or another folder)"}  # fmt: skip
        model.save_pretrained(folder, max_shard_bytes=5 * 10**9)
        (folder / ".complete").write_text("ok\n")
    return {"folder": folder, "gb": nbytes / 1e9}


def stream_back(saved: dict, device: torch.device, dtype: str, tokens: int) -> dict:
    """Stream a saved checkpoint onto ``device`` in a fresh process: load time, host VmHWM, traced forward."""
    import json
    import os
    import subprocess

    if saved["folder"] is None:
        return {"ok": True, "message": saved["message"]}
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-c", _STREAM_CHILD, str(saved["folder"]), str(device), name, str(min(tokens, 1024))]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        return {"ok": False, "message": f"FAIL: {out.stderr[-2000:]}"}
    return {"ok": True, "gb": saved["gb"], **json.loads(out.stdout.strip().splitlines()[-1])}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
