"""Long context on a CPU: tokens/s and peak RSS of a plain forward and of ``record(what="all")`` at T = 1K .. 64K.

    python -m benchmarks --only long           # T = 1K, 4K, 16K, 64K
    python -m benchmarks --only long --full    # adds 128K

Models: the k3-full sample checkpoint (Shakespeare bytes) and k3-mini (random init, same width), beside
the equal-width softmax Transformer of ``bench_forward`` (``baseline_for``), and a Kimi-Linear-type
checkpoint (k3-mini's width, Kimi Linear's mechanisms: plain residual, softplus gate, SwiGLU, no latent
MoE) written by transformers' ``save_pretrained`` and run by k3lab and by transformers'
``KimiLinearForCausalLM``. transformers cannot represent AttnRes or LatentMoE, so it cannot read the
k3-full sample itself: that pairing is the nearest "same checkpoint".

Every measurement runs in its own subprocess on one thread (clean peak RSS: ``ru_maxrss``; ``growth`` is
the peak minus the RSS after loading and a 64-token warm-up). The parent samples the child's RSS and
stops it past ``RSS_CAP`` (3 GiB, the machine is shared) or ``TIME_CAP`` seconds; such a row says so.
Timing is one forward (seconds of process CPU time), not best-of: at these lengths one run is seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import Row

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_checkpoints" / "k3-full"
RSS_CAP = 3 * 2**30
TIME_CAP = 1800.0  # wall seconds: on the shared 2-core machine a 64K forward takes 5-10 minutes of wall time
LENGTHS = (1024, 4096, 16384, 65536)
FULL_LENGTHS = LENGTHS + (131072,)


def _tokens(T: int, vocab: int):
    """T tokens of Shakespeare (bytes, repeated as needed) for a byte model, else seeded random ids."""
    import numpy as np
    import torch

    if vocab == 256:
        from k3core.data.corpus import load_shakespeare

        text = load_shakespeare().train
        reps = -(-T // len(text))
        return torch.from_numpy(np.tile(text, reps)[:T].astype(np.int64))[None]
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))


def _kimi_linear_folder(folder: Path) -> Path:
    """A Kimi-Linear-type checkpoint of k3-mini's width written by transformers (random init, seed 0)."""
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        linear_attn_config={"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 4,
                            "head_dim": 32, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    KimiLinearForCausalLM(cfg).save_pretrained(folder)
    return folder


def _child(model_name: str, mode: str, T: int, folder: str) -> dict:
    """Runs in the subprocess: build the model, warm up, then one timed forward; returns the numbers."""
    import resource

    import torch

    torch.set_num_threads(1)
    from k3core.modeling.model import K3ForCausalLM

    if model_name == "k3-full":
        model = K3ForCausalLM.from_pretrained(SAMPLE)
    elif model_name == "kimi-linear-mini" and mode == "transformers":
        from transformers import KimiLinearForCausalLM

        model = KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32)
    elif model_name == "kimi-linear-mini":
        model = K3ForCausalLM.from_pretrained(folder)
    else:
        torch.manual_seed(0)
        model = K3ForCausalLM.from_config(model_name)
    vocab = model.config.vocab_size
    if mode == "softmax":
        from .bench_forward import baseline_for

        model = baseline_for(model.config)
    model.eval()
    ids = _tokens(T, vocab)

    def forward(x):
        if mode == "record":
            from k3core.interp.recorder import record

            with record(model, what="all"):
                model(x)
        else:
            model(x)

    with torch.inference_mode():
        forward(ids[:, :64])
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.process_time()
        forward(ids)
        seconds = time.process_time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak": peak, "growth": peak - base}


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(model_name: str, mode: str, T: int, folder: str = "") -> dict:
    """One child run: {"seconds", "peak", "growth"}, or {"stopped": reason} past the RSS or time cap."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, "-m", "benchmarks.bench_long", "--child", model_name, mode, str(T), folder]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start, peak = time.monotonic(), 0
    while proc.poll() is None:
        peak = max(peak, _rss(proc.pid))
        reason = "RSS passed 3 GiB" if peak > RSS_CAP else "time cap" if time.monotonic() - start > TIME_CAP else ""
        if reason:
            proc.kill()
            proc.wait()
            return {"stopped": reason, "peak": peak}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        return {"stopped": f"failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"}
    return json.loads(out.strip().splitlines()[-1])


def _tok_s(r: dict, T: int) -> float:
    return float("nan") if "stopped" in r else T / r["seconds"]


def _note(r: dict, label: str) -> str:
    if "stopped" in r:
        return f"{label}: stopped ({r['stopped']})"
    return f"{label}: peak RSS {r['peak'] / 2**20:.0f} MiB (+{r['growth'] / 2**20:.0f} MiB), {r['seconds']:.1f} s"


def run(quick: bool = False, full: bool = False, log=print, lengths=None, models=("k3-full", "k3-mini")) -> list[Row]:
    """The table's rows; ``lengths`` and ``models`` narrow it (default: by ``quick`` / ``full``)."""
    lengths = lengths or ((1024, 4096) if quick else FULL_LENGTHS if full else LENGTHS)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = str(_kimi_linear_folder(Path(tmp) / "kimi-linear-mini"))
        except Exception as exc:  # noqa: BLE001 - transformers missing or without Kimi Linear: skip those rows
            folder = ""
            log(f"  long: no Kimi Linear checkpoint ({exc})", file=sys.stderr)
        for model_name in models:
            for T in lengths:
                fwd = measure(model_name, "forward", T)
                soft = measure(model_name, "softmax", T)
                rec = measure(model_name, "record", T)
                ratio = _tok_s(fwd, T) / _tok_s(soft, T) if "stopped" not in soft else float("nan")
                ok = None if T < 4096 or ratio != ratio else ratio >= 1
                rows.append(Row("long forward tokens/s", f"{model_name} T={T}", _tok_s(fwd, T), "K3 forward",
                                _tok_s(soft, T), "softmax baseline", "tok/s", ratio,
                                target=">= 1 from 4K" if T >= 4096 else "", ok=ok,
                                note=_note(fwd, "K3") + "; " + _note(soft, "softmax")))  # fmt: skip
                rec_peak = rec.get("peak", float("nan"))
                fwd_peak = fwd.get("peak", float("nan"))
                ok_rec = rec_peak <= RSS_CAP and "stopped" not in rec
                rows.append(Row("long record(all) peak RSS", f"{model_name} T={T}", rec_peak, "record(what='all')",
                                fwd_peak, "plain forward", "bytes", rec_peak / fwd_peak,
                                target="<= 3 GiB peak", ok=ok_rec,
                                note=_note(rec, "record") + f"; {_tok_s(rec, T):.0f} tok/s"))  # fmt: skip
                log(f"  long {model_name} T={T} done", file=sys.stderr)
        if folder:
            for T in lengths:
                ours = measure("kimi-linear-mini", "forward", T, folder)
                theirs = measure("kimi-linear-mini", "transformers", T, folder)
                ratio = _tok_s(ours, T) / _tok_s(theirs, T) if "stopped" not in theirs else float("nan")
                rows.append(Row("long vs transformers tok/s", f"kimi-linear-mini T={T}", _tok_s(ours, T), "k3lab",
                                _tok_s(theirs, T), "transformers KimiLinear", "tok/s", ratio, target=">= 1",
                                ok=None if ratio != ratio else ratio >= 1,
                                note=_note(ours, "k3lab") + "; " + _note(theirs, "transformers")))  # fmt: skip
                log(f"  long kimi-linear-mini T={T} done", file=sys.stderr)
    return rows


if __name__ == "__main__" and len(sys.argv) >= 5 and sys.argv[1] == "--child":
    print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")))
