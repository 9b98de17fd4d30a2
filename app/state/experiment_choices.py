"""The Experiment page's pieces that are not drawing: the edit menus' choices for a run, token labels, and the
session's results (a result is kept per run, text and edits, so a rerun shows it again)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from analysis.experiments import effects
from analysis.runs import texts
from app.state.inputs import options_key
from k3core.interp.catalogue import hook_points
from k3core.modeling.hooks import HookNames
from k3core.utils.input_limits import shown

KINDS = {
    "moe": "MoE routing",
    "attnres": "AttnRes depth weights",
    "kda": "KDA gates and state",
    "mla": "MLA keys",
    "value": "Any hook point (zero / scale / add / replace)",
}
OP_LABELS = {
    "ban": "ban experts (never selected)",
    "force": "force experts (always selected)",
    "uniform": "uniform routing weights",
    "bias_off": "selection bias off",
    "shared_off": "shared experts off",
    "pin_g": "pin the decay g",
    "scale_g": "scale the decay g",
    "scale_beta": "scale beta",
    "reset_state": "reset the state before a position",
    "gate_off": "output gate off",
    "reset_chunk_state": "reset the state at chunk ends",
    "scale_chunk_state": "scale the state at chunk ends",
    "mask_keys": "mask a key range",
    "zero": "zero",
    "scale": "scale",
    "add": "add",
    "replace": "replace",
}
RESULTS = "k3lab_exp_results"
HISTORY = "k3lab_exp_history"  # this session's experiments: one row each, in the order they ran
#: patching / attribution jobs of more forwards than this are estimated and confirmed before they run
CONFIRM_FORWARDS = 64


def chunk_labels(tokens: int, chunk_size: int) -> dict[int, str]:
    """KDA chunks of a forward over ``tokens`` tokens: {n: "chunk n (ends after token e)"}, e = min((n + 1) C, T)
    (the ``kda.chunk_state`` point's numbering)."""
    return {
        n: f"chunk {n} (ends after token {min((n + 1) * chunk_size, tokens)})" for n in range(-(-tokens // chunk_size))
    }


def layers_with(config: Any, point: str) -> list[int]:
    """Layers that have hook point ``point`` (e.g. "moe.selection", "kda.g", "mla.key_mask")."""
    names = set(hook_points(config))
    return [i for i in range(config.num_hidden_layers) if HookNames.block(i, point) in names]


def value_points(config: Any) -> list[str]:
    """Hook points a value edit may touch (without the layer prefix), in forward order, once each."""
    seen: list[str] = []
    for name in hook_points(config):
        local = HookNames.point_of(name)
        if local in ("tokens", "token_nll", "mla.key_mask", "moe.experts", "stream", "final_stream"):
            continue
        if local not in seen:
            seen.append(local)
    return seen


def token_labeler(run: Any) -> Callable[[int], str]:
    """A short readable label of a token id (the run's tokenizer; the id itself without one)."""
    try:
        tok = texts.text_tokenizer(run.config, run.tokenizer)
    except ValueError:
        return str
    return lambda i: repr(tok.token_strings([int(i)])[0])[1:-1] or "∅"


def remember(store: dict, key: tuple, value: Any, keep: int = 8) -> Any:
    """Keep a result under ``key`` (the oldest dropped past ``keep``) and return it."""
    store[key] = value
    while len(store) > keep:
        store.pop(next(iter(store)))
    return value


def with_spec(loaded: Any, **spec: Any) -> Any:
    """``loaded`` (an ``app.render.caching.Loaded``) with an experiment's inputs (``analysis.figures.experiment``:
    edits, patching, attribution, lens_value) in its view options and in its figure-cache key, as picks travel."""
    return replace(loaded, ctx=loaded.ctx.with_options(**spec), key=(*loaded.key, ("experiment", options_key(spec))))


def experiment_logits(store: dict, loaded: Any, edits: list[dict]) -> tuple[Any, Any]:
    """(baseline, edited) logits of the first text row on the CPU (``effects.run_experiment``), kept in ``store``
    per run, text and edits (for the prediction-change table, which needs the logits, not only the losses)."""
    from k3core.interp.interventions import edit_from_dict

    key = ("logits", loaded.key, json.dumps(edits))
    if key not in store:
        model = loaded.model
        ids = loaded.ctx.input_ids[:1].to(next(model.parameters()).device)
        exp = effects.run_experiment(model, ids, [edit_from_dict(d) for d in edits])
        remember(store, key, (exp.base_logits.cpu(), exp.edited_logits.cpu()))
    return store[key]


def one_token(run: Any, text: str, what: str) -> int:
    """The id of ``text`` read as exactly one token of the run's tokenizer; ValueError naming ``what`` otherwise."""
    tok = texts.text_tokenizer(run.config, run.tokenizer)
    ids = tok.encode(text) if text else []
    if len(ids) != 1:
        raise ValueError(f"{what} must be one token; {shown(text)} is {len(ids)} tokens")
    return int(ids[0])


def text_ids(run: Any, text: str, what: str) -> list[int]:
    """The token ids of ``text`` (at least one); ValueError naming ``what`` when it is empty."""
    ids = texts.text_tokenizer(run.config, run.tokenizer).encode(text) if text else []
    if not ids:
        raise ValueError(f"{what} is empty: type at least one character")
    return [int(i) for i in ids]


def history_row(edits: list[dict], summary: dict, tokens: int) -> dict:
    """One row of the session's experiment history: the edits, losses, loss change and top-1 changes."""
    from k3core.interp.interventions import edit_from_dict

    return {
        "edits": "; ".join(edit_from_dict(d).describe() for d in edits),
        "base loss": summary["base_loss"],
        "edited loss": summary["edited_loss"],
        "loss change": summary["loss_change"],
        "top-1 changes": summary["positions_changed_top1"],
        "tokens": tokens,
    }
