"""Rerunning the start of a finished run: does today's code, on this machine, retrace its first steps bit for bit?

    mismatches = rerun_start("sample_checkpoints/k3-full", work_dir, steps=50)   # [] when it reproduces

The run's recorded training config is trained again into ``work_dir``, stopped after ``steps`` steps (a run
that compiles runs its first ``compile_after`` steps eager, so ``steps <= compile_after`` needs no compiling), and
every logged training entry up to that step (loss, bits/byte, gradient norm, learning rate, ...) is compared with
the recorded one for exact equality. Timings (wall time, tokens/s) are not compared.
"""

from __future__ import annotations

from pathlib import Path

from .config import TrainConfig, TrainError
from .loop import train
from .rundir import load_metrics

#: History fields that measure the machine, not the run.
TIMING_FIELDS = frozenset({"wall_time", "tokens_per_s"})


def rerun_start(run_dir: str | Path, work_dir: str | Path, steps: int = 50) -> list[str]:
    """Train ``run_dir``'s recorded config again for ``steps`` steps into ``work_dir``; the logged entries (step <=
    ``steps``) that differ from the recorded ones, one line each (``[]``: bit for bit the same)."""
    recorded = load_metrics(run_dir)
    config = dict(recorded["train_config"])
    if config.get("compile") and steps > config.get("compile_after", 0):
        raise TrainError(
            f"{run_dir}: steps {steps} > compile_after {config.get('compile_after', 0)}: compiled steps round "
            "differently from an eager rerun, so only the eager start reproduces bit for bit"
        )
    config.update(out_dir=str(work_dir), stop_at=steps, progress=False)
    rerun = load_metrics(train(TrainConfig.from_dict(config)))
    before = [e for e in recorded["history"]["train"] if e["step"] <= steps]
    after = [e for e in rerun["history"]["train"] if e["step"] <= steps]
    if not before:
        return [f"{run_dir}: no training entries logged within the first {steps} steps"]
    if [e["step"] for e in before] != [e["step"] for e in after]:
        return [f"logged steps differ: {[e['step'] for e in before]} recorded, {[e['step'] for e in after]} now"]
    return [
        f"step {a['step']}: {key} {a.get(key)!r} recorded, {b.get(key)!r} now"
        for a, b in zip(before, after, strict=True)
        for key in sorted(set(a) | set(b))
        if key not in TIMING_FIELDS and a.get(key) != b.get(key)
    ]
