"""The survey folder: DIR/survey.json (the plan, progress, layer tables, bins) + DIR/state.npz (arrays), written
by one process at a time (``survey_lock``) and read back without the weights (``read_survey``: bounded reads through
``k3core.utils.files``, JSON and an npz read with ``allow_pickle=False``, every array's name, dtype and shape
checked against the card; a hostile card's layout refused before anything is allocated).

The state cannot disagree with itself: state.npz holds the batch set beside the counts it made (``done_batches``),
written in one atomic replace, and the card, replaced after it, carries the state's SHA-256. A card that names
other batches than its state, or another state, is refused naming the folder; one whose state is newer (a writer
died between the two replaces) is continued from the state by the next run of the survey (``read_survey(...,
continuing=True)``), which counts each batch once."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.survey.aggregates import TopK
from analysis.survey.plan import Layout, SurveyError, SurveyPlan
from analysis.survey.state import EDGES, SurveyState
from k3core.utils.files import (
    OutputFolderError,
    atomic_write_bytes,
    check_output_folder,
    parse_json,
    read_bytes_limited,
)

SURVEY_FORMAT = "k3lab-survey/1"
CARD_NAME = "survey.json"
STATE_NAME = "state.npz"
LOCK_NAME = ".survey.lock"  # holds the writer's pid; locked (flock) while a survey writes the folder
DONE_ARRAY = "done_batches"  # state.npz: the batches whose counts it holds
MAX_CARD_BYTES = 64 * 1024**2
MAX_STATE_BYTES = 2 * 1024**3


def check_survey_folder(out: str | Path) -> Path:
    """``out`` when a survey may be written there (``check_output_folder``: new, empty, or a survey folder, which
    the survey continues); SurveyError naming it otherwise."""
    try:
        return check_output_folder(out, (CARD_NAME, STATE_NAME, LOCK_NAME), "survey folder")
    except OutputFolderError as exc:
        raise SurveyError(str(exc)) from None


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


def state_arrays(state: SurveyState) -> dict[str, np.ndarray]:
    """Every array of a state by its npz name, with the batch set (``DONE_ARRAY``, sorted) beside its counts."""
    arrays = dict(state.sums)
    for name, top in state.tops.items():
        arrays[f"{name}.score"], arrays[f"{name}.id"], arrays[f"{name}.payload"] = top.score, top.id, top.payload
    arrays[DONE_ARRAY] = np.array(sorted(state.done), dtype=np.int64)
    return arrays


def save_survey(out: str | Path, state: SurveyState, run_info: dict[str, Any], complete: bool = False) -> Path:
    """Write DIR/state.npz (counts and batch set, one atomic replace) then DIR/survey.json (atomic, with the
    state's SHA-256), under ``survey_lock``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with survey_lock(out):
        buf = io.BytesIO()
        np.savez_compressed(buf, **state_arrays(state))
        data = buf.getvalue()
        atomic_write_bytes(out / STATE_NAME, data)
        card = {**survey_card(state, run_info, complete), "state_sha256": hashlib.sha256(data).hexdigest()}
        atomic_write_bytes(out / CARD_NAME, json.dumps(card, indent=1).encode())
    return out


# One writer per folder: folders this process holds the lock of (realpath -> [descriptor, depth]).
_HELD: dict[str, list[int]] = {}


@contextmanager
def survey_lock(out: str | Path) -> Iterator[Path]:
    """Hold DIR/.survey.lock (an exclusive ``flock``, the holder's pid written in it) while the block runs; a
    SurveyError naming the folder and the holder when another process holds it. The kernel drops the lock with its
    process, so a writer killed with -9 leaves the file but never a lock. Re-entrant within a process. A folder
    this made that holds nothing but the lock file when the block ends is removed again."""
    out = Path(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield out
        finally:
            _HELD[key][1] -= 1
        return
    lock = out / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise SurveyError(
                f"{out}: another survey (pid {holder}) is writing this folder; wait for it to finish, or choose "
                "another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = [fd, 1]
        try:
            yield out
        finally:
            del _HELD[key]
            if made and {p.name for p in out.iterdir()} == {LOCK_NAME}:
                lock.unlink(missing_ok=True)
                out.rmdir()
    finally:
        os.close(fd)  # releases the lock


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
        return len(self.state.done) == self.plan.batches


def is_survey_dir(path: str | Path) -> bool:
    return (Path(path) / CARD_NAME).is_file()


def read_survey(path: str | Path, continuing: bool = False) -> Survey:
    """A survey folder, read with bounded, checked reads; SurveyError naming what is wrong otherwise (the module
    docstring: a card and state that disagree are refused). ``continuing``: the survey is being run again into the
    folder, and a state newer than its card (a save cut short between the two files) is taken as it is."""
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
        card_done = _batch_set(card["done_batches"], plan)
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
            if set(npz.files) != {*expected, DONE_ARRAY}:
                raise SurveyError(f"{path}: {STATE_NAME} holds other arrays than its card names")
            done_array = npz[DONE_ARRAY]
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
    try:
        state.done = _batch_set(done_array, plan)
    except ValueError as exc:
        raise SurveyError(f"{path}: {STATE_NAME}: {exc}") from None
    _check_agreement(path, card, hashlib.sha256(data).hexdigest(), card_done, state, continuing)
    return Survey(path=path, card=card, state=state)


def _batch_set(values: Any, plan: SurveyPlan) -> set[int]:
    """A list of batch numbers as a set; ValueError unless each is a distinct batch of ``plan``."""
    batches = np.asarray(values)
    if batches.ndim != 1 or (batches.size and batches.dtype.kind not in "iu"):
        raise ValueError(f"done_batches is not a list of batch numbers ({str(batches.dtype)} {list(batches.shape)})")
    if batches.size > plan.batches:
        raise ValueError(f"done_batches names {batches.size:,} batches; the plan has {plan.batches:,}")
    done = {int(b) for b in batches.tolist()}
    outside = sorted(b for b in done if not 0 <= b < plan.batches)
    if outside or len(done) != batches.size:
        why = f"batch {outside[0]} is not one of the plan's 0..{plan.batches - 1}" if outside else "a batch repeats"
        raise ValueError(f"done_batches: {why}")
    return done


def _check_agreement(
    path: Path, card: dict[str, Any], digest: str, card_done: set[int], state: SurveyState, continuing: bool
) -> None:
    """Refuse a card and a state that disagree (module docstring), naming the folder and what differs."""
    plan = state.plan
    sequences = sum(min(plan.batch_size, plan.sequences - b * plan.batch_size) for b in state.done)
    if int(state.sums["sequences"][0]) != sequences:
        raise SurveyError(
            f"{path}: {STATE_NAME} counts {int(state.sums['sequences'][0]):,} sequences, but its "
            f"{len(state.done):,} batches hold {sequences:,}; the state was edited or damaged"
        )
    if card.get("state_sha256") != digest:
        if continuing and card_done <= state.done:
            return  # a save cut short after state.npz: the state is whole, its card one save behind
        behind = " (run the same k3lab survey command on it to continue)" if card_done <= state.done else ""
        raise SurveyError(
            f"{path}: {CARD_NAME} does not describe this {STATE_NAME} (a save was cut short, or a file was "
            f"edited){behind}"
        )
    if card_done != state.done or bool(card.get("complete")) != (len(state.done) == plan.batches):
        raise SurveyError(
            f"{path}: {CARD_NAME} was edited: it names {len(card_done):,} done batches"
            f"{', complete' if card.get('complete') else ''}; {STATE_NAME} holds {len(state.done):,} of "
            f"{plan.batches:,}"
        )


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
