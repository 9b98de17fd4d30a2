"""The survey folder: DIR/survey.json (the plan, progress, layer tables, bins) + DIR/state.npz (arrays), each
written atomically (``save_survey``), and read back without the weights (``read_survey``: bounded reads through
``k3core.utils.files``, JSON and an npz read with ``allow_pickle=False``, every array's name, dtype and shape
checked against the card; a hostile card's layout refused before anything is allocated)."""

from __future__ import annotations

import io
import json
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.survey.aggregates import TopK
from analysis.survey.plan import Layout, SurveyError, SurveyPlan
from analysis.survey.state import EDGES, SurveyState
from k3core.utils.files import atomic_write_bytes, parse_json, read_bytes_limited

SURVEY_FORMAT = "k3lab-survey/1"
CARD_NAME = "survey.json"
STATE_NAME = "state.npz"
MAX_CARD_BYTES = 64 * 1024**2
MAX_STATE_BYTES = 2 * 1024**3


def survey_card(state: SurveyState, run_info: dict[str, Any], complete: bool) -> dict[str, Any]:
    return {
        "format": SURVEY_FORMAT,
        "plan": asdict(state.plan),
        "layout": asdict(state.layout),
        "edges": {k: v.tolist() for k, v in EDGES.items()},
        "done_batches": sorted(state.done),
        "complete": complete,
        "run": run_info,
        "arrays": {
            **{name: [str(a.dtype), list(a.shape)] for name, a in state.sums.items()},
            **{
                f"{name}.{part}": [str(getattr(t, part).dtype), list(getattr(t, part).shape)]
                for name, t in state.tops.items()
                for part in ("score", "id", "payload")
            },
        },
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save_survey(out: str | Path, state: SurveyState, run_info: dict[str, Any], complete: bool = False) -> Path:
    """Write DIR/state.npz then DIR/survey.json, each atomically (the card names the batches in the state)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = dict(state.sums)
    for name, top in state.tops.items():
        arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"] = top.score, top.id, top.payload
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(out / STATE_NAME, buf.getvalue())
    card = survey_card(state, run_info, complete)
    atomic_write_bytes(out / CARD_NAME, json.dumps(card, indent=1).encode())
    return out


@dataclass
class Survey:
    """A survey folder read back: its card (plan, layout, bins, run) and state."""

    path: Path
    card: dict[str, Any]
    state: SurveyState

    @property
    def layout(self) -> Layout:
        return self.state.layout

    @property
    def plan(self) -> SurveyPlan:
        return self.state.plan

    @property
    def complete(self) -> bool:
        return bool(self.card.get("complete"))


def is_survey_dir(path: str | Path) -> bool:
    return (Path(path) / CARD_NAME).is_file()


def read_survey(path: str | Path) -> Survey:
    """A survey folder, read with bounded, checked reads; SurveyError naming what is wrong otherwise."""
    path = Path(path)
    try:
        card = parse_json(read_bytes_limited(path / CARD_NAME, MAX_CARD_BYTES), CARD_NAME, error=SurveyError)
    except OSError as exc:
        raise SurveyError(f"{path}: not a survey folder ({exc.strerror or exc})") from None
    if not isinstance(card, dict) or card.get("format") != SURVEY_FORMAT:
        raise SurveyError(f"{path}: {CARD_NAME} is not a k3lab survey card (format {SURVEY_FORMAT})")
    try:
        plan = SurveyPlan(**card["plan"])
        layout = Layout(**card["layout"])
        done = {int(b) for b in card["done_batches"]}
        declared = dict(card["arrays"])
        _check_layout(layout, plan)
    except (KeyError, TypeError, ValueError) as exc:
        raise SurveyError(f"{path}: corrupt survey card ({type(exc).__name__}: {exc})") from None
    state = SurveyState(layout, plan)
    expected = {name: (str(a.dtype), list(a.shape)) for name, a in state.sums.items()}
    for name, t in state.tops.items():
        for part in ("score", "id", "payload"):
            a = getattr(t, part)
            expected[f"{name}.{part}"] = (str(a.dtype), list(a.shape))
    if {k: tuple(v) for k, v in declared.items()} != expected:
        raise SurveyError(f"{path}: the card's arrays do not match its plan and layout")
    try:
        data = read_bytes_limited(path / STATE_NAME, MAX_STATE_BYTES)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            if set(npz.files) != set(expected):
                raise SurveyError(f"{path}: {STATE_NAME} holds other arrays than its card names")
            arrays = {}
            for name, (dtype, shape) in expected.items():
                a = npz[name]
                if str(a.dtype) != dtype or list(a.shape) != shape:
                    raise SurveyError(f"{path}: {STATE_NAME}: {name} is {a.dtype} {list(a.shape)}, not {dtype} {shape}")
                arrays[name] = a
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, SurveyError):
            raise
        raise SurveyError(f"{path}: {STATE_NAME} is not readable ({type(exc).__name__}: {exc})") from None
    for name in state.sums:
        state.sums[name] = arrays[name]
    for name in state.tops:
        state.tops[name] = TopK(arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"])
    state.done = done
    return Survey(path=path, card=card, state=state)


MAX_LAYOUT = {"experts": 1 << 16, "layers": 4096, "heads": 4096, "vocab": 1 << 22, "seq_len": 1 << 22}


def _check_layout(layout: Layout, plan: SurveyPlan) -> None:
    """Refuse layouts whose arrays would be absurdly large (a hostile card) before anything is allocated."""
    if not 0 <= layout.num_experts <= MAX_LAYOUT["experts"] or len(layout.moe_layers) > MAX_LAYOUT["layers"]:
        raise ValueError("expert or layer count out of range")
    if max(layout.kda_heads, layout.mla_heads) > MAX_LAYOUT["heads"] or layout.vocab_size > MAX_LAYOUT["vocab"]:
        raise ValueError("head count or vocabulary out of range")
    if not 2 <= plan.seq_len <= MAX_LAYOUT["seq_len"] or max(plan.top_contexts, plan.reservoir) > 1024:
        raise ValueError("sequence length or kept contexts out of range")
    if plan.context_before + plan.context_after > 4096 or min(plan.context_before, plan.context_after) < 0:
        raise ValueError("context width out of range")
    if len(layout.token_classes) != layout.vocab_size:
        raise ValueError("token classes do not cover the vocabulary")
    if plan.batch_size < 1 or plan.sequences < 1:
        raise ValueError("batch size or sequence count out of range")
    if state_size_estimate(layout, plan) > MAX_STATE_BYTES:
        raise ValueError(f"its state would take {state_size_estimate(layout, plan):,} bytes, out of range")


def state_size_estimate(layout: Layout, plan: SurveyPlan) -> int:
    """An upper bound of the bytes a survey state of this layout and plan holds (checked before allocating)."""
    E, V = layout.num_experts, layout.vocab_size if layout.count_tokens else 0
    bins = sum(len(v) + 1 for v in EDGES.values())
    width = plan.context_before + 1 + plan.context_after
    per_moe = E * E + E * (bins + E + 2 + 3 * len(layout.layer_sizes) + 16) + E * V
    per_moe += E * (plan.top_contexts + plan.reservoir) * (width + 2)
    heads = max(layout.kda_heads, layout.mla_heads)
    per_mixer = heads * (bins + 2 * plan.seq_len)
    total = len(layout.moe_layers) * per_moe + (len(layout.kda_layers) + len(layout.mla_layers)) * per_mixer
    total += 3 * len(layout.model_sizes) + V + 4 * plan.seq_len + sum(layout.attnres_sites.values()) * 3
    return 8 * total
