"""The hook point catalogue: every ``HookPoint`` the model declares, collected from the modules that produce them.

Declarations live beside the code that produces each activation (``k3core.modeling.model``: tokens, embed, the
decoder layer's sub-layer inputs and outputs, the output; ``k3core.modeling.layers.residual``: the depth state and
AttnRes mixes; ``k3core.modeling.layers.kda``, ``mla``, ``moe``: their layers' internals). Everything else is
derived from them here: ``hook_points(config)`` (a model's points, in forward order), ``POINT_AXES`` /
``point_axes`` (axes by name), the points offered on request, and ``points_table()`` (the table in
docs/ARCHITECTURE.md, checked by a test).
"""

from __future__ import annotations

from typing import Any

from ..modeling import model as decoder
from ..modeling.hooks import HookNames, HookPoint
from ..modeling.layers import kda, mla, moe, residual

#: every declared point: the decoder's, the residual stream's, then each layer kind's
ALL_POINTS: tuple[HookPoint, ...] = (
    decoder.TOKENS,
    decoder.EMBED,
    residual.STREAM,
    residual.ATTN_RES_WEIGHTS,
    residual.ATTN_RES_MIX,
    decoder.RESID_IN,
    decoder.MIXER_IN,
    *kda.POINTS,
    *mla.POINTS,
    decoder.MIXER_OUT,
    residual.MLP_RES_WEIGHTS,
    residual.MLP_RES_MIX,
    decoder.FFN_IN,
    *moe.POINTS,
    decoder.FFN_OUT,
    residual.FINAL_STREAM,
    residual.OUTPUT_RES_WEIGHTS,
    residual.OUTPUT_RES_MIX,
    decoder.FINAL_RESID,
    decoder.FINAL_NORM,
    decoder.LOGITS,
    decoder.TOKEN_NLL,
)
#: {local name: declaration}
POINTS: dict[str, HookPoint] = {p.name: p for p in ALL_POINTS}
#: {local name (no ``blocks.i.`` prefix): axes}
POINT_AXES: dict[str, tuple[str, ...]] = {p.name: p.axes for p in ALL_POINTS}
#: local names of the points produced only when a hook asks for them
ON_REQUEST: tuple[str, ...] = tuple(p.name for p in ALL_POINTS if p.on_request)


def point_name(local: str, layer: int | None = None) -> str:
    """The full name of a declared hook point (KeyError for an undeclared one)."""
    return POINTS[local].at(layer)


def point_axes(name: str) -> tuple[str, ...]:
    """Axis names of a hook point's value (a full or local name)."""
    return POINT_AXES[HookNames.point_of(name)]


def attnres_has_attn_site(config: Any, layer: int) -> bool:
    """Whether layer ``layer``'s attention input is a depth mix (block AttnRes: not at layer 0)."""
    return config.uses_attnres and layer > 0


def layer_points(config: Any, i: int) -> list[HookPoint]:
    """The points decoder layer ``i`` of this config produces, in forward order."""
    out = [residual.STREAM]
    if attnres_has_attn_site(config, i):
        out += [residual.ATTN_RES_WEIGHTS, residual.ATTN_RES_MIX]
    out += [decoder.RESID_IN, decoder.MIXER_IN]
    if config.is_mla_layer(i):
        out += [p for p in mla.POINTS if p is not mla.GATE or config.mla_output_gate]
    else:
        out += list(kda.POINTS)
    out.append(decoder.MIXER_OUT)
    if config.uses_attnres:
        out += [residual.MLP_RES_WEIGHTS, residual.MLP_RES_MIX]
    out.append(decoder.FFN_IN)
    if config.is_moe_layer(i):
        out += [p for p in moe.POINTS if p is not moe.SHARED_OUT or config.num_shared_experts]
    out.append(decoder.FFN_OUT)
    return out


def hook_points(config: Any) -> list[str]:
    """Every hook point a model of this config offers, in forward order."""
    out = [decoder.TOKENS.at(), decoder.EMBED.at()]
    for i in range(config.num_hidden_layers):
        out += [p.at(i) for p in layer_points(config, i)]
    out.append(residual.FINAL_STREAM.at())
    if config.uses_attnres:
        out += [residual.OUTPUT_RES_WEIGHTS.at(), residual.OUTPUT_RES_MIX.at()]
    out += [p.at() for p in (decoder.FINAL_RESID, decoder.FINAL_NORM, decoder.LOGITS, decoder.TOKEN_NLL)]
    return out


def source_label(source: residual.Source) -> str:
    """How a depth source is named for people, in traces (``meta["attnres_sources"]``) and in edits: "embedding",
    "block 2" ("block 2 (partial)" while the block is open), "L3.attn", "L3.ffn"."""
    if source.kind == "embedding":
        return "embedding"
    if source.kind == "block":
        return f"block {source.index}" + (" (partial)" if source.partial else "")
    return f"L{source.index}.{source.kind}"


def points_table() -> str:
    """The hook point table of docs/ARCHITECTURE.md (markdown), from the declarations."""
    rows = ["| hook point | axes | meaning |", "|---|---|---|"]
    for p in ALL_POINTS:
        name = f"blocks.i.{p.name}" if p.per_layer else p.name
        meaning = p.meaning + (" (on request)" if p.on_request else "")
        rows.append(f"| `{name}` | [{', '.join(p.axes)}] | {meaning} |")
    return "\n".join(rows)
