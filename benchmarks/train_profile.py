"""Where a training step's time goes, part by part (``python -m benchmarks.bench_train --profile``).

A step (``bench_train.train_step``; five, each profiled alone, per part the fastest) runs under ``torch.profiler``
with every module of interest wrapped in a ``record_function`` scope named by its part (``k3_parts`` /
``gpt_parts``; ops outside any named module fall to the innermost named one around them, e.g. a KDA layer's
gates and L2 norms to "kda other"). Backward time is attributed through autograd's sequence numbers: each
``autograd::engine::evaluate_function: <Node>`` event carries the sequence number of the forward op that
created the node, and goes to that op's part. An op count is the number of outermost ``aten::`` calls the part
made (forward and backward; an op's own inner aten calls, such as ``linear``'s ``mm``, are not counted again).

Times are the profiler's wall clock on one thread, so they include its per-op overhead (a few microseconds an
op): a part with many small ops reads high. ``profile_step`` also returns the step's total from the profiler
so the overhead can be read off against the unprofiled step time.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn

_SCOPE = "part:"
_BACKWARD = "autograd::engine::evaluate_function: "
LOSS = "lm head + loss"


def k3_parts(model: nn.Module) -> dict[nn.Module, str]:
    """Part names of a K3ForCausalLM's modules (KDA layers split into projections, short conv, kda_chunk,
    output norm; what a KDA layer does outside those, the gates, L2 norms and output gate, is "kda other";
    a decoder layer's own ops, the AttnRes depth mixes and residual adds, are "attnres + residual")."""
    from k3core.modeling.layers.kda import KimiDeltaAttention, ShortConvolution
    from k3core.modeling.layers.mla import MultiHeadLatentAttention
    from k3core.modeling.layers.moe import LatentMoE

    parts: dict[nn.Module, str] = {model: "lm head + loss", model.model: "output mix + final norm"}
    parts[model.model.embed_tokens] = "embedding"
    for layer in model.model.layers:
        parts[layer] = "attnres + residual"
        parts[layer.input_layernorm] = parts[layer.post_attention_layernorm] = "pre-norms"
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            parts[attn] = "kda other (gates, l2 norm, out gate)"
            for child in attn.children():
                if isinstance(child, nn.Linear):
                    parts[child] = "kda projections"
                elif isinstance(child, ShortConvolution):
                    parts[child] = "kda short conv"
            parts[attn.o_norm] = "kda output norm"
        elif isinstance(attn, MultiHeadLatentAttention):
            parts[attn] = "mla"
        ffn = layer.ffn
        parts[ffn] = "latent moe" if isinstance(ffn, LatentMoE) else "dense ffn"
    parts[model.lm_head] = "lm head + loss"
    return parts


def k3_functions() -> dict[tuple[object, str], str]:
    """Functions scoped as parts of their own: the delta-rule op as the KDA layer calls it."""
    import k3core.modeling.layers.kda as kda_layer

    return {(kda_layer, "kda_chunk"): "kda_chunk"}


def gpt_parts(model: nn.Module) -> dict[nn.Module, str]:
    """Part names of a ``bench_forward.PlainTransformer``."""
    parts: dict[nn.Module, str] = {
        model: "lm head + loss",
        model.embed: "embedding",
        model.norm: "output mix + final norm",
    }
    for block in model.blocks:
        parts[block] = "attention (sdpa) + residual"
        parts[block.attn_norm] = parts[block.mlp_norm] = "pre-norms"
        parts[block.qkv] = parts[block.out] = "attention projections"
        parts[block.gate] = parts[block.up] = parts[block.down] = "dense ffn"
    parts[model.head] = "lm head + loss"
    return parts


@contextlib.contextmanager
def scoped(parts: dict[nn.Module, str], functions: dict[tuple[object, str], str] | None = None) -> Iterator[None]:
    """Run each module's forward (and each ``(owner, attribute)`` function) inside a profiler scope of its part."""

    def wrap(fn: Callable, name: str) -> Callable:
        def run(*args, **kwargs):
            with torch.profiler.record_function(_SCOPE + name):
                return fn(*args, **kwargs)

        return run

    patched: list[tuple[object, str, object, bool]] = []
    try:
        for module, name in parts.items():
            patched.append((module, "forward", module.__dict__.get("forward"), "forward" in module.__dict__))
            module.forward = wrap(module.forward, name)
        for (owner, attr), name in (functions or {}).items():
            patched.append((owner, attr, getattr(owner, attr), True))
            setattr(owner, attr, wrap(getattr(owner, attr), name))
        yield
    finally:
        for owner, attr, old, had in reversed(patched):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)


def _part_of(event) -> str | None:
    """The innermost part scope around a profiler event, or None."""
    e = event
    while e is not None:
        if e.name.startswith(_SCOPE):
            return e.name[len(_SCOPE) :]
        e = e.cpu_parent
    return None


def attribute(events) -> dict[str, dict[str, float]]:
    """ms forward, ms backward and aten op count per part from a profiler's ``events()`` (see the module doc).

    Forward time of a part is its scopes' time minus the nested part scopes inside them; ops of the
    "step:forward" phase outside every part (the GPT's loss, computed outside its module) go to
    "lm head + loss". Backward nodes go to the part of the forward op with their sequence number ("grad
    accumulation" for AccumulateGrad); what "step:backward" spends outside every node is "autograd engine".
    The other ``step:`` phases (zero_grad, clip, optimizer, router bias) keep their own names.
    """
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"fwd_ms": 0.0, "bwd_ms": 0.0, "ops": 0})
    seq_part: dict[int, str] = {}
    backward_nodes = []
    for e in events:
        if e.name.startswith(_SCOPE):
            nested = sum(c.cpu_time_total for c in _descendant_scopes(e))
            out[e.name[len(_SCOPE) :]]["fwd_ms"] += (e.cpu_time_total - nested) / 1e3
        elif e.name.startswith(_BACKWARD):
            backward_nodes.append(e)
        elif e.name == "step:forward":
            nested = sum(c.cpu_time_total for c in _descendant_scopes(e))
            out[LOSS]["fwd_ms"] += (e.cpu_time_total - nested) / 1e3
        elif e.name == "step:backward":
            nodes = sum(c.cpu_time_total for c in _descendants(e, _BACKWARD))
            out["autograd engine"]["bwd_ms"] += (e.cpu_time_total - nodes) / 1e3
        elif e.name.startswith("step:") and e.name != "step:total":
            out[e.name]["fwd_ms"] += e.cpu_time_total / 1e3
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0 and _backward_node(e) is None:
            part = _part_of(e) or (LOSS if _step_scope(e) == "step:forward" else None)
            if part is not None:
                seq_part.setdefault(seq, part)
    for node in backward_nodes:
        if "AccumulateGrad" in node.name:
            node.k3_part = "grad accumulation"
        else:
            # CopySlices (the backward of an in-place copy into a view, e.g. kda_chunk's chunked copies of its
            # inputs) carries no forward op's number.
            fallback = "copy-into-view backward" if "CopySlices" in node.name else "backward (unattributed)"
            node.k3_part = seq_part.get(node.sequence_nr, fallback)
        out[node.k3_part]["bwd_ms"] += node.cpu_time_total / 1e3
    for e in events:
        if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            node = _backward_node(e)
            phase = _step_scope(e)
            part = getattr(node, "k3_part", None) if node is not None else _part_of(e)
            if part is None:
                part = LOSS if phase == "step:forward" else ("autograd engine" if phase == "step:backward" else phase)
            out[part or "other"]["ops"] += 1
    return dict(out)


def _descendant_scopes(event) -> Iterator:
    """The outermost part scopes strictly inside ``event``."""
    return _descendants(event, _SCOPE)


def _descendants(event, prefix: str) -> Iterator:
    """The outermost events named ``prefix...`` strictly inside ``event``."""
    for child in event.cpu_children:
        if child.name.startswith(prefix):
            yield child
        else:
            yield from _descendants(child, prefix)


def _backward_node(event):
    """The ``evaluate_function`` event around ``event`` (itself included), or None."""
    e = event
    while e is not None:
        if e.name.startswith(_BACKWARD):
            return e
        e = e.cpu_parent
    return None


def _step_scope(event) -> str | None:
    e = event
    while e is not None:
        if e.name.startswith("step:"):
            return e.name
        e = e.cpu_parent
    return None


def profile_step(
    step: Callable[[], None], parts: dict[nn.Module, str], functions=None, warmup: int = 1, repeat: int = 5
) -> tuple[dict[str, dict[str, float]], float]:
    """(parts table, the fastest profiled step's total ms) over ``repeat`` profiled calls of ``step``, each its own
    profiler session: each part's forward and backward ms is its minimum over the calls (the profiler's clock
    is wall time, and on a shared machine a burst of load lands on one part of one call), its op count that of
    the fastest call (the same in every call of a fixed step)."""
    tables, totals = [], []
    with scoped(parts, functions):
        for _ in range(warmup):
            step()
        for _ in range(repeat):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.profiler.record_function("step:total"):
                    step()
            events = prof.events()
            totals.append(next(e.cpu_time_total for e in events if e.name == "step:total") / 1e3)
            tables.append(attribute(events))
    fastest = tables[totals.index(min(totals))]
    table = {
        part: {
            "fwd_ms": min(t.get(part, row)["fwd_ms"] for t in tables),
            "bwd_ms": min(t.get(part, row)["bwd_ms"] for t in tables),
            "ops": row["ops"],
        }
        for part, row in fastest.items()
    }
    table.pop("step:total", None)
    return table, min(totals)


def format_side_by_side(tables: dict[str, dict], totals: dict[str, float], plain: dict[str, float]) -> str:
    """A text table, one row per part, ``ms fwd / ms bwd / ops`` for each model (columns in ``tables`` order),
    rows by the first model's total time; then the profiled totals and the unprofiled step times."""
    names = list(tables)
    first = tables[names[0]]
    rows = sorted(
        {p for t in tables.values() for p in t},
        key=lambda p: -sum(first.get(p, {"fwd_ms": 0, "bwd_ms": 0})[k] for k in ("fwd_ms", "bwd_ms")),
    )
    head = f"{'part':38s}" + "".join(f" | {n + ' fwd ms':>11s} {'bwd ms':>7s} {'ops':>6s}" for n in names)
    lines = [head, "-" * len(head)]
    for part in rows:
        line = f"{part:38s}"
        for n in names:
            r = tables[n].get(part)
            line += " | " + (
                f"{r['fwd_ms']:11.1f} {r['bwd_ms']:7.1f} {r['ops']:6d}" if r else f"{'':11s} {'':7s} {'':6s}"
            )
        lines.append(line)
    lines.append("-" * len(head))
    line = f"{'sum of parts (per-part minima)':38s}"
    for n in names:
        t = tables[n]
        fwd = sum(r["fwd_ms"] for r in t.values())
        bwd = sum(r["bwd_ms"] for r in t.values())
        line += f" | {fwd:11.1f} {bwd:7.1f} {sum(r['ops'] for r in t.values()):6d}"
    lines.append(line)
    lines.append(
        "fastest profiled step (wall): "
        + ", ".join(f"{n} {totals[n]:.0f} ms" for n in names)
        + "; unprofiled step (best, CPU time, same process): "
        + ", ".join(f"{n} {plain[n] * 1e3:.0f} ms" for n in names)
    )
    return "\n".join(lines)
