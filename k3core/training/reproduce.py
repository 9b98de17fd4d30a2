"""Rerunning the start of a finished run: does today's code, on this machine, retrace its first steps bit for bit?

    mismatches = rerun_start("sample_checkpoints/k3-full", work_dir, steps=50)   # [] when it reproduces

The run's recorded training config is trained again into ``work_dir``, stopped after ``steps`` steps (a run
that compiles runs its first ``compile_after`` steps eager, so ``steps <= compile_after`` needs no compiling), and
every logged training entry up to that step (loss, bits/byte, gradient norm, learning rate, ...) is compared with
the recorded one for exact equality. Timings (wall time, tokens/s) are not compared. A run no longer than ``steps``
(an untrained ``--steps 0`` run, a short one) is rerun whole, and its saved weights and final validation are
compared too.

The rerun trains on ``device`` (default the CPU) with ``threads`` (default the recorded number). A run trained
elsewhere (a GPU) rounds differently, so it is compared within a relative tolerance ``rtol`` instead:
``|a - b| <= rtol * max(|a|, |b|)`` for numbers, ``torch.allclose(rtol=rtol, atol=rtol * max|w|)`` for weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..modeling.model import K3ForCausalLM
from .config import TrainConfig, TrainError
from .loop import train
from .rundir import load_metrics

#: History fields that measure the machine, not the run.
TIMING_FIELDS = frozenset({"wall_time", "tokens_per_s"})


def rerun_start(
    run_dir: str | Path,
    work_dir: str | Path,
    steps: int = 50,
    device: str = "cpu",
    threads: int | None = None,
    rtol: float = 0.0,
) -> list[str]:
    """Train ``run_dir``'s recorded config again for ``steps`` steps into ``work_dir`` on ``device``; the logged
    entries (step <= ``steps``) that differ from the recorded ones (beyond ``rtol``, module docstring), one line
    each (``[]``: bit for bit the same, or within ``rtol``)."""
    if not 0.0 <= rtol < 1.0:
        raise ValueError(f"rtol must be in [0, 1), got {rtol}")
    recorded = load_metrics(run_dir)
    config = dict(recorded["train_config"], device=device)
    if threads is not None:
        config["threads"] = threads
    if config.get("compile") and steps > config.get("compile_after", 0):
        raise TrainError(
            f"{run_dir}: steps {steps} > compile_after {config.get('compile_after', 0)}: compiled steps round "
            "differently from an eager rerun, so only the eager start reproduces bit for bit"
        )
    whole = config["steps"] <= steps
    config.update(out_dir=str(work_dir), stop_at=None if whole else steps, progress=False)
    rerun_dir = train(TrainConfig.from_dict(config))
    rerun = load_metrics(rerun_dir)
    before = [e for e in recorded["history"]["train"] if e["step"] <= steps]
    after = [e for e in rerun["history"]["train"] if e["step"] <= steps]
    if not before and not whole:
        return [f"{run_dir}: no training entries logged within the first {steps} steps"]
    if [e["step"] for e in before] != [e["step"] for e in after]:
        return [f"logged steps differ: {[e['step'] for e in before]} recorded, {[e['step'] for e in after]} now"]
    differs = [
        f"step {a['step']}: {key} {a.get(key)!r} recorded, {b.get(key)!r} now"
        for a, b in zip(before, after, strict=True)
        for key in sorted(set(a) | set(b))
        if key not in TIMING_FIELDS and not _same(a.get(key), b.get(key), rtol)
    ]
    if whole:
        differs += _final_differences(Path(run_dir), recorded, rerun_dir, rerun, rtol)
    return differs


def _same(a: object, b: object, rtol: float) -> bool:
    """Equal, or for two numbers with ``rtol`` > 0: ``|a - b| <= rtol * max(|a|, |b|)``."""
    if a == b:
        return True
    numbers = isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool)
    return rtol > 0 and numbers and math.isclose(a, b, rel_tol=rtol)


def _final_differences(run_dir: Path, recorded: dict, rerun_dir: Path, rerun: dict, rtol: float) -> list[str]:
    """A whole rerun: the saved weights (tensor by tensor) and final validation that differ (beyond ``rtol``)."""
    found = []
    for key in ("val_loss", "val_bpb", "mqar_accuracy"):
        if not _same(recorded["final"].get(key), rerun["final"].get(key), rtol):
            found.append(f"final {key} {recorded['final'].get(key)!r} recorded, {rerun['final'].get(key)!r} now")
    saved = K3ForCausalLM.from_pretrained(run_dir).state_dict()
    again = K3ForCausalLM.from_pretrained(rerun_dir).state_dict()
    if saved.keys() != again.keys():
        return found + [f"weights: tensors {sorted(saved.keys() ^ again.keys())[:4]} only in one of them"]
    found += [f"weights: {name} differs" for name in sorted(saved) if not _same_tensor(saved[name], again[name], rtol)]
    return found


def _same_tensor(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    if rtol == 0:
        return torch.equal(a, b)
    scale = float(a.abs().max()) if a.numel() else 0.0
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol * scale)
