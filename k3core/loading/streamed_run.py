"""A model run from its checkpoint files under a memory budget (see k3core.loading.expert_store for the experts).

``plan_streaming`` decides, from the headers and the budget alone, what stays resident (small tensors always;
the dense parts too when they fit) and what streams (routed experts always; attention / FFN / router / shared
experts / latent projections module by module when the dense parts do not fit; embedding rows; the LM head in
chunks), the bytes a prompt will read and the time that takes at the read speed measured on the files.
``load_streamed`` builds the model accordingly: resident tensors are read once, streamed modules are read
when called and dropped when they return (forward hooks), and every MoE layer's experts come from an
``ExpertStore``. The forward and the traces are those of the resident model.
"""

from __future__ import annotations

import re
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.loading_state import LoadingState
from .expert_store import (
    LM_HEAD_CHUNK_BYTES,
    MARGIN_BYTES,
    READ_WINDOW,
    TABLE_BYTES_PER_TENSOR,
    ExpertStore,
    FileReader,
    LayerExperts,
    ProgressFn,
    StreamStopped,
    budget_for,
    decode_entry,
    read_entries,
    return_freed_memory,
)
from .folder import CheckpointFiles
from .names import LAYER_PREFIX, layer_of
from .tensor_info import CheckpointError

EXPERT_RE = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
TRACE_TOKENS = 8  # the prompt length the plan keeps room for a default trace of
STREAMED_MODULES = ("self_attn", "mlp", "block_sparse_moe")  # a layer's parts that stream
EMBED, LM_HEAD = "model.embed_tokens", "lm_head"


def streamed_module_of(name: str) -> str | None:
    """The module a (non-expert) tensor streams with: a layer's self_attn / mlp / block_sparse_moe, the
    embedding or the LM head; None for the small tensors that always stay (norms, AttnRes queries)."""
    layer, rest = layer_of(name)
    module = rest.partition(".")[0] if layer is not None else None
    if module in STREAMED_MODULES and "." in rest:
        return f"{LAYER_PREFIX}{layer}.{module}"
    for module in (EMBED, LM_HEAD):
        if name.startswith(module + "."):
            return module
    return None


TraceEstimate = Callable[[Any, int], int]  # (config, tokens) -> bytes a default trace of one sequence holds


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass
class StreamPlan:
    """What a streamed run holds and reads (bytes; "compute" = in the dtype the model computes with)."""

    device: str
    dtype: torch.dtype
    budget: int
    dense_resident: bool
    resident_bytes: int  # held for the whole run (compute)
    streamed_bytes: int  # dense parts read per forward when streamed (compute; 0 when resident)
    stored_dense_stream_bytes: int  # the same, as stored (bytes read per forward)
    largest_module: tuple[str, int]  # the biggest module streamed at once (compute)
    working_bytes: int  # one module + LM head chunk + read window + one decoded expert + trace + margin
    expert_cache_bytes: int
    expert_stored_bytes: int  # one expert as stored
    expert_compute_bytes: int  # one expert decoded
    moe_layers: int
    num_experts: int
    top_k: int
    embed_row_bytes: int
    read_speed: float  # bytes/s measured on the files when planned
    stored_by_format: dict[str, int] = field(default_factory=dict)
    parameters: int = 0
    trace_bytes: int = 0  # the part of working_bytes kept for a default trace of trace_tokens tokens of one sequence
    trace_tokens: int = 0
    config: Any = field(default=None, repr=False)  # the model's config (for trace_estimate)
    trace_estimate: TraceEstimate | None = field(default=None, repr=False)

    def trace_line(self, tokens: int) -> str:
        """The plan's word on a default trace of ``tokens`` tokens: its bytes against what the budget keeps for it."""
        estimate = self.trace_estimate
        need = estimate(self.config, tokens) if estimate is not None and self.config is not None else self.trace_bytes
        spare = self.trace_bytes + self.expert_cache_bytes
        verdict = (
            "within the working set" if need <= self.trace_bytes
            else f"{_gb(need - self.trace_bytes)} over it, taken from the expert cache" if need <= spare
            else f"OVER the budget by {_gb(need - spare)}: trace fewer tokens or give more memory"
        )  # fmt: skip
        return (
            f"a default trace of {tokens} tokens holds {_gb(need)} (estimated from the config; "
            f"{_gb(self.trace_bytes)} kept for {self.trace_tokens} tokens): {verdict}"
        )

    @property
    def cache_experts(self) -> int:
        return self.expert_cache_bytes // max(1, self.expert_stored_bytes)

    def prompt_bytes(self, tokens: int, cached_experts: int = 0) -> int:
        """Bytes a forward over ``tokens`` tokens reads: streamed dense parts, embedding rows, and up to
        min(E, tokens * k) experts per MoE layer (a cold cache; ``cached_experts`` fewer)."""
        experts = self.moe_layers * min(self.num_experts, tokens * self.top_k) - cached_experts
        return self.stored_dense_stream_bytes + tokens * self.embed_row_bytes + experts * self.expert_stored_bytes

    def expected_seconds(self, tokens: int) -> float:
        return self.prompt_bytes(tokens) / self.read_speed

    def describe(self, tokens: int = 8) -> str:
        stays = (
            "the checkpoint's table, small tensors and every dense part"
            if self.dense_resident
            else "the checkpoint's table and small tensors (norms, AttnRes)"
        )
        streams = "routed experts" if self.dense_resident else "routed experts; dense parts module by module"
        stored = ", ".join(f"{k} {_gb(v)}" for k, v in self.stored_by_format.items())
        return "\n".join(
            [
                f"budget {_gb(self.budget)} on {self.device} ({str(self.dtype).removeprefix('torch.')})",
                f"stays:   {_gb(self.resident_bytes)} ({stays})",
                f"streams: {streams}; largest module {self.largest_module[0]} {_gb(self.largest_module[1])}",
                f"expert cache {_gb(self.expert_cache_bytes)} ({self.cache_experts} experts of "
                f"{self.expert_stored_bytes / 1e6:.1f} MB stored), working set {_gb(self.working_bytes)} "
                f"(a default trace of {self.trace_tokens} tokens {_gb(self.trace_bytes)} of it)",
                self.trace_line(tokens),
                f"a {tokens}-token prompt reads up to {_gb(self.prompt_bytes(tokens))}: about "
                f"{self.expected_seconds(tokens):.0f} s at {self.read_speed / 1e9:.2f} GB/s (measured on these files "
                f"now: page cache or disk, whichever serves them)",
                f"stored: {self.parameters / 1e12:.2f}T parameters, {stored}",
            ]
        )


def measure_read_speed(files: CheckpointFiles, nbytes: int = 64 * 1024**2) -> float:
    """Bytes/s of reading ``nbytes`` from the largest weight file, in 4 MB reads (what the files give now)."""
    reader = FileReader()
    file = max(files.files, key=lambda f: f.stat().st_size)
    size = file.stat().st_size
    start = max(0, size // 2 - nbytes // 2)
    end = min(size, start + nbytes)
    t0 = time.perf_counter()
    for pos in range(start, end, 4 * 1024**2):
        reader.read(file, pos, min(end, pos + 4 * 1024**2), "read speed probe")
    reader.close()
    return max(end - start, 1) / max(time.perf_counter() - t0, 1e-6)


def plan_streaming(
    files: CheckpointFiles,
    model: nn.Module,
    device: str | torch.device,
    budget: int,
    dense: str = "auto",
    read_speed: float | None = None,
    trace_tokens: int = TRACE_TOKENS,
    trace_estimate: TraceEstimate | None = None,
) -> StreamPlan:
    """The plan of a streamed run of ``model`` (meta device, in its compute dtypes) from ``files`` within
    ``budget`` bytes. ``dense``: "auto" (resident when it fits), "resident" or "stream". With ``trace_estimate``
    (the recorder's count, ``k3core.interp.trace_size.trace_estimate``, passed in by whoever will record: loading
    does not know the recorder) the working set keeps room for a default trace (``record(model)``) of
    ``trace_tokens`` tokens of one sequence; without it, none. Raises CheckpointError when the budget cannot hold one
    layer."""
    if dense not in ("auto", "resident", "stream"):
        raise ValueError(f"dense must be 'auto', 'resident' or 'stream', got {dense!r}")
    cfg = model.config
    compute = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    small = 0
    modules: dict[str, int] = {}
    stored_modules: dict[str, int] = {}
    largest_tensor = 0
    for name, info in files.tensors.items():
        if EXPERT_RE.search(name):
            continue
        t = compute.get(name)
        nbytes = t.numel() * t.element_size() if t is not None else info.nbytes
        module = streamed_module_of(name)
        if module is None:
            small += nbytes
        else:
            modules[module] = modules.get(module, 0) + nbytes
            stored_modules[module] = stored_modules.get(module, 0) + info.nbytes
            if module not in (EMBED, LM_HEAD):  # those two are read by rows / in chunks
                largest_tensor = max(largest_tensor, info.nbytes)
    # the checkpoint's table of tensors (CheckpointFiles) stays in memory for the whole run
    small += TABLE_BYTES_PER_TENSOR * sum(len(info.parts) or 1 for info in files.tensors.values())
    moe = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    expert_stored = expert_compute = 0
    if moe:
        from .expert_store import EXPERT_NAME, WEIGHTS

        infos = [files.tensors[EXPERT_NAME.format(layer=moe[0], expert=0, w=w)] for w in WEIGHTS]
        expert_stored = sum(i.nbytes for i in infos)
        stacked = model.model.layers[moe[0]].block_sparse_moe.experts
        expert_compute = sum(getattr(stacked, w)[0].numel() * getattr(stacked, w).element_size() for w in WEIGHTS)
    experts_working = expert_compute + READ_WINDOW * expert_stored
    # A default trace of one sequence of trace_tokens tokens, estimated from the config (its arrays and what the
    # recorder holds while recording: k3core.interp.trace_size; Kimi K3: 69 KDA final states of 6.3 MB, the hidden
    # states and their moments, sketched at this width)
    trace = trace_estimate(cfg, trace_tokens) if trace_estimate is not None else 0
    lm = modules.get(LM_HEAD, 0) or modules.get(EMBED, 0)
    lm_chunk = min(LM_HEAD_CHUNK_BYTES, lm)
    layer_modules = {k: v for k, v in modules.items() if k not in (EMBED, LM_HEAD)}
    largest = max(layer_modules.items(), key=lambda kv: kv[1], default=("(none)", 0))
    dense_all = sum(modules.values())
    need_resident = small + dense_all + experts_working + trace + MARGIN_BYTES
    need_stream = small + largest[1] + largest_tensor + lm_chunk + experts_working + trace + MARGIN_BYTES
    resident = dense == "resident" or (
        dense == "auto" and need_resident + expert_stored * (cfg.num_experts_per_token or 0) <= budget
    )
    need = need_resident if resident else need_stream
    if need > budget:
        raise CheckpointError(
            f"{files.folder.name}: a memory budget of {_gb(budget)} is too small for one layer of this model: it "
            f"needs at least {_gb(need)} ({'dense parts resident' if resident else 'streaming'}: table and small "
            f"tensors {_gb(small)}, largest module {largest[0]} {_gb(largest[1])} + its largest tensor as stored "
            f"{_gb(largest_tensor)}, LM head chunk {_gb(lm_chunk)}, one expert decoded "
            f"{_gb(expert_compute)} + {READ_WINDOW} read ahead {_gb(READ_WINDOW * expert_stored)}, "
            f"a default trace of {trace_tokens} tokens {_gb(trace)}, margin {_gb(MARGIN_BYTES)})"
        )
    embed_info = files.tensors.get(EMBED + ".weight")
    embed_row = embed_info.nbytes // embed_info.shape[0] if embed_info is not None else 0
    stored_stream = 0 if resident else sum(v for k, v in stored_modules.items() if k != EMBED)
    return StreamPlan(
        device=str(torch.device(device)),
        dtype=model.model.embed_tokens.weight.dtype,
        budget=budget,
        dense_resident=resident,
        resident_bytes=small + (dense_all if resident else 0),
        streamed_bytes=0 if resident else dense_all,
        stored_dense_stream_bytes=stored_stream,
        largest_module=largest if not resident else ("(none: resident)", 0),
        working_bytes=need - small - (dense_all if resident else 0),
        expert_cache_bytes=budget - need,
        expert_stored_bytes=expert_stored,
        expert_compute_bytes=expert_compute,
        moe_layers=len(moe),
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_token,
        embed_row_bytes=0 if resident else embed_row,
        read_speed=read_speed or measure_read_speed(files),
        stored_by_format=files.bytes_by_format(),
        parameters=files.num_parameters,
        trace_bytes=trace,
        trace_tokens=trace_tokens,
        config=cfg,
        trace_estimate=trace_estimate,
    )


# ------------------------------------------------------------------------------------ filling tensors
def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    out = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for table in (module._parameters, module._buffers):
            out.update({prefix + leaf: (module, leaf) for leaf in table})
    return out


def _set(module: nn.Module, leaf: str, value: torch.Tensor) -> None:
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


class Filler:
    """Reads table entries into fresh tensors of a model's (meta) shapes and dtypes on a device."""

    def __init__(self, model: nn.Module, files: CheckpointFiles, reader: FileReader, device: torch.device) -> None:
        self.files, self.reader, self.device = files, reader, device
        self.owners = _owners(model)

    def value(self, name: str) -> torch.Tensor:
        from .into_parameters import _adapt, _finite

        module, leaf = self.owners[name]
        want = getattr(module, leaf)
        info = self.files.tensors[name]
        stored = read_entries(self.reader, [info], self.device)[0]
        value = _adapt(name, decode_entry(info, stored, want.dtype), tuple(want.shape), info).contiguous()
        if value.is_floating_point() and not _finite(value):
            raise CheckpointError(
                f"{info.file.name}: NaN or Inf values in tensor {name!r} (stored as {info.raw_name!r})"
            )
        return value

    def fill(self, name: str) -> None:
        module, leaf = self.owners[name]
        _set(module, leaf, self.value(name))

    def drop(self, name: str) -> None:
        module, leaf = self.owners[name]
        t = getattr(module, leaf)
        _set(module, leaf, torch.empty(t.shape, dtype=t.dtype, device="meta"))


@dataclass
class StreamSession:
    """What a streamed model carries (``model.loading.streaming``): its plan, expert store, reader and progress."""

    plan: StreamPlan
    store: ExpertStore
    reader: FileReader
    progress: ProgressFn | None = None
    layers: int = 0

    def stats(self) -> dict[str, Any]:
        s = self.store.stats
        return {"bytes_read": self.reader.bytes_read, "expert_hits": s.hits, "expert_misses": s.misses,
                "expert_reads": s.reads, "expert_bytes_read": s.bytes_read,
                "expert_cache_bytes": self.store.cached_bytes, "read_seconds": self.reader.seconds}  # fmt: skip

    def close(self) -> None:
        self.store.close()
        self.reader.close()


def _attach_dense_streaming(model: nn.Module, filler: Filler, names: dict[str, list[str]], plan: StreamPlan) -> None:
    """Forward hooks: a streamed module's tensors are read when it is called and dropped when it returns;
    the embedding reads only the rows of its input ids; the LM head multiplies chunk by chunk of rows."""
    for module_name, tensor_names in names.items():
        if module_name in (EMBED, LM_HEAD):
            continue
        module = model.get_submodule(module_name)

        def load(_module, _args, tensor_names=tensor_names):
            for n in tensor_names:
                filler.fill(n)

        def drop(_module, _args, _out, tensor_names=tensor_names):
            for n in tensor_names:
                filler.drop(n)

        module.register_forward_pre_hook(load)
        module.register_forward_hook(drop)
    embed = model.model.embed_tokens
    embed_info = filler.files.tensors[EMBED + ".weight"]

    def embed_rows(module, args):
        ids = args[0]
        rows, inverse = torch.unique(ids, return_inverse=True)
        row_bytes = embed_info.nbytes // embed_info.shape[0]
        weight = torch.stack([_row(filler, embed_info, int(r), row_bytes, module.weight.dtype) for r in rows.tolist()])
        _set(module, "weight", weight)
        return (inverse,)

    def embed_drop(module, _args, _out):
        filler.drop(EMBED + ".weight")

    embed.register_forward_pre_hook(embed_rows)
    embed.register_forward_hook(embed_drop)
    head = model.lm_head
    head_name = LM_HEAD + ".weight" if LM_HEAD + ".weight" in filler.files.tensors else EMBED + ".weight"
    head_info = filler.files.tensors[head_name]

    def chunked(self, x: torch.Tensor) -> torch.Tensor:
        V, D = head_info.shape
        dtype = self.weight.dtype
        rows = max(1, LM_HEAD_CHUNK_BYTES // (D * torch.empty((), dtype=dtype).element_size()))
        row_bytes = head_info.nbytes // V
        out = []
        for start in range(0, V, rows):
            stop = min(V, start + rows)
            raw = filler.reader.read(head_info.file, head_info.begin + start * row_bytes,
                                     head_info.begin + stop * row_bytes, head_info.raw_name).to(x.device)  # fmt: skip
            chunk = raw.view(_dtype(head_info)).reshape(stop - start, D).to(dtype)
            out.append(F.linear(x, chunk))
        return torch.cat(out, dim=-1)

    head.forward = types.MethodType(chunked, head)


def _dtype(info) -> torch.dtype:
    from .tensor_info import DTYPES

    return DTYPES[info.dtype]


def _row(filler: Filler, info, row: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    begin = info.begin + row * row_bytes
    raw = filler.reader.read(info.file, begin, begin + row_bytes, info.raw_name).to(filler.device)
    return raw.view(_dtype(info)).to(dtype)


def _attach_progress(model: nn.Module, session: StreamSession) -> None:
    layers = model.model.layers
    session.layers = len(layers)
    for i, layer in enumerate(layers):

        def report(_module, _args, i=i):
            if session.progress is not None and session.progress(
                {"layer": i, "layers": len(layers), **session.stats()}
            ):
                raise StreamStopped(f"stopped at layer {i} of {len(layers)}")

        layer.self_attn.register_forward_pre_hook(report)


def load_streamed(
    path: str | Path,
    model_cls: type[nn.Module],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    max_memory: dict[Any, int | str] | int | str = "8GB",
    dense: str = "auto",
    progress: ProgressFn | None = None,
    plan: StreamPlan | None = None,
    skip_holes: bool = False,
    trace_estimate: TraceEstimate | None = None,
) -> nn.Module:
    """A model that computes from the checkpoint files under ``max_memory`` (see the module docstring).

    ``progress(info)`` is called before each decoder layer with {"layer", "layers", "bytes_read",
    "expert_hits", "expert_misses", ...}; a truthy return stops the forward (StreamStopped). ``skip_holes``:
    holes of sparse files (test replicas) read as zeros without a read (counted as read all the same).
    ``trace_estimate``: see ``plan_streaming``. Raises CheckpointError (a budget too small for one layer included)."""
    from .into_parameters import published_tensors
    from .pretrained import build_meta_model, check_headers, refuse_quantised_config

    files = CheckpointFiles.open(path)
    refuse_quantised_config(files.folder)
    model = build_meta_model(model_cls, files.config, dtype)
    check_headers(files, published_tensors(model))
    device = torch.device(device)
    plan = plan or plan_streaming(
        files, model, device, budget_for(max_memory, device), dense, trace_estimate=trace_estimate
    )
    return_freed_memory()
    reader = FileReader(skip_holes=skip_holes)
    filler = Filler(model, files, reader, device)
    streamed: dict[str, list[str]] = {}
    for name in files.tensors:
        if EXPERT_RE.search(name):
            continue
        module = None if plan.dense_resident else streamed_module_of(name)
        if module is None:
            filler.fill(name)
        else:
            streamed.setdefault(module, []).append(name)
    if getattr(model.config, "tie_word_embeddings", False) and plan.dense_resident:
        model.lm_head.weight = model.model.embed_tokens.weight
    compute_dtype = dtype or torch.float32
    store = ExpertStore(files, device, compute_dtype, plan.expert_cache_bytes, reader)
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe:
            layer.block_sparse_moe.experts.weight_source = LayerExperts(store, i)
    if not plan.dense_resident:
        _attach_dense_streaming(model, filler, streamed, plan)
    session = StreamSession(plan, store, reader, progress)
    _attach_progress(model, session)
    model.loading = LoadingState(skipped_tensors=list(files.skipped), streaming=session)
    return model.eval()


def plan_for_path(
    path: str | Path,
    model_cls: type[nn.Module],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    max_memory: dict[Any, int | str] | int | str = "8GB",
    dense: str = "auto",
    trace_estimate: TraceEstimate | None = None,
) -> StreamPlan:
    """``plan_streaming`` for a checkpoint folder (headers only, plus a 64 MB read-speed probe)."""
    from .pretrained import build_meta_model

    files = CheckpointFiles.open(path)
    model = build_meta_model(model_cls, files.config, dtype)
    device = torch.device(device)
    return plan_streaming(files, model, device, budget_for(max_memory, device), dense, trace_estimate=trace_estimate)
