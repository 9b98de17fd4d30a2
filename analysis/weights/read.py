"""Reading a weight summary: the small tensors of a source one at a time (``summarize_source``), from a
checkpoint folder (``read_weight_summary``) or a loaded model (``summary_of_model``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from k3core.loading.names import layer_of

from .layout import EXPERT_RE, expert_tensor_names, layer_structure, small_tensor_names
from .source import StateDictSource, open_source
from .summary import WeightSummary, summarize_values

Progress = Callable[[int, int], None]  # (bytes read so far, bytes this summary will read)


def expert_bytes(source: Any) -> int:
    """Bytes that ``experts=True`` reads on top of the small tensors."""
    return sum(int(source.tensors[n].nbytes) for n in expert_tensor_names(source.tensors))


def _read_order(source: Any, names: list[str]) -> list[str]:
    """Names sorted by (file, offset) when the reader knows them: sequential reads within each shard."""

    def key(n: str) -> tuple[str, int, str]:
        meta = source.tensors[n]
        return (str(getattr(meta, "file", "")), int(getattr(meta, "begin", 0)), n)

    return sorted(names, key=key)


def summarize_source(
    source: Any,
    experts: bool = False,
    progress: Progress | None = None,
    label: str = "",
    path: str = "",
    started: float | None = None,
) -> WeightSummary:
    """Read the small tensors of ``source`` one at a time (router matrices reduced to row norms as they
    arrive; expert matrices to sums of squares) and summarise them. ``progress(done, total)`` in bytes;
    ``started``: the ``time.perf_counter()`` when opening the source began (``seconds`` counts from there)."""
    t0 = time.perf_counter() if started is None else started
    tensors = source.tensors
    config = getattr(source, "config", None)
    structure = layer_structure(tensors, config)
    wanted = _read_order(source, small_tensor_names(tensors, structure))
    expert_names = _read_order(source, expert_tensor_names(tensors)) if experts else []
    total = sum(int(tensors[n].nbytes) for n in wanted + expert_names)
    done = 0
    values: dict[str, np.ndarray] = {}
    sums: dict[str, float] = {}
    notes: list[str] = []
    routers = [n for n in wanted if n.endswith("block_sparse_moe.gate.weight")]
    # The large reads (routers, experts) come last, into outputs allocated before them: a long-lived small
    # array allocated between two 13 MB reads would pin the freed block and grow the heap by a read each time.
    for name in routers:
        values[name] = np.empty(int(tensors[name].shape[0]), dtype=np.float64)
    fast_sums = getattr(source, "sum_squares", None)  # MXFP4 experts: summed from their stored bytes
    for name in [n for n in wanted if n not in values] + routers + expert_names:
        fast = fast_sums(name) if fast_sums is not None and name in expert_names else None
        if fast is not None:
            sums[name] = fast
            done += int(tensors[name].nbytes)
            if progress is not None:
                progress(done, total)
            continue
        arr = source.read(name)
        if name in values:
            _router_row_norms(arr, out=values[name])
        elif experts and EXPERT_RE.match(layer_of(name)[1]):
            sums[name] = _sum_squares(arr, notes)
        else:
            values[name] = _to_numpy(arr)
        del arr
        done += int(tensors[name].nbytes)
        if progress is not None:
            progress(done, total)
    if config is None:
        notes.append("no config.json: KDA gate form unknown, resting decay not computed")
    summary = summarize_values(values, tensors, config, sums if experts else None, notes, structure)
    summary.label = label
    summary.path = path
    summary.skipped = list(getattr(source, "skipped", []))
    summary.bytes_total = int(source.bytes_total)
    summary.bytes_read = int(source.bytes_read)
    summary.expert_bytes = expert_bytes(source)
    summary.seconds = time.perf_counter() - t0
    return summary


def _router_row_norms(t: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Row norms of a router weight (K3: 896 x 7168): float32 values (exact for bf16 / fp32 storage),
    products and sums in float64 (``row_norms``)."""
    x = t if isinstance(t, np.ndarray) else t.reshape(t.shape[0], -1).float().numpy()
    x = x.reshape(x.shape[0], -1)
    out = np.empty(x.shape[0], dtype=np.float64) if out is None else out
    np.einsum("ij,ij->i", x, x, dtype=np.float64, out=out)
    return np.sqrt(out, out=out)


def _sum_squares(t: Any, notes: list[str]) -> float:
    """Sum of squares of an expert matrix, float32 values with float64 products and sums (NaN with a note
    for packed / integer dtypes, whose elements are not the weights)."""
    if isinstance(t, np.ndarray):
        x = t.astype(np.float32, copy=False).reshape(-1)
    elif not t.is_floating_point():
        if not any("packed" in n for n in notes):
            notes.append(f"expert matrices stored as {t.dtype} (packed/quantised): expert norms not computed")
        return float("nan")
    else:
        x = t.reshape(-1).float().numpy()
    return float(np.einsum("i,i->", x, x, dtype=np.float64))


def _to_numpy(t: Any) -> np.ndarray:
    """A tensor as float64 numpy (bf16 has no numpy dtype: go through torch's float64)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.detach().to("cpu").double().numpy()


def read_weight_summary(
    path: str | Path,
    experts: bool = False,
    progress: Progress | None = None,
) -> WeightSummary:
    """Weight-only summary of a checkpoint folder: headers, then only the small tensors (plus every expert
    matrix with ``experts=True``), one at a time; never builds the model. Raises CheckpointError."""
    started = time.perf_counter()
    source = open_source(path)
    p = Path(path)
    label = p.resolve().name or str(p)
    return summarize_source(source, experts=experts, progress=progress, label=label, path=str(p), started=started)


def summary_of_model(model: Any, label: str = "run") -> WeightSummary:
    """The same summary from a loaded model's parameters (``StateDictSource``)."""
    return summarize_source(StateDictSource(model), experts=False, label=label)
