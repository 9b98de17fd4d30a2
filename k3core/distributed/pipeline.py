"""A pipeline-parallel traced forward over ``torch.distributed`` (gloo on CPUs, NCCL on GPUs; launched by torchrun).

Rank r holds the contiguous decoder layers ``k3core.distributed.rank_plan.split_layers`` gives it (the embedding on rank
0; the output depth mix, final norm and LM head on the last rank) and reads only those tensors from the checkpoint
(``load_stage``). Each text is one micro-batch: rank 0 embeds it and runs its layers, then hands the residual
state on (``send_stream``): under AttnRes that is every completed block representation plus the partial block
sum (``DepthStream.bank`` + ``last``, with their sources), not one hidden vector; rank 0 goes on with
the next text while rank 1 works on the first. Each rank records its own layers' trace items with the ordinary
recorder (``k3core.interp.recorder.record``); ``gather_traces`` sends the parts to rank 0 and ``merge_traces`` joins
them into the trace one process would have recorded.

Faults: every wait has a timeout (``timeout`` seconds); a peer that died shows at once as a closed connection.
Either way the waiting rank raises ``PipelineError`` naming the peer rank and its layers, and a rank stopped by
the launcher (SIGTERM after another rank failed) says what it was waiting for. Nothing is written by a rank but
rank 0, and rank 0 writes only after every part has arrived.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..interp.hidden_moments import MOMENT_AXES, PAIR_KINDS, SKETCH_META, depth_moments, sketch_projection
from ..interp.recorder import record
from ..interp.trace import Trace, TraceNames
from ..loading.folder import CONFIG_NAME, INDEX_NAME, MAX_INDEX_BYTES, TOKENIZER_FILES, CheckpointFiles
from ..loading.into_parameters import published_tensors, stream_weights
from ..loading.names import canonical_name
from ..loading.pretrained import build_meta_model, check_headers, load_config
from ..loading.tensor_info import CheckpointError
from ..modeling.config import K3Config
from ..modeling.hooks import active, point
from ..modeling.layers.residual import DepthStream, Source
from ..modeling.model import TOKENS, K3ForCausalLM
from ..utils.files import parse_json, read_bytes_limited
from .rank_plan import RankPlan, model_sizes, plan_for

_ACTIVITY = {"now": "starting"}  # what this rank is doing, for the message when the launcher stops it


class PipelineError(RuntimeError):
    """A rank of the pipeline failed, died or hung; the message names it and its layers."""


@dataclass(frozen=True)
class Stage:
    """This process's part of the pipeline."""

    rank: int
    world_size: int
    plan: RankPlan
    timeout: float

    @property
    def start(self) -> int:
        return self.plan.ranks[self.rank].start

    @property
    def stop(self) -> int:
        return self.plan.ranks[self.rank].stop

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1

    def describe(self, rank: int) -> str:
        share = self.plan.ranks[rank]
        return f"rank {rank} (layers {share.start}-{share.stop - 1})"


def _doing(what: str) -> None:
    _ACTIVITY["now"] = what


def install_stop_message(rank: int) -> None:
    """On SIGTERM (the launcher stopping the others after one rank failed): say what this rank was doing."""

    def stopped(signum, frame):  # noqa: ARG001
        print(f"k3lab trace: rank {rank} stopped by the launcher while {_ACTIVITY['now']}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)


# --------------------------------------------------------------------------------------------- loading
def owned_prefixes(config: K3Config, start: int, stop: int, first: bool, last: bool) -> tuple[str, ...]:
    """State-dict name prefixes of the modules a stage holds."""
    prefixes = [f"model.layers.{i}." for i in range(start, stop)]
    if first or (last and config.tie_word_embeddings):
        prefixes.append("model.embed_tokens.")
    if last:
        prefixes += ["model.norm.", "model.output_attn_res_", "lm_head."]
    return tuple(prefixes)


def _materialise_owned(model: torch.nn.Module, prefixes: tuple[str, ...], device: str | torch.device) -> None:
    """Give storage on ``device`` to the meta tensors under ``prefixes``; the rest stays on the meta device."""
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for leaf, t in list(table.items()):
                if t is None or not f"{module_name}.{leaf}".startswith(prefixes):
                    continue
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                table[leaf] = (
                    torch.nn.Parameter(empty, requires_grad=False) if isinstance(t, torch.nn.Parameter) else empty
                )
    if model.config.tie_word_embeddings and not model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight


def stage_plan(config: K3Config, dtype: torch.dtype | None, world_size: int) -> RankPlan:
    """The layer ranges of ``world_size`` ranks, from the config alone (a meta-device model's bytes in ``dtype``),
    so that every node computes the same split whatever shards it holds."""
    sizes = model_sizes(build_meta_model(K3ForCausalLM, config, dtype), dtype or torch.float32)
    return plan_for(sizes, config.num_hidden_layers, world_size=world_size)


def _own_shards(path: Path, prefixes: tuple[str, ...], view: Path) -> Path:
    """A folder of links to config, tokenizer and only the shards holding tensors under ``prefixes`` (with an
    index of those shards), so the headers of other nodes' shards are never needed. A single-file checkpoint is
    used as it is."""
    if not (path / INDEX_NAME).is_file():
        return path
    index = parse_json(read_bytes_limited(path / INDEX_NAME, MAX_INDEX_BYTES), INDEX_NAME, error=CheckpointError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path.name}/{INDEX_NAME}: no weight_map")
    shards = sorted({f for raw, f in weight_map.items() if (n := canonical_name(raw)) and n.startswith(prefixes)})
    missing = [f for f in shards if not (path / str(f)).is_file()]
    if missing:
        raise CheckpointError(f"{path.name}: this node needs the shards holding its layers; missing: {missing[:8]}")
    for name in (CONFIG_NAME, *TOKENIZER_FILES, *shards):
        if (path / name).is_file():
            (view / name).symlink_to((path / name).resolve())
    kept = {raw: f for raw, f in weight_map.items() if f in set(shards)}
    (view / INDEX_NAME).write_text(json.dumps({"metadata": index.get("metadata", {}), "weight_map": kept}))
    return view


def load_stage(
    path: str | Path, stage: Stage, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[K3ForCausalLM, int]:
    """The model with only this stage's modules loaded (the rest on the meta device), and the tensor bytes read.

    Only the shards holding this stage's tensors are opened (headers, then this stage's tensor data), so a node
    needs only its own shards on disk."""
    path = Path(path)
    config = load_config(path)
    prefixes = owned_prefixes(config, stage.start, stage.stop, stage.first, stage.last)
    with tempfile.TemporaryDirectory(prefix="k3lab-stage-") as tmp:
        files = CheckpointFiles.open(_own_shards(path, prefixes, Path(tmp)))
        model = build_meta_model(K3ForCausalLM, files.config, dtype)
        expected = {n: t for n, t in published_tensors(model).items() if n.startswith(prefixes) or n in files.tensors}
        check_headers(files, expected)
        mine = replace(files, tensors={n: i for n, i in files.tensors.items() if n.startswith(prefixes)}, bytes_read=0)
        _materialise_owned(model, prefixes, device)
        stream_weights(model, mine)
    return model.eval(), mine.bytes_read


# --------------------------------------------------------------------------------------------- hand-off
def _comm_device(tensor_device: torch.device) -> torch.device:
    return tensor_device if dist.get_backend() == "nccl" else torch.device("cpu")


def _wait(work, stage: Stage, peer: int, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=stage.timeout))
    except RuntimeError as exc:
        raise PipelineError(
            f"rank {stage.rank}: {what} from {stage.describe(peer)} never came: that rank died or hung (waited at "
            f"most the {stage.timeout:g} s timeout; {str(exc).splitlines()[0][:200]})"
        ) from exc


def _send_bytes(data: bytes, dst: int, device: torch.device) -> list:
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if data
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
    return [dist.isend(size, dst), dist.isend(payload, dst), size, payload]


def _recv_bytes(src: int, stage: Stage, device: torch.device, what: str) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _wait(dist.irecv(size, src), stage, src, what)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait(dist.irecv(payload, src), stage, src, what)
    return payload.cpu().numpy().tobytes()


def send_stream(stream: DepthStream, stage: Stage, text: int) -> list:
    """Hand the residual state on to the next rank (non-blocking; keep the returned handles until done)."""
    sources, names = stream.sources()
    stacked = torch.stack(sources).contiguous()
    device = _comm_device(stacked.device)
    header = {
        "bank_names": [list(s) for s in stream.bank_names],
        "last_name": None if stream.last_name is None else list(stream.last_name),
        "has_last": stream.last is not None,
        "shape": list(stacked.shape),
        "dtype": str(stacked.dtype).removeprefix("torch."),
        "text": text,
    }
    _doing(f"handing text {text} on to {stage.describe(stage.rank + 1)}")
    handles = _send_bytes(json.dumps(header).encode(), stage.rank + 1, device)
    tensor = stacked.to(device)
    return [*handles, dist.isend(tensor, stage.rank + 1), tensor]


def recv_stream(config: K3Config, stage: Stage, text: int, device: torch.device) -> DepthStream:
    """The residual state of text ``text`` from the previous rank."""
    src = stage.rank - 1
    what = f"the residual state of text {text} (entering layer {stage.start})"
    _doing(f"waiting for {what} from {stage.describe(src)}")
    comm = _comm_device(device)
    header = json.loads(_recv_bytes(src, stage, comm, what))
    if header["text"] != text:
        raise PipelineError(f"rank {stage.rank}: got text {header['text']} from rank {src}, expected {text}")
    stacked = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]), device=comm)
    _wait(dist.irecv(stacked, src), stage, src, what)
    stacked = stacked.to(device)
    n_bank = len(header["bank_names"])
    last = header["last_name"]
    return DepthStream(
        tuple(stacked[:n_bank].unbind(0)),
        tuple(Source(*s) for s in header["bank_names"]),
        stacked[n_bank] if header["has_last"] else None,
        None if last is None else Source(*last),
    )


# --------------------------------------------------------------------------------------------- the forward
@torch.no_grad()
def run_stage(
    model: K3ForCausalLM, stage: Stage, texts: list[torch.Tensor], what: str | tuple = "all", max_attn_len: int = 1024
) -> tuple[list[Trace], list[torch.Tensor | None]]:
    """Every text through this stage as one micro-batch each; per text this rank's trace part (and, on the last
    rank, the logits). Raises PipelineError."""
    device = next(p.device for p in model.parameters() if not p.is_meta)
    parts, logits, pending = [], [], []
    for m, ids in enumerate(texts):
        ids = ids.to(device)
        T = int(ids.shape[1])
        # window=None: each rank keeps its layers' hidden states whole (the whole-text moments of one rank lack the
        # pair across a rank boundary, so merge_traces leaves them out)
        with record(
            model, what=what, max_tokens=T, max_batch=ids.shape[0], max_attn_len=max_attn_len, window=None
        ) as trace:
            if stage.first:
                stream = model.model.begin(ids)  # the tokens' hook point starts the recorder's forward
            else:
                point(active(), TOKENS.at(), ids)
                stream = recv_stream(model.config, stage, m, device)
            for i in range(stage.start, stage.stop):
                _doing(f"running layer {i} on text {m}")
                stream = model.model.layers[i](stream, None)
            if stage.last:
                _doing(f"running the output mix, norm and LM head on text {m}")
                out = model.head(model.model.end(stream), labels=ids)
                trace.meta["pipeline_loss"] = float(out.loss) if out.loss is not None else None
                logits.append(out.logits.float().cpu())
            else:
                pending.append(send_stream(stream, stage, m))
                logits.append(None)
        parts.append(trace)
    for handles in pending:
        for h in handles:
            if hasattr(h, "wait"):
                _wait(h, stage, stage.rank + 1, "handing on the residual state")
    return parts, logits


def barrier(stage: Stage, what: str) -> None:
    """Every rank here before any goes on (with the timeout; a rank that fails to arrive is named)."""
    _doing(f"waiting for {what}")
    try:
        dist.monitored_barrier(
            timeout=timedelta(seconds=stage.timeout)
        ) if dist.get_backend() == "gloo" else dist.barrier()
    except RuntimeError as exc:
        late = sorted({int(r) for r in re.findall(r"[Rr]ank (\d+)", str(exc)) if int(r) != stage.rank})
        named = ", ".join(stage.describe(r) for r in late if r < stage.world_size) or "another rank"
        raise PipelineError(
            f"rank {stage.rank}: {named} never arrived while waiting for {what} (it failed, died or hung; waited at "
            f"most the {stage.timeout:g} s timeout)"
        ) from exc


# --------------------------------------------------------------------------------------------- gathering
def _trace_bytes(trace: Trace) -> bytes:
    buf = io.BytesIO()
    header = json.dumps({"meta": trace.meta, "axes": {k: list(v) for k, v in trace.axes.items()}})
    np.savez(
        buf, __header__=np.frombuffer(header.encode(), dtype=np.uint8), **{f"a/{k}": v for k, v in trace.arrays.items()}
    )
    return buf.getvalue()


def _trace_from_bytes(data: bytes) -> Trace:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        header = json.loads(bytes(npz["__header__"]).decode())
        arrays = {k[2:]: npz[k] for k in npz.files if k.startswith("a/")}
    return Trace(arrays=arrays, axes={k: tuple(v) for k, v in header["axes"].items()}, meta=header["meta"])


def gather_traces(parts: list[Trace], stage: Stage, extra: dict) -> tuple[list[list[Trace]], list[dict]] | None:
    """Every rank's trace parts (and its small ``extra`` dict) on rank 0: ([per text: parts in rank order],
    [extra per rank]); None on the other ranks."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if stage.rank != 0:
        _doing("handing its trace to rank 0")
        blob = json.dumps(extra).encode()
        handles = _send_bytes(blob, 0, device)
        for trace in parts:
            handles += _send_bytes(_trace_bytes(trace), 0, device)
        for h in handles:
            if hasattr(h, "wait"):
                _wait(h, stage, 0, "handing the trace to rank 0")
        return None
    by_text = [[p] for p in parts]
    extras = [extra]
    for src in range(1, stage.world_size):
        what = "the trace"
        _doing(f"waiting for the trace of {stage.describe(src)}")
        extras.append(json.loads(_recv_bytes(src, stage, device, what)))
        for m in range(len(parts)):
            by_text[m].append(_trace_from_bytes(_recv_bytes(src, stage, device, what)))
    return by_text, extras


def merge_traces(parts: list[Trace]) -> Trace:
    """One trace from the ranks' parts (rank order): per-layer arrays side by side, the hidden states of each rank's
    layers stacked along depth, the whole-text moments too (``merge_moments``), tokens from rank 0 (checked equal on
    every rank), the loss from the last rank."""
    merged = Trace(meta=dict(parts[0].meta))
    merged.meta.pop("pipeline_loss", None)
    sources: dict = {}
    for part in parts:
        sources.update(part.meta.get(TraceNames.ATTNRES_SOURCES_META, {}))
        for name, array in part.arrays.items():
            if name in (TraceNames.HIDDEN, TraceNames.HIDDEN_RMS) or _is_moment(name):
                continue  # stacked below
            if name in merged.arrays:
                if not np.array_equal(merged.arrays[name], array):
                    raise PipelineError(f"the ranks disagree on trace array {name!r}")
                continue
            merged.add(name, array, part.axes[name])
    if sources:
        merged.meta[TraceNames.ATTNRES_SOURCES_META] = sources
    for name in (TraceNames.HIDDEN, TraceNames.HIDDEN_RMS):
        pieces = [p.arrays[name] for p in parts if name in p.arrays]
        if pieces:
            merged.add(name, np.concatenate(pieces, axis=0), parts[0].axes.get(name) or parts[-1].axes[name])
    merge_moments(parts, merged)
    coverage = {k: v for p in parts for k, v in p.meta.get("coverage", {}).items() if k in merged.arrays}
    merged.meta["coverage"] = {k: coverage[k] for k in merged.arrays if k in coverage}
    merged.meta["run"] = {"loss": parts[-1].meta.get("pipeline_loss")}
    return merged


def _is_moment(name: str) -> bool:
    return name.startswith(TraceNames.hidden_bins("count").removesuffix("count"))


def merge_moments(parts: list[Trace], merged: Trace) -> None:
    """The whole-text hidden-state moments (``hidden_bins.*``) of the ranks' parts into ``merged``, as one process
    records them: each rank's depths stacked, and between two ranks the pair moments (cross Gram, cosine sum) of the
    last depth of one and the first of the next, from their hidden states (every rank keeps them whole), with the
    recorder's own definition (``k3core.interp.hidden_moments.depth_moments``, the same sketch)."""
    held = [p for p in parts if TraceNames.HIDDEN in p.arrays and _is_moment_in(p)]
    if not held:
        return
    count = TraceNames.hidden_bins("count")
    merged.add(count, held[0].arrays[count], held[0].axes[count])
    bins = [int(b) for b in held[0].arrays[TraceNames.POSITION_BINS]]
    sketch = held[0].meta.get(SKETCH_META)
    projection = None if sketch is None else sketch_projection(held[-1].arrays[TraceNames.HIDDEN].shape[-1],
                                                                sketch["dim"], sketch["seed"])  # fmt: skip
    kinds = [k for k in MOMENT_AXES if TraceNames.hidden_bins(k) in held[0].arrays or k in PAIR_KINDS]
    pieces: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
    for r, part in enumerate(held):
        if r > 0:  # the pair across the boundary: previous rank's last depth -> this rank's first
            states = [
                torch.from_numpy(p.arrays[TraceNames.HIDDEN][d]).double() for p, d in ((held[r - 1], -1), (part, 0))
            ]
            _, carry = depth_moments(states[0], None, bins, projection)
            pair, _ = depth_moments(states[1], carry, bins, projection)
            for kind in PAIR_KINDS:
                if kind in pair:
                    pieces[kind].append(pair[kind].numpy()[None])
        for kind in kinds:
            name = TraceNames.hidden_bins(kind)
            if name in part.arrays:
                pieces[kind].append(part.arrays[name])
    for kind, values in pieces.items():
        if values:
            merged.add(TraceNames.hidden_bins(kind), np.concatenate(values, axis=0), MOMENT_AXES[kind])
    if sketch is not None:
        merged.meta[SKETCH_META] = sketch


def _is_moment_in(part: Trace) -> bool:
    return any(_is_moment(n) for n in part.arrays)


def init_from_env(timeout: float) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): NCCL with one
    GPU per process when CUDA is available and ``K3LAB_BACKEND`` is not "gloo", else gloo on the CPU."""
    use_cuda = torch.cuda.is_available() and os.environ.get("K3LAB_BACKEND", "") != "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device
