"""Whether a run fits in the chosen device's memory, from its config alone (k3core's placement plan), so a page
says so instead of trying and running out of memory."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from analysis.output.format import format_bytes
from app import page_registry
from app.library.run_folders import folder_stamp
from app.library.run_list import RunRef

WEIGHTS_PAGE = Path(__file__).resolve().parent.parent / page_registry.page("weights").file
MEMORY_HEADROOM = 0.9  # leave a tenth of the free memory for activations, the trace and everything else


def available_memory(device: str) -> int | None:
    """Free bytes on a device ("cpu", "cuda", "cuda:N"); None when unknown."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return int(torch.cuda.mem_get_info(index)[0])
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


@st.cache_data(show_spinner=False, max_entries=64)
def _plan(path: str, stamp: tuple, device: str, dtype: str):
    from analysis.runs.loading import DTYPES
    from k3core.modeling.model import K3ForCausalLM

    return K3ForCausalLM.plan_placement(path, device, DTYPES[dtype])


def placement_plan(path: str | Path, device: str, dtype: str):
    """k3core's placement plan (bytes and layers per device) for loading the checkpoint in ``dtype`` on
    ``device`` ("auto": GPUs, then CPU, then disk), from config.json alone; cached per folder state."""
    path = Path(path)
    return _plan(str(path), folder_stamp(path), device, dtype)


@st.cache_data(show_spinner=False, max_entries=32)
def _stream_plan(path: str, stamp: tuple, device: str, dtype: str, max_memory: str):
    from analysis.runs.loading import DTYPES
    from k3core.interp.trace_size import trace_estimate
    from k3core.loading.streamed_run import plan_for_path
    from k3core.modeling.model import K3ForCausalLM

    return plan_for_path(
        path, K3ForCausalLM, device=device, dtype=DTYPES[dtype], max_memory=max_memory, trace_estimate=trace_estimate
    )


def stream_plan(path: str | Path, device: str, dtype: str, max_memory: str):
    """k3core's streaming plan (what stays, what streams, bytes and expected time per prompt) for running the
    checkpoint within ``max_memory``; cached per folder state. Raises CheckpointError (a budget too small)."""
    path = Path(path)
    return _stream_plan(str(path), folder_stamp(path), device, dtype, max_memory)


def fit_problem(ref: RunRef, device: str, dtype: str) -> str | None:
    """A message when the run's weights cannot fit in the device's free memory, else None (config only, no load)."""
    if device == "auto":
        return None  # the placement spreads it over every device and disk
    try:
        needed = placement_plan(ref.path, device, dtype).total_bytes
    except (OSError, ValueError):  # a bad checkpoint gets the loader's own message (CheckpointError), not this one
        return None
    free = available_memory(device)
    if free is None or needed <= MEMORY_HEADROOM * free:
        return None
    weights = ""
    if WEIGHTS_PAGE.is_file():
        weights = f" Its weights can still be read without loading it: see the {page_registry.page('weights').mention}."
    return (
        f"**{ref.label}** needs {format_bytes(needed)} in {dtype} but {device} has {format_bytes(free)} free: it "
        f"cannot be loaded here. Pick a smaller dtype or another device in the sidebar, or set a **Memory budget** "
        f"there to run it from its files.{weights}"
    )
