"""``k3lab train``: the command line over :func:`k3core.training.train` (also ``python -m k3lab train``).

k3lab train k3-mini --steps 2000 --out runs/mini            # a preset
k3lab train my_config.json --set residual=plain --out runs/p  # a config.json, with overrides
k3lab train --resume runs/mini                                # continue an interrupted run
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from k3core.modeling.config import ConfigError
from k3core.training import TrainConfig, TrainError, load_metrics, parse_overrides, train
from k3core.utils.files import OutputFolderError
from k3core.utils.input_limits import MAX_SEED, MAX_THREADS, MAX_TOKENS, MAX_TRAIN_STEPS
from k3lab.options import Parser, arg_float, arg_int

MAX_BATCH = 1 << 16  # sequences in one batch (training or validation)
MAX_EVAL_ITEMS = 1 << 20  # validation windows, MQAR validation sequences


def build_parser() -> argparse.ArgumentParser:
    """The ``k3lab train`` argument parser (defaults shown in --help come from TrainConfig)."""
    d = TrainConfig()
    p = Parser(
        prog="k3lab train",
        description="Train a K3 config on bytes (Shakespeare by default) on this machine, with periodic "
        "validation (bits per byte, MQAR accuracy), atomic checkpoints and exact resume.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  k3lab train k3-nano --steps 200 --out runs/nano\n"
        "  k3lab train k3-mini --set residual=plain --set num_experts=8 --out runs/plain\n"
        "  k3lab train my_config.json --data notes/ --mqar-fraction 0.1 --out runs/mine\n"
        "  k3lab train --resume runs/mini          (after Ctrl-C or --stop-at)\n\n"
        "Ctrl-C saves a checkpoint and exits; at most --save-every steps are lost on a crash.",
    )
    p.add_argument("model", nargs="?", help=f"preset name, config.json or checkpoint folder (default {d.model})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a K3Config field (JSON value), repeatable: --set residual=plain",
    )
    p.add_argument("--out", dest="out_dir", help="run directory (default runs/<model name>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--data", help=f"'shakespeare' or a text file / folder (default {d.data})")
    p.add_argument("--val-plays", nargs="+", help="Shakespeare plays held out for validation")
    g = p.add_argument_group("schedule")
    g.add_argument(
        "--steps",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help=f"total optimizer steps (default {d.steps}, at most {MAX_TRAIN_STEPS:,}; 0: no training, the run is its "
        "seed's initialisation, validated: the untrained reference to hold trained runs against)",
    )
    g.add_argument("--batch-size", type=arg_int(1, MAX_BATCH), help=f"sequences per step (default {d.batch_size})")
    g.add_argument("--seq-len", type=arg_int(1, MAX_TOKENS), help=f"bytes per sequence (default {d.seq_len})")
    g.add_argument("--lr", type=arg_float(1e-12, 10), help=f"peak learning rate (default {d.lr})")
    g.add_argument(
        "--min-lr-ratio", type=arg_float(0, 1), help=f"final lr / peak lr of the cosine (default {d.min_lr_ratio})"
    )
    g.add_argument(
        "--warmup",
        dest="warmup_steps",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help=f"linear warmup steps (default {d.warmup_steps})",
    )
    g.add_argument("--weight-decay", type=arg_float(0, 100), help=f"AdamW decay on matrices (default {d.weight_decay})")
    g.add_argument("--beta1", type=arg_float(0, 0.999999), help=f"AdamW beta1 (default {d.beta1})")
    g.add_argument("--beta2", type=arg_float(0, 0.999999), help=f"AdamW beta2 (default {d.beta2})")
    g.add_argument(
        "--grad-clip", type=arg_float(0, 1_000_000), help=f"global grad-norm clip, 0 = off (default {d.grad_clip})"
    )
    g.add_argument("--seed", type=arg_int(0, MAX_SEED), help=f"seed for init and data order (default {d.seed})")
    g.add_argument(
        "--mqar-fraction",
        type=arg_float(0, 1),
        help=f"share of MQAR rows in training batches (default {d.mqar_fraction})",
    )
    g.add_argument(
        "--mqar-kv-pairs", type=arg_int(1, MAX_TOKENS // 3), help=f"MQAR key-value pairs (default {d.mqar_kv_pairs})"
    )
    g.add_argument(
        "--mqar-queries",
        type=arg_int(1, MAX_TOKENS),
        help="queries per MQAR training row (default: one per pair; more asks keys again, a denser recall signal; "
        "validation always asks each pair once)",
    )
    g.add_argument(
        "--mqar-curriculum",
        dest="mqar_curriculum_steps",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help="steps over which MQAR rows grow from --mqar-pairs-start pairs to --mqar-kv-pairs "
        "(default 0: no curriculum)",
    )
    g.add_argument(
        "--mqar-pairs-start",
        dest="mqar_kv_pairs_start",
        type=arg_int(1, MAX_TOKENS // 3),
        help="MQAR pairs of a row at step 0 of the curriculum (default 1)",
    )
    g.add_argument(
        "--mqar-span-start",
        type=arg_int(1, MAX_TOKENS),
        help="with --mqar-curriculum: MQAR rows are packed from independent examples this many tokens long at "
        "step 0, growing to --seq-len (a length curriculum: recall is found over short distances first; "
        "default: one example per row throughout)",
    )
    g.add_argument(
        "--mqar-loss-weight",
        type=arg_float(1e-6, 1e6),
        help=f"weight of an MQAR answer in the training loss, a text byte weighing 1 (default {d.mqar_loss_weight})",
    )
    e = p.add_argument_group("evaluation, logging, checkpoints")
    e.add_argument(
        "--eval-every",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help=f"validate every N steps, 0 = only at the end (default {d.eval_every})",
    )
    e.add_argument(
        "--eval-windows", type=arg_int(1, MAX_EVAL_ITEMS), help=f"validation windows (default {d.eval_windows})"
    )
    e.add_argument("--eval-batch-size", type=arg_int(1, MAX_BATCH), help=f"(default {d.eval_batch_size})")
    e.add_argument(
        "--mqar-eval-examples",
        type=arg_int(1, MAX_EVAL_ITEMS),
        help=f"MQAR validation sequences (default {d.mqar_eval_examples})",
    )
    e.add_argument(
        "--log-every",
        type=arg_int(1, MAX_TRAIN_STEPS),
        help=f"history / MoE-load interval in steps (default {d.log_every})",
    )
    e.add_argument(
        "--save-every",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help=f"checkpoint every N steps, 0 = only on exit (default {d.save_every})",
    )
    e.add_argument(
        "--stop-at", type=arg_int(1, MAX_TRAIN_STEPS), help="save and stop after this step (resume later with --resume)"
    )
    e.add_argument(
        "--keep-state",
        action="store_true",
        default=None,
        help="keep the optimizer/RNG resume state after the run finishes",
    )
    e.add_argument(
        "--sample-tokens",
        type=arg_int(0, MAX_TOKENS),
        help=f"bytes generated for the model card (default {d.sample_tokens})",
    )
    e.add_argument("--prompt", dest="sample_prompt", help=f"prompt of the sample (default {d.sample_prompt!r})")
    r = p.add_argument_group("machine")
    r.add_argument("--device", help="cpu, cuda, cuda:1, or auto (default: cuda when available)")
    r.add_argument("--threads", type=arg_int(1, MAX_THREADS), help="torch CPU threads")
    r.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="train through torch.compile: the first step compiles (minutes on a CPU), later steps run faster; "
        "pays back on runs of a few thousand steps (benchmarks/README, 'torch.compile')",
    )
    r.add_argument(
        "--compile-after",
        type=arg_int(0, MAX_TRAIN_STEPS),
        help="with --compile: run the first STEPS eager, then compile (an eager rerun of a run's start then checks "
        "it bit for bit, without minutes of compiling; compiled steps round differently; default 0)",
    )
    r.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    return p


def _args_to_dict(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"resume", "model", "overrides"}
    return {k: v for k, v in vars(args).items() if k not in skip and v is not None}


def main(argv: list[str] | None = None) -> int:
    """``k3lab train ...``: returns 0 when the run finished or stopped at --stop-at, 130 on Ctrl-C, 2 on errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = "k3lab train " + shlex.join(argv)
    try:
        given = _args_to_dict(args)
        if args.resume:
            if args.model or args.overrides:
                raise TrainError("--resume continues a run with its stored config; do not pass a model or --set")
            if args.out_dir and Path(args.out_dir) != Path(args.resume):
                raise TrainError("--resume RUN_DIR already names the run directory; drop --out")
            given["out_dir"] = args.resume
            path = train(given, resume=True, command=command)
        else:
            model = args.model or TrainConfig.model
            overrides = parse_overrides(args.overrides)
            given.setdefault("out_dir", str(Path("runs") / Path(model).stem))
            path = train(TrainConfig.from_dict({**given, "model": model, "overrides": overrides}), command=command)
    except (TrainError, ConfigError, OutputFolderError) as exc:
        print(f"k3lab train: error: {exc}", file=sys.stderr)
        return 2
    metrics = load_metrics(path)
    status = metrics["status"]
    if status == "finished":
        fin = metrics["final"]
        print(
            f"finished {path}: val {fin['val_bpb']:.3f} bits/byte (unigram "
            f"{metrics['data']['unigram_baseline_bpb']:.3f}), MQAR acc {fin['mqar_accuracy']:.3f}, "
            f"{fin['tokens_seen']:,} tokens in {fin['wall_time_s'] / 60:.1f} min"
        )
        return 0
    print(f"{status} after step {metrics['step']}; checkpoint saved. Continue with: k3lab train --resume {path}")
    return 130 if status == "interrupted" else 0
