"""Retrain the shipped sample checkpoints from sample_checkpoints/recipe.json, and rebuild their README table.

    python scripts/train_samples.py --print               # the exact k3lab train commands
    python scripts/train_samples.py --jobs 2              # train all runs (two at a time), then the table
    python scripts/train_samples.py --only k3-full        # one run
    python scripts/train_samples.py --table               # only rewrite sample_checkpoints/README.md
    python scripts/train_samples.py --stage /tmp/k3stage  # train there, copy into sample_checkpoints/ when done

Each run is ``k3lab train <base_config> --set <its change> <common args> --out sample_checkpoints/<name>``
(run here as ``python -m k3lab train``, the same entry point). Logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
RECIPE = SAMPLES / "recipe.json"


def load_recipe(path: Path = RECIPE) -> dict:
    """The recipe: base_config, common_args, and runs [{name, differs, question, set}]."""
    recipe = json.loads(path.read_text())
    names = [r["name"] for r in recipe["runs"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: duplicate run names {names}")
    return recipe


def run_args(recipe: dict, run: dict, out_root: str = "sample_checkpoints") -> list[str]:
    """``k3lab train`` arguments of one run (relative paths, run from the repository root)."""
    args = [recipe["base_config"]]
    for item in run.get("set", []):
        args += ["--set", item]
    return args + list(recipe["common_args"]) + ["--out", f"{out_root}/{run['name']}"]


def command(recipe: dict, run: dict) -> str:
    return "k3lab train " + shlex.join(run_args(recipe, run))


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def readme_table(recipe: dict, root: Path = SAMPLES) -> str:
    """Markdown table of the finished runs (name, change, params, val bits/byte, MQAR, time, tokens, size)."""
    rows = [
        "| run | what differs | params total / active | val bits/byte | MQAR acc | train time | tokens | size |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in recipe["runs"]:
        path = root / run["name"] / "metrics.json"
        if not path.is_file():
            rows.append(f"| `{run['name']}` | {run['differs']} | (not trained) | | | | | |")
            continue
        m = json.loads(path.read_text())
        fin = m["final"] or {}
        size = sum(f.stat().st_size for f in (root / run["name"]).glob("*.safetensors"))
        rows.append(
            f"| `{run['name']}` | {run['differs']} | {_fmt_params(m['params']['total'])} / "
            f"{_fmt_params(m['params']['active'])} | {fin.get('val_bpb', float('nan')):.3f} | "
            f"{fin.get('mqar_accuracy', float('nan')):.3f} | {fin.get('wall_time_s', 0) / 60:.1f} min | "
            f"{fin.get('tokens_seen', 0) / 1e6:.2f}M | {size / 1e6:.2f} MB |"
        )
    return "\n".join(rows)


def write_table(recipe: dict, root: Path = SAMPLES) -> None:
    """Replace the table between the TABLE markers of sample_checkpoints/README.md."""
    readme = root / "README.md"
    text = readme.read_text()
    start, end = "<!-- TABLE START -->", "<!-- TABLE END -->"
    if start not in text or end not in text:
        raise SystemExit(f"{readme}: missing the {start} / {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{readme_table(recipe, root)}\n{end}{tail}")


def publish(recipe: dict, run: dict, staged: Path, root: Path = SAMPLES) -> Path:
    """Copy a finished run trained elsewhere (``--stage``) into ``root/<name>``.

    Weights, config and history are copied unchanged; metrics.json gets the canonical ``out_dir``,
    run name and command (``--out`` is a runtime option: it does not change the weights) plus
    ``trained_in``, and the model card is rewritten from it.
    """
    from k3core.training import load_metrics, model_card

    metrics = load_metrics(staged)
    if metrics["status"] != "finished":
        raise SystemExit(f"{staged}: run not finished ({metrics['status']})")
    dest = root / run["name"]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(staged / name, dest / name)
    metrics["trained_in"] = str(staged)
    metrics["run_name"] = run["name"]
    metrics["train_config"]["out_dir"] = f"sample_checkpoints/{run['name']}"
    metrics["command"] = command(recipe, run)
    (dest / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (dest / "README.md").write_text(model_card(metrics))
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", help="train only these runs")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at the same time (default 2)")
    p.add_argument("--log-dir", default="/tmp/k3samples", help="where the training logs go")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the commands and exit")
    p.add_argument("--table", action="store_true", help="only rewrite the README table")
    p.add_argument("--recipe", default=str(RECIPE), help="recipe file (default sample_checkpoints/recipe.json)")
    p.add_argument("--stage", help="train into STAGE/<name>, then copy finished runs into sample_checkpoints/")
    args = p.parse_args(argv)
    recipe = load_recipe(Path(args.recipe))
    runs = [r for r in recipe["runs"] if not args.only or r["name"] in args.only]
    if args.print_only:
        for run in runs:
            print(command(recipe, run))
        return 0
    if not args.table:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        pending, active, failed = list(runs), [], []
        while pending or active:
            while pending and len(active) < max(1, args.jobs):
                run = pending.pop(0)
                log = open(log_dir / f"{run['name']}.log", "w")  # noqa: SIM115 - closed when the job ends
                out_root = str(Path(args.stage).resolve()) if args.stage else "sample_checkpoints"
                cmd = [sys.executable, "-m", "k3lab", "train", *run_args(recipe, run, out_root)]
                print(f"start {run['name']}: {command(recipe, run)}  (log {log.name})", flush=True)
                active.append((run, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
            time.sleep(5)
            for job in list(active):
                run, proc, log = job
                if proc.poll() is not None:
                    log.close()
                    active.remove(job)
                    print(f"done {run['name']}: exit {proc.returncode}", flush=True)
                    if proc.returncode != 0:
                        failed.append(run["name"])
        if failed:
            print(f"failed: {failed} (see {log_dir})", file=sys.stderr)
            return 1
        if args.stage:
            for run in runs:
                print(f"published {publish(recipe, run, Path(args.stage).resolve() / run['name'])}")
    write_table(recipe)
    print(readme_table(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
