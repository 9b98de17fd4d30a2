"""Measure sample runs against the samples' targets (recipe.json's campaign.targets), from their weights, and
compare their configurations against the seed-to-seed spread.

    python scripts/check_samples.py sample_checkpoints/k3-full          # a shipped sample
    python scripts/check_samples.py /tmp/k3c/k3-full-s0 /tmp/k3c/plain-residual-s0 --json /tmp/checks.json
    python scripts/check_samples.py /tmp/k3c/*-s[01] --compare          # the README's tables: runs, and each
                                                                        # config against k3-full and the seed noise

Per run, everything recomputed from the folder (the recorded numbers are printed beside the recomputed ones):

- ``val_bpb``: bits/byte on the validation windows metrics.json names (``evaluate_bits_per_byte``)
- ``mqar_accuracy``: MQAR accuracy on the recorded evaluation (8 pairs in 256 tokens, fixed seed), with its 95%
  Wilson interval and chance
- ``layers_above_noise``: layers with a sub-layer whose ablation raises the loss beyond its 95% noise floor
  (``analysis.metrics.importance.layers_above_noise``) on ``--tokens`` tokens of the held-out passage
- ``min_head_entropy``: the lowest normalised entropy of an MLA head on the same tokens (uniform attention: 1)
- ``real_word_share``: the share of the model card's sample's words (3+ letters) found in the training text
  (``analysis.metrics.text_quality``; untrained 0, held-out text 0.95-0.99), with its Wilson interval

The targets apply to the run that ships as ``k3-full``; every run's numbers are printed for the README.

``--compare`` adds, per run, the view numbers the samples' README reads (``analysis.metrics.headline`` on the same
held-out tokens: MLA entropy and sinks, rank collapse, MoE balance, AttnRes embedding weight, KDA half-lives; recall
accuracy by distance, ``analysis.experiments.long_runs``) and prints two markdown tables: every number per run, and
each config's seed mean against the reference config's with the seed noise (``analysis.compare.seeds``: the
largest spread between two seeds of one config). A run's config is its folder name less a ``-s<seed>`` suffix.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "sample_checkpoints" / "recipe.json"
CHECK_TOKENS = 512
REFERENCE_CONFIG = "k3-full"
RECALL_EXAMPLES = 128  # per distance: a Wilson interval of about +-0.08 at 0.5
#: the headline numbers the comparison reads (analysis.metrics.headline.HEADLINE_LABELS names them)
COMPARED_HEADLINES = (
    "bits_per_byte",
    "mla_entropy_norm_mean",
    "sink_rate",
    "rank_collapse_mean",
    "block_influence_mean",
    "moe_maxvio_max",
    "moe_entropy_norm_mean",
    "moe_dead_experts",
    "attnres_embedding_weight_mean",
    "kda_half_life_median",
    "kda_half_life_inf_share",
)
#: the numbers of ``measure`` that the comparison tables carry, in order
COMPARED_CHECKS = (
    "val_bpb",
    "mqar_accuracy",
    "layers_above_noise",
    "min_head_entropy",
    "real_word_share",
)
_OPERATORS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def parse_target(text: str) -> tuple[str, float]:
    """``"<= 2.05"`` or ``">= 0.5 (8 pairs in 256 tokens)"`` -> (operator, value); the words after the number are
    a comment."""
    parts = text.split()
    if len(parts) < 2 or parts[0] not in _OPERATORS:
        raise ValueError(f"target {text!r}: expected '<op> <number> [comment]' with op in {sorted(_OPERATORS)}")
    return parts[0], float(parts[1])


def meets(value: float, target: str) -> bool:
    """Whether ``value`` meets a target string (``parse_target``)."""
    op, bound = parse_target(target)
    return bool(_OPERATORS[op](value, bound))


def measure(run_dir: Path, tokens: int = CHECK_TOKENS) -> dict:
    """The checked numbers of one run folder (module docstring), recomputed from its weights."""
    import torch

    from analysis.metrics.attention import attention_entropy_table
    from analysis.metrics.importance import ablation_importance, layers_above_noise
    from analysis.metrics.intervals import wilson_interval
    from analysis.metrics.text_quality import real_word_share, vocabulary
    from analysis.runs.loading import load_run, trace_run
    from analysis.runs.texts import sample_input
    from k3core.data.mqar import mqar_chance
    from k3core.training import TrainConfig, evaluate_bits_per_byte, evaluate_mqar, load_corpus, load_metrics

    metrics = load_metrics(run_dir)
    run = load_run(run_dir)
    model = run.model
    corpus = load_corpus(TrainConfig.from_dict(metrics["train_config"]))
    ev = metrics["eval"]
    _, bpb = evaluate_bits_per_byte(model, corpus.val, ev["window_starts"], ev["seq_len"], ev["batch_size"])
    mq = ev["mqar"]
    mqar = evaluate_mqar(model, mq["examples"], mq["seq_len"], mq["num_kv_pairs"], seed=mq["seed"])
    answers = mq["examples"] * mq["num_kv_pairs"]
    text = sample_input("shakespeare", run.config, tokens, run.tokenizer)
    with torch.no_grad():
        importance = ablation_importance(model, text.input_ids)
    entropy = attention_entropy_table(trace_run(run, text, what={"mla"}, max_attn_len=tokens).trace)
    lowest = entropy.loc[entropy["entropy_norm"].idxmin()] if len(entropy) else None
    sample = (metrics.get("sample") or {}).get("text", "")
    share, n_words = real_word_share(sample, vocabulary([bytes(corpus.train).decode("utf-8", "replace")]))
    above = layers_above_noise(importance)
    return {
        "run": str(run_dir),
        "seed": metrics["seed"],
        "steps": (metrics["final"] or {}).get("step"),
        "val_bpb": bpb,
        "val_bpb_recorded": (metrics["final"] or {}).get("val_bpb"),
        "mqar_accuracy": mqar,
        "mqar_interval": [float(x) for x in wilson_interval(round(mqar * answers), answers)],
        "mqar_chance": mqar_chance(),
        "mqar_accuracy_recorded": (metrics["final"] or {}).get("mqar_accuracy"),
        "layers_above_noise": len(above),
        "layers_above_noise_list": above,
        "num_layers": run.config.num_hidden_layers,
        "check_tokens": int(text.input_ids.shape[-1]),
        "min_head_entropy": float(lowest["entropy_norm"]) if lowest is not None else float("nan"),
        "min_head_entropy_at": [int(lowest["layer"]), int(lowest["head"])] if lowest is not None else None,
        "real_word_share": share,
        "real_word_interval": [float(x) for x in wilson_interval(round(share * n_words), n_words)] if n_words else None,
        "sample_words": n_words,
    }


def view_numbers(run_dir: Path, tokens: int = CHECK_TOKENS) -> dict[str, float]:
    """The headline numbers ``COMPARED_HEADLINES`` on ``tokens`` held-out tokens and the recall accuracy at each
    default distance (``recall_d<distance>``) of one run folder."""
    import torch

    from analysis.experiments.long_runs import recall_by_distance
    from analysis.metrics.headline import headline_numbers
    from analysis.runs.loading import load_run, trace_run
    from analysis.runs.texts import sample_input

    run = load_run(run_dir)
    ctx = trace_run(run, sample_input("shakespeare", run.config, tokens, run.tokenizer), what="all")
    found = headline_numbers(ctx)
    out = {key: float(found.get(key, float("nan"))) for key in COMPARED_HEADLINES}
    with torch.no_grad():
        recall = recall_by_distance(run.model, examples=RECALL_EXAMPLES)
    out.update({f"recall_d{int(r.distance)}": float(r.accuracy) for r in recall.itertuples()})
    return out


def config_of(run_dir: str | Path) -> str:
    """A run's config name: its folder name less a ``-s<seed>`` suffix (``k3-full-s1`` -> ``k3-full``)."""
    import re

    return re.sub(r"-s\d+$", "", Path(run_dir).name)


def shipped_samples(root: Path = ROOT / "sample_checkpoints", one_per_config: bool = False) -> list[str]:
    """The shipped sample folders' names (a folder with a config.json), sorted; ``one_per_config`` leaves out the
    second seeds (``config_of(name) != name``), whose code paths are their first seed's: what tests that draw every
    view of every sample need once."""
    names = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
    return [n for n in names if config_of(n) == n] if one_per_config else names


def runs_table(found: list[dict]):
    """The tidy (run, config, seed, metric, value) table of measured runs (``analysis.compare.seeds``' input)."""
    import pandas as pd

    rows = []
    for f in found:
        keys = [*COMPARED_CHECKS, *(k for k in f if k in COMPARED_HEADLINES or k.startswith("recall_d"))]
        rows += [(Path(f["run"]).name, config_of(f["run"]), f["seed"], k, float(f[k])) for k in keys]
    return pd.DataFrame(rows, columns=["run", "config", "seed", "metric", "value"])


def comparison_markdown(table, reference: str = REFERENCE_CONFIG) -> str:
    """Two markdown tables: every number per run, and each config against ``reference`` with the seed noise."""
    from analysis.compare.seeds import config_differences
    from analysis.metrics.headline import HEADLINE_LABELS

    runs = list(dict.fromkeys(table["run"]))
    wide = table.pivot(index="metric", columns="run", values="value")
    metrics = list(dict.fromkeys(table["metric"]))
    label = {**HEADLINE_LABELS, **METRIC_LABELS}
    label.update({m: f"recall at distance {m[len('recall_d') :]} ({RECALL_EXAMPLES} examples)" for m in metrics
                  if m.startswith("recall_d")})  # fmt: skip
    lines = ["| metric | " + " | ".join(f"`{r}`" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for m in metrics:
        lines.append(f"| {label.get(m, m)} | " + " | ".join(_fmt(wide.loc[m, r]) for r in runs) + " |")
    diff = config_differences(table, reference)
    configs = list(dict.fromkeys(diff["config"]))
    lines += ["", f"| metric | `{reference}` | seed noise | " + " | ".join(f"`{c}` - `{reference}`" for c in configs)
              + " |", "|---|---|---|" + "---|" * len(configs)]  # fmt: skip
    by = diff.set_index(["metric", "config"])
    per_metric = diff.groupby("metric")[["reference_value", "noise"]].first()  # one value per metric in any config
    for m in metrics:
        cells = []
        for c in configs:
            if (m, c) not in by.index:
                cells.append("")
                continue
            row = by.loc[(m, c)]
            verdict = {True: " **beyond**", False: " within", None: ""}[row["beyond"]]
            cells.append(f"{row['delta']:+.3f}{verdict}")
        ref, noise = per_metric.loc[m] if m in per_metric.index else (float("nan"), float("nan"))
        lines.append(f"| {label.get(m, m)} | {_fmt(ref)} | {_fmt(noise)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


METRIC_LABELS = {
    "val_bpb": "val bits/byte (training's validation)",
    "mqar_accuracy": "MQAR accuracy (8 pairs, 256 tokens)",
    "layers_above_noise": "layers above the importance noise floor",
    "min_head_entropy": "lowest MLA head entropy (normalised)",
    "real_word_share": "real-word share of the card's sample",
}


def _fmt(value: float) -> str:
    import math

    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def target_rows(found: dict, targets: dict[str, str]) -> list[tuple[str, float, str, bool]]:
    """(name, value, target, met) for every target this run's numbers name (``"k3-full val_bpb"`` -> ``val_bpb``)."""
    rows = []
    for name, target in targets.items():
        key = name.rsplit(" ", 1)[-1]
        if key in found:
            rows.append((key, found[key], target, meets(found[key], target)))
    return rows


def report(found: dict, targets: dict[str, str]) -> str:
    """A short text block of one run's numbers and its targets."""
    lo, hi = found["mqar_interval"]
    lines = [
        f"{found['run']} (seed {found['seed']}, {found['steps']} steps)",
        f"  val bits/byte       {found['val_bpb']:.4f} (recorded {found['val_bpb_recorded']:.4f})",
        f"  MQAR accuracy       {found['mqar_accuracy']:.3f} [{lo:.3f}, {hi:.3f}] (recorded "
        f"{found['mqar_accuracy_recorded']:.3f}; chance {found['mqar_chance']:.3f})",
        f"  layers above noise  {found['layers_above_noise']} of {found['num_layers']} "
        f"{found['layers_above_noise_list']} on {found['check_tokens']} held-out tokens",
        f"  lowest MLA entropy  {found['min_head_entropy']:.3f} (layer, head {found['min_head_entropy_at']}; "
        "uniform 1)",
        f"  real-word share     {found['real_word_share']:.3f} of {found['sample_words']} words "
        + ("[{:.3f}, {:.3f}]".format(*found["real_word_interval"]) if found["real_word_interval"] else ""),
    ]
    for key, value, target, met in target_rows(found, targets):
        op, bound = parse_target(target)
        lines.append(f"  target {key} {op} {bound:g}: {value:.3f} {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (config.json, weights, metrics.json)")
    p.add_argument("--tokens", type=int, default=CHECK_TOKENS, help=f"held-out tokens (default {CHECK_TOKENS})")
    p.add_argument("--json", help="also write every number to this JSON file")
    p.add_argument("--compare", action="store_true", help="also the view numbers, and the comparison tables")
    p.add_argument("--reference", default=REFERENCE_CONFIG, help=f"the config compared against ({REFERENCE_CONFIG})")
    args = p.parse_args(argv)
    targets = json.loads(RECIPE.read_text())["campaign"]["targets"]
    found = []
    for run_dir in args.runs:
        found.append(measure(Path(run_dir), args.tokens))
        print(report(found[-1], targets), flush=True)
        if args.compare:
            found[-1].update(view_numbers(Path(run_dir), args.tokens))
    if args.compare:
        print()
        print(comparison_markdown(runs_table(found), args.reference))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
