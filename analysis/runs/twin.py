"""The random-initialised twin of a run: the same config with untrained weights, traced on the same tokens, so any
view can be drawn for it beside the trained run and learned structure told apart from initialisation.

The weights are those a ``k3lab train`` run of the config with the run's seed starts from
(``k3core.training.initial_model``; seed 0 for a run with no recorded seed): for a run trained here, its own
initialisation, which is also what ``k3lab train --steps 0`` saves (the shipped ``untrained`` sample).

Only for runs small enough to build here (``TWIN_MAX_PARAMETERS``); a larger one gets ``twin_too_large``'s note.
The twin is built once per (config, seed) (``untrained_twin``), its fingerprint names both.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import torch

from analysis.runs.loading import Run
from k3core.modeling.config import K3Config

#: a twin is built only up to this many parameters (fp32: 4 bytes each, 2 GB at the limit)
TWIN_MAX_PARAMETERS = 500_000_000
#: the seed of a run's twin when the run records none (a checkpoint not trained by k3lab)
TWIN_SEED = 0
TWIN_SUFFIX = " (untrained twin)"


def config_parameters(config: K3Config) -> int:
    """The parameter count of a config, from a shapes-only model (no memory for the weights)."""
    from k3core.modeling.model import K3ForCausalLM

    return int(K3ForCausalLM.from_config(config, device="meta").num_parameters())


def twin_too_large(config: K3Config) -> str | None:
    """Why no twin is built for this config (its size), or None when one is."""
    n = config_parameters(config)
    if n > TWIN_MAX_PARAMETERS:
        return (
            f"No untrained twin: this config has {n:,} parameters, more than the {TWIN_MAX_PARAMETERS:,} built here "
            "at random (compare with a small config of the same shape, or an early checkpoint, instead)."
        )
    return None


def config_digest(config: K3Config) -> str:
    """A short digest of the config's fields: the twin's cache key and fingerprint."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_seed(run: Run) -> int:
    """The seed the run trained with (its metrics.json), or ``TWIN_SEED`` when it records none."""
    seed = (run.metrics or {}).get("seed")
    return int(seed) if isinstance(seed, int) else TWIN_SEED


@lru_cache(maxsize=4)
def _twin_model(digest: str, config_json: str, seed: int):
    from k3core.training import initial_model

    config = K3Config.from_dict(json.loads(config_json))
    generator_state = torch.random.get_rng_state()
    try:
        return initial_model(config, seed).eval()
    finally:
        torch.random.set_rng_state(generator_state)  # the caller's random stream is left as it was


def untrained_twin(run: Run, seed: int | None = None) -> Run:
    """The run's config with the initial weights of a run with ``seed`` (default: the run's own, ``run_seed``), as
    a Run on the CPU in fp32 with the run's tokenizer; built once per (config, seed). Raises ValueError for a config
    too large (``twin_too_large``)."""
    why = twin_too_large(run.config)
    if why:
        raise ValueError(why)
    seed = run_seed(run) if seed is None else seed
    digest = config_digest(run.config)
    model = _twin_model(digest, json.dumps(run.config.to_dict(), sort_keys=True, default=str), seed)
    return Run(
        model=model,
        config=model.config,
        metrics=None,
        card={"twin_of": run.label, "seed": seed},
        path=Path(f"{run.label}{TWIN_SUFFIX}"),
        fingerprint=f"twin-{digest}-seed{seed}",
        tokenizer=run.tokenizer,
    )
