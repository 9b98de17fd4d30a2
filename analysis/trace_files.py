"""Writing a run's traces as a trace folder (``k3core.trace_dir``): what ``k3lab trace`` does on one process, and
the run card that the pipeline-parallel trace writes too.

Reading one back is ``analysis.runs.load_run`` (a trace folder loads as a Run without a model; ``trace_run``
returns its stored traces).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from pathlib import Path
from typing import Any

from analysis import runs as runs_mod
from k3core.config import K3Config
from k3core.trace import Trace
from k3core.trace_dir import write_trace_dir
from k3core.training.rundir import code_version


def k3lab_version() -> str:
    try:
        return importlib.metadata.version("k3lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def made_card(device: str, dtype: str, checkpoint: Path, fingerprint: str, world_size: int = 1) -> dict[str, Any]:
    """Where and how a trace was made: host, device, dtype, processes, versions, checkpoint, UTC time, command."""
    import torch

    return {
        "host": platform.node(),
        "device": str(device),
        "dtype": str(dtype),
        "world_size": int(world_size),
        "k3lab_version": k3lab_version(),
        "source_fingerprint": code_version(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "checkpoint": checkpoint.name,
        "checkpoint_fingerprint": fingerprint,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
    }


def text_entry(chosen: runs_mod.Input, trace: Trace, tokenizer: Any) -> dict[str, Any]:
    """The run card's entry of one traced text: name, token ids and their readable strings, loss."""
    ids = [int(t) for t in chosen.input_ids[0]]
    loss = (trace.meta.get("run") or {}).get("loss")
    return {
        "name": chosen.name,
        "description": chosen.description,
        "text": chosen.text,
        "tokens": ids,
        "token_strings": tokenizer.token_strings(ids) if tokenizer is not None else None,
        "loss": loss,
    }


def run_card(
    config: K3Config,
    tokenizer: Any,
    inputs: list[runs_mod.Input],
    traces: list[Trace],
    made: dict[str, Any],
    edits: Any = None,
    parameters: int | None = None,
) -> dict[str, Any]:
    """The run card of a trace folder (``k3core.trace_dir``; the trace files' names and digests are added there)."""
    return {
        "config": config.to_dict(),
        "parameters": parameters,
        "tokenizer": tokenizer.describe() if tokenizer is not None else None,
        "texts": [text_entry(chosen, trace, tokenizer) for chosen, trace in zip(inputs, traces)],
        "edits": edits,
        "made": made,
    }


def read_inputs(
    run: runs_mod.Run, text_files: list[str | Path] | None, sample: str | None, max_tokens: int
) -> list[runs_mod.Input]:
    """One Input per text file (UTF-8; the file's name names it), else the built-in ``sample`` (default
    Shakespeare). Raises ValueError for a missing file or text the run cannot read."""
    if not text_files:
        return [runs_mod.sample_input(sample or runs_mod.DEFAULT_SAMPLE, run.config, max_tokens, run.tokenizer)]
    inputs = []
    for file in text_files:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"{path}: no such text file")
        text = path.read_text(encoding="utf-8", errors="replace")
        inputs.append(runs_mod.text_input(text, run.config, max_tokens, name=path.name, tokenizer=run.tokenizer))
    return inputs


def write_run_traces(
    run: runs_mod.Run, inputs: list[runs_mod.Input], out: str | Path, what: Any = "all", world_size: int = 1
) -> Path:
    """Trace ``run`` on each input (``analysis.runs.trace_run``) and write the trace folder ``out`` atomically."""
    if run.recorded is not None:
        raise ValueError(f"{run.label} is already a trace folder: tracing needs the checkpoint")
    traces = [runs_mod.trace_run(run, chosen, what=what).trace for chosen in inputs]
    made = made_card(run.device, run.dtype, run.path, run.fingerprint, world_size)
    card = run_card(run.config, run.tokenizer, inputs, traces, made, parameters=run.card.get("parameters"))
    return write_trace_dir(out, traces, card, run.config.to_json() + "\n", copy_from=run.path)
