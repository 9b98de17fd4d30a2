"""Running a checkpoint larger than memory, straight from its original files, under a memory budget.

Kimi K3 is 1.56 TB, 96% of it routed experts, of which a token uses 16 of 896 per layer. So:

- **Experts stay in the shards.** ``ExpertStore`` reads only the experts the router chose, one contiguous
  read per expert when its tensors lie back to back (the published layout: w1 packed, w1 scale, w2 ..., 17.5
  MB), keeps the stored bytes in an LRU cache under a byte budget (hits and misses counted) on the compute
  device, and decodes them there when the expert runs. The reads of a layer start as soon as its router has
  chosen (``request``, called by ``LatentMoE.forward`` through the experts' ``weight_source``), a few at a
  time in reader threads, while the latent projection and the first experts compute.
- **Dense parts resident when they fit**, else streamed module by module (attention, dense FFN, the MoE's
  router / shared experts / latent projections) from the same files, read when the module is called and
  dropped when it returns; the embedding reads only the rows of the prompt's tokens, the LM head goes through
  its rows in chunks. Nothing is ever copied to an offload folder.
- **Freed buffers go back to the system.** The cache turns over thousands of 17.5 MB buffers, read in several
  threads. glibc raises its mmap threshold each time such a buffer is freed, after which buffers that size come
  from the heap arenas, where evicted ones fragment and stay resident (measured: 3.98 GB resident for 2.10 GB of
  live buffers). ``return_freed_memory`` pins the threshold at 4 MiB for the process, so every large buffer is
  its own mapping and is unmapped when freed.
- ``plan_streaming`` says, before anything is read, what stays, what streams, what a prompt will read and
  how long that takes at the read speed measured on the files now; a budget too small for one layer is a
  CheckpointError naming the figures.

``load_streamed`` builds such a model (``K3ForCausalLM.from_pretrained(path, max_memory=...)`` calls it when
the model does not fit); its forward and traces are those of the resident model
(tests/k3core/loading/test_expert_store.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..utils.units import parse_bytes
from .folder import CheckpointFiles
from .into_parameters import pread_exact
from .safetensors_header import is_hole
from .tensor_info import CheckpointError, TensorInfo

EXPERT_NAME = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
WEIGHTS = ("w1", "w2", "w3")
READ_WINDOW = 8  # expert reads in flight or waiting to be used, per store
LM_HEAD_CHUNK_BYTES = 256 * 1024**2  # LM head rows decoded at a time (compute dtype)
TABLE_BYTES_PER_TENSOR = 1400  # the header table in memory, per stored tensor (Kimi K3: 497k, 650 MB measured)
MARGIN_BYTES = 512 * 1024**2  # the interpreter and torch (~350 MB), activations, allocator slack
ProgressFn = Callable[[dict], None]
MMAP_THRESHOLD_BYTES = 4 * 1024**2  # buffers from this size up are mappings of their own (return_freed_memory)


class StreamStopped(RuntimeError):
    """Raised inside a streamed forward when its progress callback asks to stop (the app's Stop button)."""


def return_freed_memory() -> bool:
    """Make every buffer of ``MMAP_THRESHOLD_BYTES`` or more a mapping of its own, unmapped when freed (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``; it also stops glibc from raising the threshold as buffers are freed, see the
    module docstring). For the whole process, once; True where it took effect (glibc), False elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): its allocator as it is
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD_BYTES)))


def budget_for(max_memory: dict[Any, int | str] | int | str, device: str | torch.device) -> int:
    """The budget of ``device`` in a ``max_memory`` mapping ({"cpu": "6GB"}, {0: "70GiB"}) or a single figure."""
    if not isinstance(max_memory, dict):
        return parse_bytes(max_memory, what="the memory budget")
    dev = torch.device(device)
    keys = [dev.type] if dev.type == "cpu" else [dev.index or 0, str(dev), f"{dev.type}:{dev.index or 0}"]
    for key in keys:
        if key in max_memory:
            return parse_bytes(max_memory[key], what="the memory budget")
    raise ValueError(f"max_memory {max_memory} gives no budget for the compute device {dev}")


# ------------------------------------------------------------------------------------ reading
class FileReader:
    """Positional reads of byte spans from a checkpoint's files (``os.preadv``: no shared offset, releases the
    GIL), counted; safe from several threads."""

    def __init__(self, skip_holes: bool = False) -> None:
        self.skip_holes = skip_holes  # sparse files (test replicas): a hole is zeros without reading it
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.seconds = 0.0

    def read(self, file: Path, begin: int, end: int, what: str) -> torch.Tensor:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
        if self.skip_holes and is_hole(fd, begin, end):
            with self._lock:
                self.bytes_read += end - begin
            return torch.zeros(end - begin, dtype=torch.uint8)
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        t0 = time.perf_counter()
        pread_exact(fd, view, begin, file.name, what)
        with self._lock:
            self.bytes_read += len(view)
            self.seconds += time.perf_counter() - t0
        return buf

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def pieces(info: TensorInfo) -> list[tuple[str, TensorInfo]]:
    """The stored tensors behind a table entry: a quantised weight's parts, or the tensor itself."""
    return list(info.parts) if info.parts else [("weight", info)]


def span_of(infos: list[TensorInfo]) -> tuple[Path, int, int] | None:
    """(file, begin, end) when all stored tensors of ``infos`` lie back to back in one file, else None."""
    stored = [p for info in infos for _, p in pieces(info)]
    file = stored[0].file
    begin, end = min(p.begin for p in stored), max(p.end for p in stored)
    if any(p.file != file or p.begin < 0 for p in stored) or end - begin != sum(p.nbytes for p in stored):
        return None
    return file, begin, end


def typed(part: TensorInfo, raw: torch.Tensor, begin: int) -> torch.Tensor:
    """Stored bytes of ``part`` (from a span read at ``begin``) as its dtype and shape."""
    from .quantized import part_view

    return part_view(part, raw, begin)


def decode_entry(info: TensorInfo, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A table entry's values in ``dtype`` from its stored pieces (decoded where they are)."""
    if info.parts:
        from .quantized import decode

        return decode(info, stored, dtype)
    return stored["weight"].to(dtype)


def read_entries(reader: FileReader, infos: list[TensorInfo], device: Any) -> list[dict[str, torch.Tensor]]:
    """The stored pieces of several entries on ``device``: one read when they lie back to back."""
    span = span_of(infos)
    spans = [span] if span else [(p.file, p.begin, p.end) for info in infos for _, p in pieces(info)]
    raws = [(file, begin, reader.read(file, begin, end, infos[0].raw_name).to(device)) for file, begin, end in spans]
    out = []
    for info in infos:
        parts = {}
        for role, part in pieces(info):
            for file, begin, raw in raws:
                if file == part.file and begin <= part.begin and part.end <= begin + raw.numel():
                    parts[role] = typed(part, raw, begin)
                    break
        out.append(parts)
    return out


# ------------------------------------------------------------------------------------ experts
@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    reads: int = 0  # read calls for experts (one per expert when stored back to back)
    bytes_read: int = 0


class ExpertStore:
    """Routed experts read from the checkpoint on demand, stored bytes cached (LRU) under ``budget`` bytes."""

    def __init__(
        self,
        files: CheckpointFiles,
        device: str | torch.device,
        dtype: torch.dtype,
        budget: int,
        reader: FileReader | None = None,
        workers: int = 2,
    ) -> None:
        self.files = files
        self.device = torch.device(device)
        self.dtype = dtype
        self.budget = budget
        self.reader = reader or FileReader()
        self.stats = ExpertStats()
        self._cache: OrderedDict[tuple[int, int], list[dict[str, torch.Tensor]]] = OrderedDict()
        self._cached_bytes = 0
        self._pending: OrderedDict[tuple[int, int], Future | None] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3lab-experts")

    def infos(self, layer: int, expert: int) -> list[TensorInfo]:
        try:
            return [self.files.tensors[EXPERT_NAME.format(layer=layer, expert=expert, w=w)] for w in WEIGHTS]
        except KeyError as exc:
            raise CheckpointError(
                f"{self.files.folder.name}: expert {expert} of layer {layer}: no tensor {exc}"
            ) from exc

    def expert_bytes(self, layer: int, expert: int) -> int:
        return sum(i.nbytes for i in self.infos(layer, expert))

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def cached_keys(self) -> list[tuple[int, int]]:
        """The cached (layer, expert) keys, least recently used first."""
        return list(self._cache)

    def request(self, layer: int, experts: list[int]) -> None:
        """The router of ``layer`` chose ``experts``: start reading those not cached (a few at a time)."""
        for e in experts:
            key = (layer, int(e))
            if key not in self._cache and key not in self._pending:
                self._pending[key] = None
        self._pump()

    def _pump(self) -> None:
        started = sum(1 for f in self._pending.values() if f is not None)
        for key, future in self._pending.items():
            if started >= READ_WINDOW:
                break
            if future is None:
                self._pending[key] = self._pool.submit(self._read, key)
                started += 1

    def _read(self, key: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
        infos = self.infos(*key)
        stored = read_entries(self.reader, infos, "cpu")
        self.stats.reads += 1 if span_of(infos) else sum(len(pieces(i)) for i in infos)
        self.stats.bytes_read += sum(i.nbytes for i in infos)
        return stored

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of one expert in the compute dtype on the compute device."""
        key = (layer, int(expert))
        stored = self._cache.get(key)
        if stored is not None:
            self._cache.move_to_end(key)
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            future = self._pending.pop(key, None)
            stored = future.result() if future is not None else self._read(key)
            stored = [{r: t.to(self.device) for r, t in parts.items()} for parts in stored]
            self._remember(key, stored)
            self._pump()
        infos = self.infos(*key)
        w1, w2, w3 = (decode_entry(info, parts, self.dtype) for info, parts in zip(infos, stored))
        return w1, w2, w3

    def _remember(self, key: tuple[int, int], stored: list[dict[str, torch.Tensor]]) -> None:
        size = sum(t.numel() * t.element_size() for parts in stored for t in parts.values())
        if size > self.budget:
            return
        self._cache[key] = stored
        self._cached_bytes += size
        while self._cached_bytes > self.budget:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= sum(t.numel() * t.element_size() for parts in old for t in parts.values())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class LayerExperts:
    """One MoE layer's view of an ExpertStore: an ``ExpertWeightSource`` (``k3core.modeling.loading_state``), what
    ``StackedExperts.weight_source`` expects."""

    def __init__(self, store: ExpertStore, layer: int) -> None:
        self.store = store
        self.layer = layer

    def request(self, experts: torch.Tensor) -> None:
        self.store.request(self.layer, sorted(set(experts.reshape(-1).tolist())))

    def weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.store.weights(self.layer, expert)
