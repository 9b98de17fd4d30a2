"""Interventions: edits of the forward pass as plain data.

    edits = [MoEEdit(op="ban", layer=3, experts=[5]), AttnResEdit(site="4.attn", mode="uniform")]
    with intervene(model, edits):
        out = model(input_ids)
    edits_to_json(edits)   # -> '[{"kind": "moe", "op": "ban", ...}, ...]'; edits_from_json() reads it back

Every edit is a dataclass (``to_dict`` / ``edit_from_dict``, JSON through ``edits_to_json`` /
``edits_from_json``) that becomes write hooks on named hook points (``k3core.modeling.hooks``); the kinds
themselves live in ``k3core.interp.edit_kinds``, this module reads them and applies them:

- ``ValueEdit``: zero / scale / replace / add a vector at any hook point, in chosen layers, on a token
  range, heads and channels (e.g. ``ValueEdit("mixer_out", "zero", layers=[2])`` removes layer 2's
  attention output, exactly what ``analysis.metrics.importance`` ablates).
- ``AttnResEdit``: a site's depth weights uniform, one-hot on a source, or sources masked and the rest
  renormalised (sources by index or by name: "embedding", "block 1", "L0.attn", ...).
- ``KDAEdit``: pin or scale the decay g, scale beta, reset the state before a position (alpha := 0
  there), output gate off (gate := 1), zero or scale the state carried out of chosen chunks (the
  ``kda.chunk_state`` hook point: "reset the memory at chunk n").
- ``MoEEdit``: ban experts (never selected), force experts (always selected), uniform routing (the
  chosen experts get equal weights, routed_scaling_factor / k each), selection bias off, shared
  experts off.
- ``MLAEdit``: mask a key range (optionally for some heads or queries); a query left with no key gets
  a zero attention output.

An edit naming a point, layer, head, expert or source that does not exist raises ``EditError`` saying
what exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..modeling.hooks import hooks
from ..utils import input_limits as limits
from ..utils.files import parse_json
from .edit_kinds import EDIT_KINDS, Edit, EditError

__all__ = ["compile_edits", "edit_from_dict", "edits_from_json", "edits_to_json", "intervene", "parse_edit"]


def edit_from_dict(data: dict[str, Any]) -> Edit:
    """The edit a ``to_dict`` wrote (EditError for an unknown kind or field)."""
    if not isinstance(data, dict):
        raise EditError(f"an edit is an object with a 'kind', got {limits.shown(data)}")
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in EDIT_KINDS:
        raise EditError(f"unknown edit kind {limits.shown(kind)}; kinds: {', '.join(EDIT_KINDS)}")
    cls = EDIT_KINDS[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields
    if unknown:
        raise EditError(f"{kind} edit has no field(s) {limits.shown(sorted(unknown))}; fields: {sorted(fields)}")
    try:
        if "value" in data:
            data["value"] = limits.finite_values(data["value"], f"{kind} edit value")
        if data.get("layer") is not None:
            data["layer"] = limits.index(data["layer"], f"{kind} edit layer")
    except limits.InputLimitError as exc:
        raise EditError(str(exc)) from None
    try:
        return cls(**data)
    except TypeError as exc:
        raise EditError(f"bad {kind} edit {limits.shown(data, 200)}: {limits.shown(str(exc), 200)}") from None


def edits_to_json(edits: Iterable[Edit]) -> str:
    return json.dumps([e.to_dict() for e in edits])


def edits_from_json(text: str) -> list[Edit]:
    """Edits from JSON: a list of edit objects (or one object), bounded (``k3core.utils.input_limits``: length, nesting
    depth, number of edits; NaN / Infinity and other non-JSON refused)."""
    try:
        limits.text(text, "the edits", limits.MAX_EDIT_JSON_CHARS)
        limits.json_depth(text, "the edits' JSON")
    except limits.InputLimitError as exc:
        raise EditError(str(exc)) from None
    data = parse_json(text, "the edits", error=EditError)
    edits = data if isinstance(data, list) else [data]
    if len(edits) > limits.MAX_EDITS:
        raise EditError(f"{len(edits):,} edits, over the limit of {limits.MAX_EDITS}")
    return [edit_from_dict(d) for d in edits]


def _short_value(text: str) -> Any:
    """ "3" -> 3, "0.5" -> 0.5, "1,2" -> [1, 2], "2:6" -> [2, 6], anything else stays a string."""
    if ":" in text and all(p.strip().lstrip("-").isdigit() for p in text.split(":")):
        return [int(p) for p in text.split(":")]
    if "," in text:
        return [_short_value(p) for p in text.split(",") if p]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


_LIST_FIELDS = ("layers", "heads", "channels", "experts", "sources", "chunks")


def parse_edit(text: str) -> Edit:
    """One edit from JSON (``{"kind": ...}``) or the short form ``KIND.OP key=value ...``, e.g.
    ``moe.ban layer=2 experts=1,5``, ``value.zero point=mixer_out layers=2``, ``attnres.uniform
    site=3.attn``, ``kda.pin_g layer=1 value=0 tokens=4:9``, ``mla.mask_keys layer=3 keys=0:1``
    (lists with commas, ranges start:stop; for attnres the OP is the mode)."""
    try:
        text = limits.text(text, "an edit", limits.MAX_EDIT_JSON_CHARS).strip()
    except limits.InputLimitError as exc:
        raise EditError(str(exc)) from None
    if not text:
        raise EditError("an empty edit: give KIND.OP key=value ... or a JSON object")
    if text.startswith("{"):
        return edits_from_json(text)[0]
    head, *pairs = text.split()
    kind, _, op = head.partition(".")
    if kind not in EDIT_KINDS:
        raise EditError(
            f"unknown edit kind {limits.shown(kind)} in {limits.shown(text)}; kinds: {', '.join(EDIT_KINDS)}"
        )
    data: dict[str, Any] = {"kind": kind}
    if op:
        data["mode" if kind == "attnres" else "op"] = op
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise EditError(f"expected key=value in {limits.shown(text)}, got {limits.shown(pair)}")
        parsed = _short_value(value)
        if key in _LIST_FIELDS and not isinstance(parsed, list):
            parsed = [parsed]
        data[key] = parsed
    return edit_from_dict(data)


def compile_edits(config: Any, edits: Iterable[Edit]) -> dict[str, list[Callable]]:
    """{hook point: write hooks} for the edits on a model of this config (validated: EditError)."""
    table: dict[str, list[Callable]] = {}
    for edit in edits:
        if isinstance(edit, dict):
            edit = edit_from_dict(edit)
        for name, fn in edit.hooks(config):
            table.setdefault(name, []).append(fn)
    return table


@contextlib.contextmanager
def intervene(model: torch.nn.Module, edits: Iterable[Edit | dict[str, Any]]) -> Iterator[None]:
    """Forwards of ``model`` inside the block run with the edits applied (in the calling context only)."""
    with hooks(write=compile_edits(model.config, edits)):
        yield
