"""Kimi K3 as published, traced on one machine: a streamed forward of a sparse replica under a memory budget.

    .venv/bin/python -m benchmarks.bench_k3_stream                       # 93 layers, 4 tokens, 8 GB
    .venv/bin/python -m benchmarks.bench_k3_stream --layers 3 --tokens 8 --budget 6GB --json

The replica (benchmarks/k3_replica.py) declares every tensor of the published checkpoint (96 shards, 1.56 TB at
full depth; compressed-tensors MXFP4 experts back to back, BF16/F32 elsewhere, language_model. prefix,
vision tensors, config with quantization_config inside text_config) and plants only what makes the forward
do real work (embedding rows of the prompt, norms, KDA gates, routers favouring 24 experts per layer, a
few random MXFP4 experts); the rest are file holes. A child process loads it with
``k3core.loading.streamed_run.load_streamed`` under ``--budget``, records a trace (``--what``, default the default
``record(model)``; the test of 2 layers uses "all") of one forward over ``--tokens`` tokens, and reports: seconds,
seconds per token, bytes read (and per token), expert hits / misses, peak RSS (``VmHWM``, interpreter and imports
included), and bytes read against the floor
(stored dense bytes of the layers + the embedding rows + the distinct experts chosen). A second child runs the same
forward without a recorder: the recorder's share of the peak is the two peaks side by side (and the trace's bytes
as ``k3core.interp.trace_size.record_bytes`` estimated them before the forward).

Holes read from the page cache (the kernel's zero pages), so the replica's reads are not disk reads.
The disk is timed separately: a real file of ``--disk-bytes`` random bytes is written, synced, and read
back with O_DIRECT (past the page cache), and the forward's bytes are priced at that speed. Figures quoted
in the issue for comparison: a native-MXFP4 C engine, 25.83 GB read per token uncached, 26.5 s/token with
8 GB of RAM on 124 cores; an MLX port, 0.36 tokens/s on a 128 GB laptop.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
QUOTED = {"c_engine_gb_per_token": 25.83, "c_engine_s_per_token": 26.5, "mlx_tokens_per_s": 0.36}


def build(folder: Path, layers: int, seed: int = 0) -> dict:
    """Write the sparse replica (``layers`` deep) into ``folder``; its description."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.k3_replica import forward_plants, k3_config_json, model_shapes, write_replica

    config = k3_config_json(num_layers=None if layers == 93 else layers)
    shapes = model_shapes(config)
    planted, experts = forward_plants(config, shapes, TOKENS, seed=seed)
    replica = write_replica(folder, config, shapes, planted, experts)
    return {"params": replica.params, "declared_bytes": replica.stored_bytes(), "planted_experts": sorted(experts)}


def run_child(
    folder: Path, tokens: int, budget: str, skip_holes: bool = False, dtype: str = "float32", what: str = "all"
) -> dict:
    """The measured forward (in this process: run it in a fresh one); ``what`` "none": a plain forward, no recorder."""
    import numpy as np
    import torch

    from k3core.interp.recorder import record
    from k3core.interp.trace import Trace, TraceNames
    from k3core.interp.trace_size import record_bytes, trace_estimate
    from k3core.loading.streamed_run import EXPERT_RE, load_streamed
    from k3core.modeling.model import K3ForCausalLM

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    peaks: dict[int, int] = {}  # VmHWM before each decoder layer: where the peak was reached

    def progress(info: dict) -> None:
        peaks[info["layer"]] = peak_rss()

    t0 = time.perf_counter()
    model = load_streamed(
        folder, K3ForCausalLM, dtype=getattr(torch, dtype), max_memory={"cpu": budget}, skip_holes=skip_holes,
        progress=progress, trace_estimate=trace_estimate,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    loaded_peak = peak_rss()
    session = model.loading.streaming
    plan = session.plan
    ids = torch.tensor([TOKENS[:tokens]])
    before = session.stats()
    estimate = record_bytes(model.config, tokens, what) if what != "none" else None
    t1 = time.perf_counter()
    if what == "none":
        trace = Trace()
        with torch.no_grad():
            logits = model(ids).logits
    else:
        with torch.no_grad(), record(model, what=what) as trace:
            logits = model(ids).logits
    forward_s = time.perf_counter() - t1
    stats = session.stats()
    files = session.store.files  # the table the run holds (a second one would cost 650 MB at full depth)
    chosen = set()
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe and TraceNames.moe_experts(i) in trace:
            chosen |= {(i, int(e)) for e in np.unique(trace[TraceNames.moe_experts(i)])}
    expert_bytes = sum(session.store.expert_bytes(i, e) for i, e in chosen)
    embed = files.tensors["model.embed_tokens.weight"]
    dense = sum(
        info.nbytes for name, info in files.tensors.items() if not EXPERT_RE.search(name) and "embed_tokens" not in name
    )
    rows = len(set(TOKENS[:tokens])) * (embed.nbytes // embed.shape[0])
    floor = dense + rows + expert_bytes
    read = stats["bytes_read"]  # loading (the resident small tensors) and the forward
    session.close()
    return {
        "layers": len(model.model.layers),
        "dtype": dtype,
        "tokens": tokens,
        "budget": plan.budget,
        "dense_resident": plan.dense_resident,
        "plan": plan.describe(tokens),
        "load_s": load_s,
        "forward_s": forward_s,
        "s_per_token": forward_s / tokens,
        "bytes_read": read,
        "bytes_read_per_token": read / tokens,
        "read_seconds": stats["read_seconds"] - before["read_seconds"],
        "floor_bytes": floor,
        "read_over_floor": read / floor,
        "distinct_experts": len(chosen),
        "expert_hits": stats["expert_hits"],
        "expert_misses": stats["expert_misses"],
        "expert_reads": stats["expert_reads"],
        "peak_rss": peak_rss(),
        "peak_rss_loaded": loaded_peak,
        "peak_rss_by_layer": peaks,
        "logits_finite": bool(torch.isfinite(logits).all()),
        "what": what,
        "trace_arrays": len(trace.names()),
        "trace_bytes": sum(a.nbytes for a in trace.arrays.values()),
        "estimated_trace_bytes": None if estimate is None else estimate.arrays,
        "estimated_record_bytes": None if estimate is None else estimate.total,
        "planned_prompt_bytes": plan.prompt_bytes(tokens),
        "planned_seconds": plan.expected_seconds(tokens),
    }


def child(folder: Path, tokens: int, budget: str, dtype: str, skip_holes: bool, what: str) -> dict:
    """``run_child`` in a fresh process (its own peak RSS); raises RuntimeError with its output when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_k3_stream", "--child", str(folder), "--tokens", str(tokens),
         "--budget", budget, "--dtype", dtype, "--what", what, *(["--skip-holes"] if skip_holes else [])],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_rss() -> int:
    """This process's peak resident set: VmHWM (reset by exec; ru_maxrss is inherited from a forking parent)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def disk_read_speed(folder: Path, nbytes: int) -> dict:
    """GB/s of reading a freshly written file of random bytes with O_DIRECT (past the page cache)."""
    path = folder / "disk-probe.bin"
    block = 4 * 1024**2
    nbytes = max(block, nbytes // block * block)
    with open(path, "wb") as fh:
        chunk = os.urandom(block)
        for _ in range(nbytes // block):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    direct = bool(getattr(os, "O_DIRECT", 0))
    t0 = time.perf_counter()
    try:
        pos = 0
        while pos < nbytes:
            n = os.preadv(fd, [buf], pos)
            if n <= 0:
                break
            pos += n
    except OSError:  # a filesystem without O_DIRECT (tmpfs): a page-cache read, said so
        direct = False
        os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        pos = 0
        while pos < nbytes:
            pos += os.preadv(fd, [buf], pos)
    seconds = time.perf_counter() - t0
    os.close(fd)
    path.unlink()
    return {"disk_bytes": nbytes, "disk_gbps": nbytes / seconds / 1e9, "o_direct": direct}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=93, help="depth of the replica (93: the published model)")
    p.add_argument("--tokens", type=int, default=4, help="prompt tokens in the traced forward (at most 8)")
    p.add_argument("--budget", default="8GB", help="memory budget (max_memory on the CPU)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--folder", default=None, help="where the replica goes (default: a temporary folder)")
    p.add_argument("--disk-bytes", type=int, default=1 << 30, help="size of the O_DIRECT disk probe (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--skip-holes",
        action="store_true",
        help="do not read the replica's holes (zeros without a read, still counted): times compute and decoding "
        "only, the reads are then priced by the disk probe",
    )
    p.add_argument(
        "--what", default="default", help="what to record: default (record(model)), all, or none (a plain forward)"
    )
    p.add_argument("--no-plain", action="store_true", help="skip the plain forward beside the traced one")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(Path(args.child), args.tokens, args.budget, args.skip_holes, args.dtype, args.what)))
        return 0
    tmp = tempfile.TemporaryDirectory(prefix="k3-replica-") if args.folder is None else None
    folder = Path(args.folder or tmp.name) / f"Kimi-K3-{args.layers}"
    t0 = time.perf_counter()
    built = build(folder, args.layers)
    build_s = time.perf_counter() - t0
    result = {**built, "build_s": build_s, "skip_holes": args.skip_holes}
    try:
        result.update(child(folder, args.tokens, args.budget, args.dtype, args.skip_holes, args.what))
        if not args.no_plain and args.what != "none":
            plain = child(folder, args.tokens, args.budget, args.dtype, args.skip_holes, "none")
            result.update(plain_peak_rss=plain["peak_rss"], plain_forward_s=plain["forward_s"])
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    result.pop("planted_experts")
    if args.disk_bytes:
        result.update(disk_read_speed(folder.parent, args.disk_bytes))
        result["disk_s_per_token"] = result["bytes_read_per_token"] / (result["disk_gbps"] * 1e9)
    result.update(QUOTED)
    if tmp is not None:
        tmp.cleanup()
    if args.json:
        print(json.dumps(result))
        return 0
    gb = 1e9
    by_layer = {int(k): v for k, v in result["peak_rss_by_layer"].items()}  # JSON keys are strings
    print(f"Kimi K3 replica: {result['layers']} layers, {result['params'] / 1e12:.2f}T params, "
          f"{result['declared_bytes'] / 1e12:.2f} TB declared; budget {result['budget'] / gb:.1f} GB, "
          f"{result['dtype']}")  # fmt: skip
    print(result["plan"])
    rows = [
        ("traced forward", f"{result['forward_s']:.1f} s for {result['tokens']} tokens "
                           f"= {result['s_per_token']:.2f} s/token"),
        ("bytes read", f"{result['bytes_read'] / gb:.2f} GB = {result['bytes_read_per_token'] / gb:.2f} GB/token "
                       f"({result['read_over_floor']:.3f} x the floor)"),
        ("experts", f"{result['distinct_experts']} distinct, {result['expert_misses']} misses, "
                    f"{result['expert_hits']} hits, {result['expert_reads']} reads"),
        ("peak RSS", f"{result['peak_rss'] / gb:.2f} GB ({result['peak_rss'] / 2**30:.2f} GiB) = "
                     f"{result['peak_rss'] / result['budget']:.3f} x the budget: "
                     + ("within it" if result["peak_rss"] <= result["budget"] else "OVER it")),
        *([("recorder's share", f"record({result['what']}) forward peak {result['peak_rss'] / gb:.2f} GB vs plain "
                                f"forward peak {result['plain_peak_rss'] / gb:.2f} GB: +"
                                f"{(result['peak_rss'] - result['plain_peak_rss']) / gb:.2f} GB; the trace holds "
                                f"{result['trace_bytes'] / gb:.3f} GB (estimated before the forward: "
                                f"{result['estimated_trace_bytes'] / gb:.3f} GB, "
                                f"{result['estimated_record_bytes'] / gb:.3f} GB while recording)")]
          if "plain_peak_rss" in result else []),
        ("peak RSS by depth", f"loaded {result['peak_rss_loaded'] / gb:.2f} GB; before layer "
                              + ", ".join(f"{i}: {v / gb:.2f}" for i, v in sorted(by_layer.items()) if i % 15 == 0)
                              + f"; end {result['peak_rss'] / gb:.2f} GB"),
        ("reads", f"{result['read_seconds']:.1f} s inside preadv"
                  + (" (holes skipped)" if result["skip_holes"] else " (page cache: the replica's holes)")),
    ]  # fmt: skip
    if args.disk_bytes:
        rows.append(("disk (O_DIRECT)" if result["o_direct"] else "disk (page cache!)",
                     f"{result['disk_gbps']:.2f} GB/s -> {result['disk_s_per_token']:.1f} s/token of reads "
                     "cold"))  # fmt: skip
    quoted = f"{QUOTED['c_engine_gb_per_token']} GB/token, {QUOTED['c_engine_s_per_token']} s/token"
    rows.append(("quoted: C engine", f"{quoted} (8 GB RAM, 124 cores, decode)"))
    rows.append(("quoted: MLX port", f"{QUOTED['mlx_tokens_per_s']} tokens/s (128 GB laptop, ~3-bit experts)"))
    for name, text in rows:
        print(f"  {name:20s} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
