"""The random-initialised twin of a run: the same config with untrained weights (seeded), traced on the same tokens,
so any view can be drawn for it beside the trained run and learned structure told apart from initialisation.

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


@lru_cache(maxsize=4)
def _twin_model(digest: str, config_json: str, seed: int):
    from k3core.modeling.model import K3ForCausalLM

    config = K3Config.from_dict(json.loads(config_json))
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return K3ForCausalLM.from_config(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)  # the caller's random stream is left as it was


def untrained_twin(run: Run, seed: int = TWIN_SEED) -> Run:
    """The run's config with freshly initialised weights (``torch.manual_seed(seed)``), as a Run on the CPU in fp32
    with the run's tokenizer; built once per (config, seed). Raises ValueError for a config too large
    (``twin_too_large``)."""
    why = twin_too_large(run.config)
    if why:
        raise ValueError(why)
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
