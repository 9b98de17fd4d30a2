"""A trace folder's run card checked on its own and against the arrays of each trace, generically: by the axis
names every array carries and the layer index in its name, never by a fixed list of items (the recorder may
add items). Every refusal is one ``TraceError`` naming the file and the field.

On its own (``check_card``): the config (``K3Config.from_dict``), and per text: ``file`` (``trace-<i>.npz``),
``sha256`` (64 hex digits or absent), ``tokens`` (a list of at most ``MAX_TEXT_TOKENS`` ints in the vocabulary;
``MAX_CARD_TOKENS`` over all texts), ``token_strings`` (as many short strings, or absent), ``name``.

Against a trace (``check_trace``; ``check_layout`` makes every check but the token values on the layout a trace
file declares, before any array is inflated): its ``tokens`` array equals the card's; the axes ``token`` and ``query``
have the card's token count (``query`` at most: the attention maps keep the first ``max_attn_len`` queries),
``batch`` the tokens array's batch, ``expert`` the config's number of experts,
``hidden`` its width, ``depth`` at most 2 x layers + 2; an array ``blocks.<i>.<kind>.<item>`` has ``i`` below
the config's layers, and for the kinds the config places (``kda``, ``mla``, ``moe``) each item covers exactly the
config's layers of that kind (a card whose config says 32 layers over arrays of 8 is refused).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..modeling.config import K3Config
from ..utils.input_limits import MAX_TOKENS
from .trace import Trace, TraceNames
from .trace_npz import TraceError

MAX_TEXT_TOKENS = MAX_TOKENS  # one traced text (README: "Limits"; `k3lab trace --max-tokens` allows no more)
MAX_CARD_TOKENS = 262_144  # all texts of one trace folder
MAX_TEXTS = 1024
MAX_TOKEN_STRING = 1024
_FILE_RE = re.compile(r"^trace-\d{1,6}\.npz$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def _field(where: str, index: int, name: str, why: str) -> TraceError:
    return TraceError(f"{where}: texts[{index}].{name} {why}")


def check_card(card: Mapping[str, Any], where: str) -> K3Config:
    """The card's config, after checking every text's fields (see the module docstring); TraceError otherwise."""
    try:
        config = K3Config.from_dict(dict(card["config"]))
    except (TypeError, ValueError, KeyError) as exc:
        raise TraceError(f"{where}: config is not a valid K3 config ({str(exc)[:300]})") from exc
    texts = card["texts"]
    if len(texts) > MAX_TEXTS:
        raise TraceError(f"{where}: texts lists {len(texts):,} texts, over the limit of {MAX_TEXTS:,}")
    total = 0
    for i, text in enumerate(texts):
        file = text.get("file")
        if not isinstance(file, str) or not _FILE_RE.match(file):
            raise _field(where, i, "file", f"is {str(file)[:80]!r}, not a trace file name like 'trace-0.npz'")
        sha = text.get("sha256")
        if sha is not None and (not isinstance(sha, str) or not _SHA_RE.match(sha)):
            raise _field(where, i, "sha256", "is not 64 hexadecimal digits")
        if not isinstance(text.get("name", ""), str) or len(text.get("name", "")) > 1024:
            raise _field(where, i, "name", "is not a string of at most 1,024 characters")
        tokens = text.get("tokens")
        if not isinstance(tokens, list):
            raise _field(where, i, "tokens", f"is {type(tokens).__name__}, not a list of token ids")
        if len(tokens) > MAX_TEXT_TOKENS:
            raise _field(where, i, "tokens", f"holds {len(tokens):,} tokens, over the limit of {MAX_TEXT_TOKENS:,}")
        total += len(tokens)
        if total > MAX_CARD_TOKENS:
            raise TraceError(f"{where}: texts hold over {MAX_CARD_TOKENS:,} tokens in all, over the limit")
        bad = next((t for t in tokens if type(t) is not int or not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise _field(where, i, "tokens", f"holds {str(bad)[:40]!r}, not a token id below {config.vocab_size:,}")
        strings = text.get("token_strings")
        if strings is not None and (
            not isinstance(strings, list)
            or len(strings) != len(tokens)
            or not all(isinstance(s, str) and len(s) <= MAX_TOKEN_STRING for s in strings)
        ):
            raise _field(where, i, "token_strings", f"is not {len(tokens):,} strings of at most {MAX_TOKEN_STRING}")
    return config


def _layer_sets(config: K3Config) -> dict[str, set[int]]:
    layers = range(config.num_hidden_layers)
    return {
        "kda": {i for i in layers if not config.is_mla_layer(i)},
        "mla": {i for i in layers if config.is_mla_layer(i)},
        "moe": {i for i in layers if config.is_moe_layer(i)},
    }


def check_trace(trace: Trace, config: K3Config, tokens: list[int], where: str) -> None:
    """TraceError naming ``where`` and the array when the trace does not fit its card (see the module docstring)."""
    ids = trace.arrays.get(TraceNames.TOKENS)
    if ids is None or ids.ndim != 2 or ids.shape[0] < 1 or ids.dtype.kind not in "iu":
        raise TraceError(f"{where}: array 'tokens' is missing or not [batch, token] token ids")
    if ids.shape[1] != len(tokens) or not np.array_equal(ids[0], np.asarray(tokens, dtype=np.int64)):
        raise TraceError(f"{where}: array 'tokens' ({ids.shape[1]:,} tokens) differs from the card's texts tokens "
                         f"({len(tokens):,})")  # fmt: skip
    check_layout(trace.axes, {name: array.shape for name, array in trace.arrays.items()}, config, len(tokens), where)


def check_layout(
    axes: Mapping[str, tuple[str, ...]],
    shapes: Mapping[str, tuple[int, ...]],
    config: K3Config,
    n_tokens: int,
    where: str,
) -> None:
    """``check_trace``'s checks of names, axes and shapes, on a trace's declared layout (``Trace.layout``: nothing
    inflated yet) of a text of ``n_tokens`` tokens; TraceError naming ``where`` and the array."""
    ids = shapes.get(TraceNames.TOKENS)
    if ids is None or len(ids) != 2 or ids[0] < 1:
        raise TraceError(f"{where}: array 'tokens' is missing or not [batch, token] token ids")
    if ids[1] != n_tokens:
        raise TraceError(f"{where}: array 'tokens' ({ids[1]:,} tokens) differs from the card's texts tokens "
                         f"({n_tokens:,})")  # fmt: skip
    wanted = {"token": n_tokens, "batch": ids[0], "expert": config.num_experts, "hidden": config.hidden_size}
    groups: dict[tuple[str, str], set[int]] = defaultdict(set)
    for name, shape in shapes.items():
        for axis, size in zip(axes[name], shape):
            if axis in wanted and size != wanted[axis]:
                raise TraceError(f"{where}: array {name[:80]!r}: axis {axis!r} has {size:,}, the card says "
                                 f"{wanted[axis]:,}")  # fmt: skip
            if axis == "query" and size > n_tokens:  # attention maps keep the first max_attn_len queries
                raise TraceError(f"{where}: array {name[:80]!r}: axis 'query' has {size:,}, over the card's "
                                 f"{n_tokens:,} tokens")  # fmt: skip
            if axis == "depth" and size > 2 * config.num_hidden_layers + 2:
                raise TraceError(f"{where}: array {name[:80]!r}: {size:,} depths for {config.num_hidden_layers} layers")
        layer = TraceNames.layer_of(name)
        if layer is not None:
            if layer >= config.num_hidden_layers:
                raise TraceError(f"{where}: array {name[:80]!r} is of layer {layer}; the card's config has "
                                 f"{config.num_hidden_layers} layers")  # fmt: skip
            kind, _, item = TraceNames.point_of(name).partition(".")
            groups[(kind, item)].add(layer)
    placed = _layer_sets(config)
    for (kind, item), layers in sorted(groups.items()):
        if kind in placed and layers != placed[kind]:
            raise TraceError(
                f"{where}: arrays 'blocks.<layer>.{kind}.{item}' cover layers {sorted(layers)[:16]} but the card's "
                f"config has {kind} at layers {sorted(placed[kind])[:16]}"
            )
