"""Writing a run's traces as a trace folder (``k3core.interp.trace_folder``): what ``k3lab trace`` does on one process,
and the run card that the pipeline-parallel trace writes too.

Reading one back is ``analysis.runs.loading.load_run`` (a trace folder loads as a Run without a model; ``trace_run``
returns its stored traces).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from pathlib import Path
from typing import Any

from analysis.runs import loading as runs_mod
from analysis.runs import texts
from k3core.interp.trace import Trace
from k3core.interp.trace_folder import write_trace_dir
from k3core.modeling.config import K3Config
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


def text_entry(chosen: texts.Input, trace: Trace, tokenizer: Any) -> dict[str, Any]:
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
    inputs: list[texts.Input],
    traces: list[Trace],
    made: dict[str, Any],
    edits: Any = None,
    parameters: int | None = None,
) -> dict[str, Any]:
    """The run card of a trace folder (``k3core.interp.trace_folder``; the trace files' names and digests are added
    there)."""
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
) -> list[texts.Input]:
    """One Input per text file (UTF-8; the file's name names it), else the built-in ``sample`` (default
    Shakespeare). Raises ValueError for a missing file or text the run cannot read."""
    if not text_files:
        return [texts.sample_input(sample or texts.DEFAULT_SAMPLE, run.config, max_tokens, run.tokenizer)]
    inputs = []
    for file in text_files:
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"{path}: no such text file")
        text = path.read_text(encoding="utf-8", errors="replace")
        inputs.append(texts.text_input(text, run.config, max_tokens, name=path.name, tokenizer=run.tokenizer))
    return inputs


def write_run_traces(
    run: runs_mod.Run, inputs: list[texts.Input], out: str | Path, what: Any = "all", edits: list | None = None
) -> Path:
    """Trace ``run`` on each input (``analysis.runs.loading.trace_run``; with ``edits``, the edited forward) and write
    the trace folder ``out`` atomically."""
    if run.recorded is not None:
        raise ValueError(f"{run.label} is already a trace folder: tracing needs the checkpoint")
    traces = [runs_mod.trace_run(run, chosen, what=what, edits=edits).trace for chosen in inputs]
    made = made_card(run.device, run.dtype, run.path, run.fingerprint)
    listed = [e.to_dict() for e in edits] if edits else None
    card = run_card(
        run.config, run.tokenizer, inputs, traces, made, edits=listed, parameters=run.card.get("parameters")
    )
    return write_trace_dir(out, traces, card, run.config.to_json() + "\n", copy_from=run.path)


def write_pipeline_traces(
    path: str | Path,
    text_files: list[str | Path] | None,
    sample: str | None,
    max_tokens: int,
    out: str | Path,
    dtype: str | None = None,
    timeout: float = 300.0,
    what: Any = "all",
    keep_logits: bool = False,
) -> dict[str, Any]:
    """The pipeline-parallel ``k3lab trace`` of one rank under torchrun (``k3core.distributed.pipeline``): load this
    rank's layers, run every text through them as micro-batches, gather on rank 0, which writes the trace folder ``out``
    (the same folder one process writes, with the ranks' plan and bytes read in ``made``). Returns this rank's
    summary {rank, layers, bytes_read, seconds}. Raises PipelineError, CheckpointError, ValueError."""
    import torch.distributed as dist

    from k3core.distributed import pipeline as pp
    from k3core.loading.folder import folder_fingerprint
    from k3core.loading.pretrained import load_config
    from k3core.loading.tensor_info import CheckpointError
    from k3core.modeling.model import K3ForCausalLM

    t0 = time.perf_counter()
    rank, world, device = pp.init_from_env(timeout)
    pp.install_stop_message(rank)
    path = Path(path)
    if rank == 0:
        from k3core.interp.trace_folder import check_out_dir

        check_out_dir(out)
    config = load_config(path)
    dtype_name = runs_mod.dtype_name(dtype)
    plan = pp.stage_plan(config, runs_mod.DTYPES[dtype_name], world)
    stage = pp.Stage(rank, world, plan, timeout)
    tokenizer, _ = runs_mod.run_tokenizer(path, config.vocab_size)
    reader = runs_mod.Run(
        model=None, config=config, metrics=None, card={}, path=path, fingerprint="", tokenizer=tokenizer
    )
    inputs = read_inputs(reader, text_files, sample, max_tokens)
    try:
        model, bytes_read = pp.load_stage(path, stage, device, runs_mod.DTYPES[dtype_name])
    except CheckpointError as exc:
        raise CheckpointError(f"{stage.describe(rank)} cannot load its layers: {exc}") from exc
    load_seconds = time.perf_counter() - t0
    pp.barrier(stage, "the other ranks to load their layers")
    t_forward = time.perf_counter()
    parts, logits = pp.run_stage(model, stage, [c.input_ids for c in inputs], what=what)
    summary = {
        "rank": rank,
        "layers": [stage.start, stage.stop],
        "bytes_read": int(bytes_read),
        "load_seconds": load_seconds,
        "forward_seconds": time.perf_counter() - t_forward,
        "seconds": time.perf_counter() - t0,
        "host": platform.node(),
        "device": str(device),
    }
    if stage.last and keep_logits:
        for part, lg in zip(parts, logits):
            part.add("logits", lg, ("batch", "token", "vocab"))
    gathered = pp.gather_traces(parts, stage, summary)
    if gathered is not None:
        by_text, summaries = gathered
        summaries[0]["forward_and_gather_seconds"] = time.perf_counter() - t_forward
        fingerprint = folder_fingerprint(path)
        traces = []
        for chosen, pieces in zip(inputs, by_text):
            trace = pp.merge_traces(pieces)
            trace.meta["run"].update(
                path=str(path),
                fingerprint=fingerprint,
                sample=chosen.name,
                tokenizer=tokenizer.describe() if tokenizer is not None else None,
            )
            traces.append(trace)
        made = made_card(str(device), dtype_name, path, fingerprint, world)
        made["ranks"] = summaries
        made["backend"] = dist.get_backend()
        parameters = K3ForCausalLM.from_config(config, device="meta").num_parameters()
        card = run_card(config, tokenizer, inputs, traces, made, parameters=parameters)
        write_trace_dir(out, traces, card, config.to_json() + "\n", copy_from=path)
    summary["seconds"] = time.perf_counter() - t0
    dist.destroy_process_group()
    return summary
