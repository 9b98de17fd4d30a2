"""Shared pieces of the benchmark suite: side-by-side timing and the result row."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One line of the results table: ``value`` of a candidate vs ``base`` of a reference, and their ratio.

    ``ratio`` is always candidate / reference in the unit shown (tokens/s, bytes, seconds...);
    ``target`` is a human-readable goal such as "<= 1.5" (empty when there is none) and ``ok`` whether
    the ratio meets it (None when there is no target).
    """

    bench: str
    case: str
    value: float
    value_label: str
    base: float
    base_label: str
    unit: str
    ratio: float
    target: str = ""
    ok: bool | None = None
    note: str = ""


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = {"name": "cpu"}


def use_clock(name: str) -> None:
    """Time with "cpu" (this process's CPU time: on a shared machine it leaves out the time spent
    waiting for a core) or "wall" (elapsed time; use it on a dedicated machine or a GPU)."""
    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    _clock["name"] = name


def clock_name() -> str:
    return _clock["name"]


def side_by_side(
    fns: dict[str, Callable[[], object]], repeat: int, warmup: int = 1, sync: Callable[[], None] | None = None
) -> dict[str, float]:
    """Best (minimum) time in seconds of each function, timed round-robin in one process.

    Every function runs ``warmup`` times first; then ``repeat`` rounds each call every function once,
    in turn, so slow phases of a shared machine hit all candidates alike. The minimum is reported:
    background load only ever adds time. ``sync`` (e.g. torch.cuda.synchronize) runs around each call.
    The clock is the one chosen with :func:`use_clock` (default: process CPU time).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    sync = sync or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    now = CLOCKS[_clock["name"]]
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            t0 = now()
            fn()
            sync()
            best[name] = min(best[name], now() - t0)
    return best


def cpu_model_name() -> str:
    """The CPU model as ``lscpu`` reports it (falls back to /proc/cpuinfo, then 'unknown')."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fmt_num(x: float, unit: str) -> str:
    """Compact number with a unit: bytes as KiB/MiB/GiB, others with 3 significant digits."""
    if unit == "bytes":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(x) >= scale:
                return f"{x / scale:.3g} {name}"
        return f"{x:.0f} B"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.3g}M {unit}"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.3g}k {unit}"
    return f"{x:.3g} {unit}"


def inference(fn: Callable[[], object]) -> Callable[[], object]:
    """Wrap fn so it runs under torch.inference_mode."""

    def run():
        with torch.inference_mode():
            return fn()

    return run
