"""Retrain the shipped sample checkpoints from sample_checkpoints/recipe.json, and rebuild their README table.

    python scripts/train_samples.py --print               # the exact k3lab train commands
    python scripts/train_samples.py --jobs 2              # train all runs (two at a time), then the table
    python scripts/train_samples.py --only k3-full        # one run
    python scripts/train_samples.py --table               # only rewrite sample_checkpoints/README.md
    python scripts/train_samples.py --stage /tmp/k3stage  # train there, copy into sample_checkpoints/ when done

The campaign (recipe.json's "campaign": the sweeps and the runs that replace the shipped samples, each a unit that
fits 2 hours of one core at the measured step speed, trained over as many sessions as it takes):

    python scripts/train_samples.py --campaign                     # every unit, its budget and whether it is done
    python scripts/train_samples.py --unit k3-full-s0 --print      # the unit's k3lab train command
    nohup python scripts/train_samples.py --unit k3-full-s0 --stage /tmp/k3c &   # train one unit
    python scripts/train_samples.py --record k3-full-s0 /tmp/k3c/k3-full-s0 --device "cpu, 1 thread"
    python scripts/train_samples.py --check-start /tmp/k3c/k3-full-s0       # its first 50 steps, again, bit for bit

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
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
RECIPE = SAMPLES / "recipe.json"
#: every shipped sample's checked numbers (scripts/check_samples.py --compare --json), the README's comparison tables
CHECKS_FILE = "checks.json"


def load_recipe(path: Path = RECIPE) -> dict:
    """The recipe: base_config, common_args, and runs [{name, differs, question, set}]."""
    recipe = json.loads(path.read_text())
    names = [r["name"] for r in recipe["runs"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: duplicate run names {names}")
    return recipe


def run_args(recipe: dict, run: dict, out_root: str = "sample_checkpoints") -> list[str]:
    """``k3lab train`` arguments of one shipped run (relative paths, run from the repository root): its campaign
    unit's command (``unit_args``) into ``out_root/<name>`` when the run names one, else the recipe's
    ``common_args`` with the run's ``--set`` changes."""
    if "unit" in run:
        unit = next(u for u in campaign_units(recipe) if u["name"] == run["unit"])
        return unit_args(recipe, unit, out_root, out_name=run["name"])
    args = [recipe["base_config"]]
    for item in run.get("set", []):
        args += ["--set", item]
    return args + list(recipe["common_args"]) + ["--out", f"{out_root}/{run['name']}"]


def command(recipe: dict, run: dict) -> str:
    return "k3lab train " + shlex.join(run_args(recipe, run))


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def readme_table(recipe: dict, root: Path = SAMPLES) -> str:
    """Markdown table of the finished runs (name, change, seed, params, val bits/byte, MQAR, time, tokens, size)."""
    rows = [
        "| run | what differs | seed | params total / active | val bits/byte | MQAR acc | train time | tokens | size |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in recipe["runs"]:
        path = root / run["name"] / "metrics.json"
        if not path.is_file():
            rows.append(f"| `{run['name']}` | {run['differs']} | | (not trained) | | | | | |")
            continue
        m = json.loads(path.read_text())
        fin = m["final"] or {}
        size = sum(f.stat().st_size for f in (root / run["name"]).glob("*.safetensors"))
        rows.append(
            f"| `{run['name']}` | {run['differs']} | {m['seed']} | {_fmt_params(m['params']['total'])} / "
            f"{_fmt_params(m['params']['active'])} | {fin.get('val_bpb', float('nan')):.3f} | "
            f"{fin.get('mqar_accuracy', float('nan')):.3f} | {fin.get('wall_time_s', 0) / 60:.1f} min | "
            f"{fin.get('tokens_seen', 0) / 1e6:.2f}M | {size / 1e6:.2f} MB |"
        )
    return "\n".join(rows)


def _replace_between(text: str, marker: str, body: str, where: Path) -> str:
    start, end = f"<!-- {marker} START -->", f"<!-- {marker} END -->"
    if start not in text or end not in text:
        raise SystemExit(f"{where}: missing the {start} / {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def checks_tables(root: Path = SAMPLES) -> str | None:
    """The README's comparison tables, printed from ``root/checks.json`` (``check_samples.py ... --compare --json``:
    every shipped sample's numbers, recomputed from its weights); None before it is written."""
    import check_samples

    path = root / CHECKS_FILE
    if not path.is_file():
        return None
    return check_samples.comparison_markdown(check_samples.runs_table(json.loads(path.read_text())))


CURVE_STEPS = (500, 1000, 1500, 2000, 2500, 3000, 4000, 6000, 8000, 9000)


def curves_table(recipe: dict, steps: tuple[int, ...] = CURVE_STEPS) -> str:
    """Markdown table of the trained run units' validation over training (``val_curve``: bits/byte / MQAR accuracy)
    at ``steps``; a step a unit did not validate at is left empty."""
    units = [u for u in campaign_units(recipe) if u["kind"] == "run" and u.get("val_curve") and unit_tokens(recipe, u)]
    rows = ["| step | " + " | ".join(f"{s:,}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for unit in units:
        at = {step: (bpb, mqar) for step, bpb, mqar in unit["val_curve"]}
        cells = [f"{at[s][0]:.3f} / {at[s][1]:.3f}" if s in at else "" for s in steps]
        rows.append(f"| `{unit['name']}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_table(recipe: dict, root: Path = SAMPLES) -> None:
    """Replace the shipped runs' table (TABLE markers), the campaign's (CAMPAIGN markers), its runs' validation
    curves (CURVES markers) and, once checks.json is written, the comparison tables (CHECKS markers) in the README."""
    readme = root / "README.md"
    text = _replace_between(readme.read_text(), "TABLE", readme_table(recipe, root), readme)
    text = _replace_between(text, "CAMPAIGN", campaign_table(recipe), readme)
    text = _replace_between(text, "CURVES", curves_table(recipe), readme)
    checks = checks_tables(root)
    if checks is not None:
        text = _replace_between(text, "CHECKS", checks, readme)
    readme.write_text(text)


def write_shipped_metrics(folder: Path, metrics: dict) -> None:
    """A shipped sample's metrics.json, without indentation: the seven samples' training histories indented took
    15.6 MiB of the working tree, which a device call carries whole (64 MiB at most); the numbers are the same, to the
    bit (``rerun_start`` compares them exactly)."""
    (folder / "metrics.json").write_text(json.dumps(metrics, separators=(",", ":")) + "\n")


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
    write_shipped_metrics(dest, metrics)
    (dest / "README.md").write_text(model_card(metrics))
    return dest


# ---------------------------------------------------------------------------------------------------- campaign
CORE_HOURS_PER_UNIT = 2.0
# A run trained on another device (a GPU) rounds differently from the CPU rerun, and training amplifies rounding
# about tenfold per 10 steps here (the k3-full-s0 start rerun with 2 threads instead of 1: loss equal at steps 10
# and 20, then 2e-6, 2e-4, 2e-3 relative at 30, 40, 50; gradient norm 1e-4, 3e-2, 9e-2), so its check is its
# first 10 steps within fp32 tolerance, not 50 bit for bit.
CROSS_DEVICE_CHECK_STEPS = 10
CROSS_DEVICE_RTOL = 1e-4
#: where a recorded run unit's folder is kept (beside recipe.json) until the runs replace the shipped samples
CAMPAIGN_FOLDER = "campaign"  # a unit must fit this much time of one core at the recorded step speed
RESULT_KEYS = ("val_bpb", "mqar_accuracy", "tokens_seen", "wall_time_s")


def campaign_units(recipe: dict) -> list[dict]:
    """Every unit of the campaign, sweeps' runs first, each with its ``kind`` ("sweep:<name>" or "run")."""
    campaign = recipe.get("campaign")
    if not campaign:
        return []
    units = [{**u, "kind": f"sweep:{sweep['name']}"} for sweep in campaign["sweeps"] for u in sweep["units"]]
    units += [{**u, "kind": "run"} for u in campaign["runs"]]
    names = [u["name"] for u in units]
    if len(set(names)) != len(names):
        raise SystemExit(f"campaign: duplicate unit names {sorted(n for n in names if names.count(n) > 1)}")
    return units


def unit_args(recipe: dict, unit: dict, out_root: str, out_name: str | None = None) -> list[str]:
    """``k3lab train`` arguments of one campaign unit: base config, its --set changes, the campaign's common
    arguments (a sweep's own when it has them; a run's followed by the chosen recall recipe's) less those the unit
    sets itself, the unit's arguments, its seed and ``--out out_root/<out_name, default the unit's name>``."""
    campaign = recipe["campaign"]
    common = list(campaign["common_args"])
    if unit["kind"].startswith("sweep:"):
        sweep = next(s for s in campaign["sweeps"] if f"sweep:{s['name']}" == unit["kind"])
        common = sweep.get("common_args", common)
    else:
        common += campaign.get("recall_recipe", {}).get("args", [])
    args = [recipe["base_config"]]
    for item in unit.get("set", []):
        args += ["--set", item]
    own = list(unit.get("args", []))
    return (
        args
        + _without_options(common, own)
        + own
        + ["--seed", str(unit["seed"]), "--out", f"{out_root}/{out_name or unit['name']}"]
    )


def _without_options(args: list[str], replaced: list[str]) -> list[str]:
    """``args`` less every option that ``replaced`` names (with its value, when it has one): a unit's own arguments
    replace the common ones, so its command names each option once."""
    names = {a for a in replaced if a.startswith("--")}
    kept, i = [], 0
    while i < len(args):
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if args[i] in names:
            i += 2 if takes_value else 1
            continue
        kept.append(args[i])
        i += 1
    return kept


def unit_config(recipe: dict, unit: dict):
    """The TrainConfig a unit's command makes, read by ``k3lab train``'s own parser (its flags, their defaults)."""
    from k3core.training import TrainConfig, parse_overrides
    from k3lab.train import build_parser

    ns = build_parser().parse_args(unit_args(recipe, unit, "x"))
    given = {k: v for k, v in vars(ns).items() if v is not None and k not in ("resume", "model", "overrides")}
    return TrainConfig.from_dict({**given, "model": ns.model, "overrides": parse_overrides(ns.overrides)})


def unit_tokens(recipe: dict, unit: dict) -> int:
    cfg = unit_config(recipe, unit)
    return cfg.steps * cfg.batch_size * cfg.seq_len


def active_matmul_params(model: str, overrides: dict) -> int:
    """Parameters a token multiplies through: every weight but the embedding, routed experts counted k / E (the
    step's matmul work per token is about proportional to it). Counted on the meta device: nothing allocated."""
    import torch

    from k3core.modeling.model import K3ForCausalLM
    from k3core.training.config import resolve_model_config

    config = resolve_model_config(model, overrides)
    with torch.device("meta"):
        net = K3ForCausalLM.from_config(config)
    routed_share = config.num_experts_per_token / config.num_experts if config.num_experts else 1.0
    total = 0.0
    for name, param in net.named_parameters():
        if "embed_tokens" in name:
            continue
        total += param.numel() * (routed_share if ".experts.w" in name else 1.0)
    return int(total)


def unit_hours(recipe: dict, unit: dict) -> float:
    """Estimated hours of one core: the unit's tokens at the campaign's recorded tokens/s (eager or compiled) for the
    base config, slowed in proportion to the unit config's :func:`active_matmul_params` (a wider or deeper unit),
    plus the recorded compile time for a unit that compiles (more steps than its eager ``compile_after``)."""
    speed = recipe["campaign"]["speed"]
    cfg = unit_config(recipe, unit)
    tok_s = speed["compiled_tokens_per_s"] if cfg.compile else speed["eager_tokens_per_s"]
    if cfg.overrides:
        tok_s *= active_matmul_params(cfg.model, {}) / active_matmul_params(cfg.model, cfg.overrides)
    compile_s = speed.get("compile_seconds", 0.0) if cfg.compile and cfg.steps > cfg.compile_after else 0.0
    return (unit_tokens(recipe, unit) / tok_s + compile_s) / 3600


def campaign_table(recipe: dict) -> str:
    """Markdown table of the campaign's units: seed, step shape (steps x batch x sequence), tokens, budget, status,
    where trained, wall time and results."""
    rows = [
        "| unit | kind | seed | steps x batch x seq | tokens | est. core-hours | status | trained on | wall time | "
        "val bits/byte | MQAR acc |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for unit in campaign_units(recipe):
        cfg = unit_config(recipe, unit)
        done = unit.get("result") or {}
        bpb = f"{done['val_bpb']:.3f}" if done else ""
        mqar = f"{done['mqar_accuracy']:.3f}" if done else ""
        wall = f"{done['wall_time_s'] / 60:.0f} min" if done else ""
        rows.append(
            f"| `{unit['name']}` | {unit['kind']} | {unit['seed']} | "
            f"{cfg.steps:,} x {cfg.batch_size} x {cfg.seq_len} | {unit_tokens(recipe, unit) / 1e6:.2f}M | "
            f"{unit_hours(recipe, unit):.2f} | {unit['status']} | "
            f"{unit.get('trained_on', '')} | {wall} | {bpb} | {mqar} |"
        )
    return "\n".join(rows)


def store_run(run_dir: Path, dest: Path) -> Path:
    """Copy a finished run's files (weights, config, metrics.json, model card; not its resume state, nor its
    TensorBoard events, whose curves metrics.json holds too) into ``dest``, replacing what was there: the
    campaign's runs live in the repository between sessions, as the shipped samples do."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for file in sorted(p for p in run_dir.iterdir() if p.is_file() and not p.name.startswith("events.out.tfevents")):
        shutil.copy2(file, dest / file.name)
    return dest


def record_unit(recipe_path: Path, name: str, run_dir: Path, device: str, store: Path | None = None) -> dict:
    """Mark a finished unit done in the recipe file: its results, code version, where and when it trained; a run
    unit (not a sweep's) is also copied into ``store/<name>`` (``store_run``) and its folder recorded.

    Refuses a run that did not finish (a unit cut off is trained again, never recorded) and a run whose
    configuration is not the unit's: any training field other than the runtime ones (``RUNTIME_FIELDS``: output
    folder, threads, progress, ...) that differs from what the unit's command sets."""
    from k3core.training import load_metrics

    recipe = load_recipe(recipe_path)
    unit = next((u for u in campaign_units(recipe) if u["name"] == name), None)
    if unit is None:
        raise SystemExit(f"{recipe_path}: no campaign unit named {name!r}")
    metrics = load_metrics(run_dir)
    if metrics["status"] != "finished":
        raise SystemExit(f"{run_dir}: the run did not finish ({metrics['status']}); train the unit again")
    from k3core.training.config import RUNTIME_FIELDS

    planned = unit_config(recipe, unit).to_dict()
    differs = sorted(
        k for k in planned if k not in RUNTIME_FIELDS and planned[k] != metrics["train_config"].get(k, planned[k])
    )
    if differs:
        raise SystemExit(f"{run_dir}: not unit {name!r} ({', '.join(differs)} differ from the unit's command)")
    entry = {
        "status": "done",
        "trained_on": device,
        "code_version": metrics["code_version"],
        "started": metrics["created"],
        "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "result": {k: metrics["final"][k] for k in RESULT_KEYS},
        "val_curve": [
            [e["step"], round(e["val_bpb"], 4), round(e["mqar_accuracy"], 4)] for e in metrics["history"]["val"]
        ],
    }
    if store is not None and unit["kind"] == "run":
        folder = store_run(run_dir, store / name)
        entry["folder"] = str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder)
    raw = json.loads(recipe_path.read_text())
    campaign = raw["campaign"]
    for target in [*campaign["runs"], *(u for s in campaign["sweeps"] for u in s["units"])]:
        if target["name"] == name:
            target.update(entry)
    recipe_path.write_text(json.dumps(raw, indent=1) + "\n")
    return entry


def ship_name(unit: dict) -> str:
    """The shipped folder of a campaign run unit: its sample's name for seed 0, ``<sample>-s<seed>`` otherwise."""
    return unit["sample"] if unit["seed"] == 0 else f"{unit['sample']}-s{unit['seed']}"


def ship_campaign(recipe_path: Path, root: Path = SAMPLES) -> list[Path]:
    """Replace the shipped samples by the campaign's runs, all at once (so every pair ships from one campaign):
    each done run unit's kept folder moves to ``root/<ship_name>`` (metrics.json gets its shipped name, folder and
    command; the model card is rewritten), the recipe's ``runs`` become those samples, each naming its unit (its
    command is the unit's), and the old shipped folders of the same names are replaced. Refuses while any run unit
    is not done or its folder is missing."""
    from k3core.training import load_metrics, model_card

    recipe = load_recipe(recipe_path)
    units = [u for u in campaign_units(recipe) if u["kind"] == "run"]
    waiting = [u["name"] for u in units if u["status"] != "done" or not (ROOT / u.get("folder", "-")).is_dir()]
    if waiting:
        raise SystemExit(f"the campaign is not finished: {waiting} not done (or their folders are missing)")
    raw = json.loads(recipe_path.read_text())
    raw["runs"] = [
        {"name": ship_name(u), "unit": u["name"], "differs": u["differs"], "set": list(u.get("set", []))} for u in units
    ]
    raw.pop("common_args", None)  # every shipped run's command is its unit's now
    folders = {u["name"]: root / ship_name(u) for u in units}
    shipped = []
    for unit in units:
        dest = folders[unit["name"]]
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(ROOT / unit["folder"]), dest)
        run = next(r for r in raw["runs"] if r["unit"] == unit["name"])
        metrics = load_metrics(dest)
        metrics["run_name"] = run["name"]
        metrics["train_config"]["out_dir"] = f"sample_checkpoints/{run['name']}"
        metrics["command"] = "k3lab train " + shlex.join(run_args(raw, run))
        write_shipped_metrics(dest, metrics)
        (dest / "README.md").write_text(model_card(metrics))
        shipped.append(dest)
    for target in raw["campaign"]["runs"]:
        if target["name"] in folders:
            dest = folders[target["name"]]
            target["folder"] = str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest)
    recipe_path.write_text(json.dumps(raw, indent=1) + "\n")
    return shipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", help="train only these runs")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at the same time (default 2)")
    p.add_argument("--log-dir", default="/tmp/k3samples", help="where the training logs go")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the commands and exit")
    p.add_argument(
        "--table",
        action="store_true",
        help="only rewrite the README's tables (runs, campaign, curves, and checks.json's comparison)",
    )
    p.add_argument("--recipe", default=str(RECIPE), help="recipe file (default sample_checkpoints/recipe.json)")
    p.add_argument("--stage", help="train into STAGE/<name>, then copy finished runs into sample_checkpoints/")
    c = p.add_argument_group('campaign (recipe.json\'s "campaign")')
    c.add_argument("--campaign", action="store_true", help="print every unit, its budget and status, and exit")
    c.add_argument("--unit", help="train this campaign unit into --stage (with --print: its command only)")
    c.add_argument("--record", nargs=2, metavar=("UNIT", "RUN_DIR"), help="mark a finished unit done in the recipe")
    c.add_argument(
        "--check-start",
        metavar="RUN_DIR",
        help="train RUN_DIR's recorded config again for --check-steps steps and compare its log bit for bit",
    )
    c.add_argument(
        "--check-steps",
        type=int,
        help=f"steps --check-start retrains (default 50; {CROSS_DEVICE_CHECK_STEPS} for a run trained elsewhere)",
    )
    c.add_argument(
        "--rtol",
        type=float,
        help=f"--check-start's relative tolerance (default 0: bit for bit; {CROSS_DEVICE_RTOL:g} for a run trained on "
        "another device)",
    )
    c.add_argument("--device", default="cpu, 1 thread", help="where a recorded unit trained (default 'cpu, 1 thread')")
    c.add_argument(
        "--ship",
        action="store_true",
        help="when every run unit is done: replace the shipped samples by them (then rebuild k3-mxfp4 and the README)",
    )
    args = p.parse_args(argv)
    recipe = load_recipe(Path(args.recipe))
    if args.campaign:
        print(campaign_table(recipe))
        return 0
    if args.check_start:
        import tempfile

        from k3core.training import load_metrics, rerun_start

        elsewhere = load_metrics(args.check_start).get("device", "cpu") != "cpu"
        steps = args.check_steps or (CROSS_DEVICE_CHECK_STEPS if elsewhere else 50)
        rtol = args.rtol if args.rtol is not None else (CROSS_DEVICE_RTOL if elsewhere else 0.0)
        with tempfile.TemporaryDirectory() as work:
            differs = rerun_start(args.check_start, Path(work) / "rerun", steps, device="cpu", rtol=rtol)
        how = f"within rtol {rtol:g}" if rtol else "bit for bit"
        print("\n".join(differs) or f"{args.check_start}: the first {steps} steps rerun on the CPU {how}")
        return 1 if differs else 0
    if args.ship:
        for dest in ship_campaign(Path(args.recipe)):
            print(f"shipped {dest}")
        write_table(load_recipe(Path(args.recipe)))
        return 0
    if args.record:
        store = Path(args.recipe).resolve().parent / CAMPAIGN_FOLDER
        entry = record_unit(Path(args.recipe), args.record[0], Path(args.record[1]), args.device, store)
        print(f"recorded {args.record[0]}: {entry['result']}")
        write_table(load_recipe(Path(args.recipe)))
        return 0
    if args.unit:
        unit = next((u for u in campaign_units(recipe) if u["name"] == args.unit), None)
        if unit is None:
            raise SystemExit(f"no campaign unit named {args.unit!r}; see --campaign")
        stage = str(Path(args.stage or "/tmp/k3campaign").resolve())
        cmd = [sys.executable, "-m", "k3lab", "train", *unit_args(recipe, unit, stage)]
        print("k3lab train " + shlex.join(cmd[4:]), flush=True)
        if args.print_only:
            return 0
        return subprocess.call(cmd, cwd=ROOT)
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
