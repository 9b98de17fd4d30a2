"""Training a K3 config on bytes: the :func:`train` API (its command line is ``k3lab train``, in k3lab/train.py).

    k3lab train k3-mini --steps 2000 --out runs/mini            # a preset
    k3lab train my_config.json --set residual=plain --out runs/p  # a config.json, with overrides
    k3lab train --resume runs/mini                                # continue an interrupted run

One job per module:

    config     TrainConfig (validated), --set overrides, the model config and corpus a run names
    schedule   lr_at: linear warmup, then cosine decay
    evaluate   evaluate_bits_per_byte, evaluate_mqar (reproducible from a checkpoint + metrics.json)
    loop       train() and the Trainer: the step, validation, checkpoints, Ctrl-C, exact resume
    history    what metrics.json records (its schema)
    rundir     the run directory's files: metrics.json, resume checkpoints, optimizer/RNG state
    reproduce  rerun_start: a finished run's first steps trained again and compared bit for bit
    card       the model card (README.md) of a finished run
"""

from .card import model_card
from .config import (
    RUNTIME_FIELDS,
    TrainConfig,
    TrainError,
    derive_seed,
    initial_model,
    load_corpus,
    parse_overrides,
    resolve_model_config,
)
from .evaluate import LN2, MQAR_EVAL_SEED, evaluate_bits_per_byte, evaluate_mqar
from .loop import Trainer, train
from .reproduce import rerun_start
from .rundir import METRICS_NAME, STATE_DIR, latest_state_dir, load_metrics
from .schedule import lr_at

__all__ = [
    "LN2",
    "METRICS_NAME",
    "MQAR_EVAL_SEED",
    "RUNTIME_FIELDS",
    "STATE_DIR",
    "TrainConfig",
    "TrainError",
    "Trainer",
    "derive_seed",
    "evaluate_bits_per_byte",
    "evaluate_mqar",
    "initial_model",
    "latest_state_dir",
    "load_corpus",
    "load_metrics",
    "lr_at",
    "rerun_start",
    "model_card",
    "parse_overrides",
    "resolve_model_config",
    "train",
]
