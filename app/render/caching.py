"""Streamlit caching around analysis' one run-and-trace path; nothing here computes a metric or draws.

    checkpoint folder --folder_fingerprint--> fingerprint   st.cache_data per (folder, file sizes, mtimes)
    (fingerprint, device, dtype) --analysis.runs.loading.load_run--> Run          st.cache_resource
    (text choice, vocab) --analysis.runs.texts.sample_input/text_input--> Input   st.cache_resource
    (trace folder, text index) --analysis.runs.loading.recorded_input--> Input     st.cache_resource
    (run, tokens, trace items) --analysis.runs.loading.trace_run--> AnalysisContext  kept results
    (view, run key) --view.build(ctx)--> (figure, table)                   kept results

``st.cache_resource`` and the kept results hand back the same object on every rerun (no pickling), so the models,
traces and figures are shared read-only by every session. What the jobs leave behind (the traced contexts, the
figures and comparisons built on them) is kept in ``app.server.kept_results``: an LRU bounded by the bytes the
results hold, a share of the server's job memory budget (``app.server.job_budget``), instead of a count of entries
of unbounded size. The page's label and view options are applied with ``AnalysisContext.with_options`` (the trace
is not copied), and a view's cache key holds them, so changing an option that needs no model (the sequence-length
slider) never runs the model again.

The recorder is per call (``k3core.interp.recorder`` keeps it in a context variable), so sessions run models at
the same time. Only work that installs hooks on a shared model (the importance ablations) needs it to
itself: ``model_use(model, exclusive=True)``; forward passes take it shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import streamlit as st

from analysis.runs import job_memory, texts
from analysis.runs import loading as runs
from analysis.runs.context import AnalysisContext
from analysis.runs.loading import Run
from analysis.runs.texts import Input
from analysis.weights import WeightSummary, read_weight_summary
from app.library.run_folders import folder_stamp
from app.library.run_list import RunRef
from app.render.model_use import model_use
from app.server import job_budget
from app.state.inputs import (
    MAX_ATTN_LEN,
    SAMPLE_OF_SOURCE,
    TEXT_RECORDED,
    InputError,
    TextChoice,
    check_device,
    check_options,
    check_text,
    current_inputs,
    options_key,
)
from k3core.interp.trace_folder import is_trace_dir, trace_dir_fingerprint
from k3core.interp.trace_size import WHAT_ALL, WHAT_DEFAULT
from k3core.loading.folder import folder_fingerprint
from k3core.loading.tensor_info import CheckpointError


# ----------------------------------------------------------------------------------------- runs
@st.cache_data(show_spinner=False, max_entries=64)
def _fingerprint(path: str, stamp: tuple) -> str:
    return folder_fingerprint(path)


def run_fingerprint(path: str | Path) -> str:
    """k3core.loading.folder.folder_fingerprint of a folder (the one checkpoint key), recomputed only when a
    file's size or mtime changes (``app.library.run_folders.folder_stamp``)."""
    path = Path(path)
    try:
        if is_trace_dir(path):  # its run card holds every trace file's digest
            return trace_dir_fingerprint(path)
        return _fingerprint(str(path), folder_stamp(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc})") from exc


@st.cache_resource(show_spinner=False, max_entries=6)
def _run_slot(fingerprint: str, device: str, dtype: str, max_memory: str = "") -> dict[str, Any]:
    """A cached holder for one loaded run. The load itself happens outside the cached function, so its
    progress bar can be drawn (elements drawn inside a cached function are replayed on every cache hit)."""
    return {"lock": threading.Lock()}


def _cached_run(fingerprint: str, device: str, dtype: str, _path: str, label: str = "", max_memory: str = "") -> Run:
    slot = _run_slot(fingerprint, device, dtype, max_memory)
    with slot["lock"]:  # one load per (checkpoint, device, dtype), however many sessions ask at once
        if "run" not in slot:
            bar = st.empty()

            def progress(done: int, total: int) -> None:
                text = f"Loading {label or Path(_path).name}: {done / 2**20:,.0f} of {total / 2**20:,.0f} MB"
                bar.progress(min(done / max(total, 1), 1.0), text=text)

            try:
                slot["run"] = runs.load_run(
                    _path, device, dtype, fingerprint=fingerprint, progress=progress, max_memory=max_memory or None
                )
            finally:
                bar.empty()
    return slot["run"]


def load_run(ref: RunRef, device: str = "cpu", dtype: str = "float32", max_memory: str | None = None) -> Run:
    """The run (model shared across sessions), via analysis.runs.loading.load_run, with a progress bar while it loads.
    ``max_memory`` (default: the sidebar's memory budget): run it from its files within that budget
    (k3core.loading.streamed_run). Raises CheckpointError / InputError."""
    check_device(device, dtype)
    if max_memory is None:
        inputs = current_inputs()
        max_memory = inputs.max_memory if inputs is not None else ""
    return _cached_run(run_fingerprint(ref.path), device, dtype, ref.path, ref.label, max_memory)


@st.cache_resource(show_spinner=False, max_entries=8)
def _shape_model(fingerprint: str, _config: Any) -> Any:
    from k3core.modeling.model import K3ForCausalLM

    return K3ForCausalLM.from_config(_config, device="meta")


def shape_model(run: Run) -> Any:
    """A model of the run's config on the meta device (shapes only, no weights): parameter counts of a trace
    folder's run, which has no model."""
    return _shape_model(run.fingerprint, run.config)


def run_metrics(ref: RunRef) -> dict | None:
    """The run's metrics.json (training history), or None when absent or unreadable; read again only when the file
    changes. One shared dict, never to be changed (views never change their context): ``st.cache_data`` unpickled a
    copy on every call, ten times per Training history rerun."""
    path = Path(ref.path) / runs.METRICS_NAME
    if not path.is_file():
        return None
    stat = path.stat()
    return _read_metrics(ref.path, (stat.st_size, stat.st_mtime_ns))


@st.cache_resource(show_spinner=False, max_entries=64)
def _read_metrics(path: str, stamp: tuple) -> dict | None:
    return runs.read_metrics(path)[0]


def run_card(ref: RunRef) -> str | None:
    """The run's model card text (README.md), or None; read again only when a file of the folder changes."""
    try:
        stamp = folder_stamp(Path(ref.path))
    except (CheckpointError, OSError):
        return None
    return _read_card(ref.path, stamp)


@st.cache_data(show_spinner=False, max_entries=64)
def _read_card(path: str, stamp: tuple) -> str | None:
    return runs.read_card_text(path, max_chars=20000)


_DIGESTS: dict[int, tuple[dict, str]] = {}  # id -> (the dict, kept alive so its id is not reused; its digest)
_DIGESTS_KEPT = 64


def metrics_digest(metrics: dict | None) -> str:
    """sha256 of a metrics dict (canonical JSON), '' for None. Computed once per dict (they are shared and never
    changed: ``run_metrics``, a loaded ``Run``'s): a ~200 kB metrics.json costs 4 ms, and each page's trace key and
    Training history's five runs asked for it on every rerun."""
    if not metrics:
        return ""
    kept = _DIGESTS.get(id(metrics))
    if kept is not None and kept[0] is metrics:
        return kept[1]
    digest = hashlib.sha256(json.dumps(metrics, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if len(_DIGESTS) >= _DIGESTS_KEPT:
        _DIGESTS.pop(next(iter(_DIGESTS)), None)  # the oldest
    _DIGESTS[id(metrics)] = (metrics, digest)
    return digest


# ----------------------------------------------------------------------------------------- tokens
@st.cache_resource(show_spinner=False, max_entries=32)
def _cached_tokens(key: tuple, fingerprint: str, _choice: TextChoice, _run: Run) -> Input:
    choice, config, tokenizer = _choice, _run.config, _run.tokenizer
    try:
        if choice.source in SAMPLE_OF_SOURCE:
            sample = texts.sample_input(SAMPLE_OF_SOURCE[choice.source], config, choice.max_tokens, tokenizer)
        else:
            # Never encode more than needed: a token covers at most a few dozen characters.
            sample = texts.text_input(
                choice.text[: 64 * choice.max_tokens],
                config,
                choice.max_tokens,
                name=choice.name or choice.source,
                tokenizer=tokenizer,
            )
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    n = int(sample.input_ids.shape[1])
    total, exact = n, True
    if choice.text is not None:  # a long text is counted from its first megabyte, never tokenized whole
        total, exact = texts.count_tokens(choice.text, texts.text_tokenizer(config, tokenizer))
    source = choice.source if choice.text is None else f"{choice.source}{': ' + choice.name if choice.name else ''}"
    if sample.description and choice.text is None:
        source = sample.description
    return replace(sample, source=source, total=max(total, n), total_exact=exact)


@st.cache_resource(show_spinner=False, max_entries=64)
def _recorded_tokens(fingerprint: str, index: int, _run: Run) -> Input:
    try:
        return runs.recorded_input(_run, index)
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def _recorded_index(choice: TextChoice, run: Run) -> int:
    """The number of ``run``'s recorded text that ``choice`` names: its own number, or, for a text picked in another
    trace folder (Compare, two runs), the number of the text equal to it here. InputError when there is none."""
    if choice.source != TEXT_RECORDED:
        return 0  # a trace folder reads only what it recorded: its first text for any other choice
    texts = run.recorded.texts
    index = choice.recorded or 0
    if 0 <= index < len(texts) and texts[index].get("text") == choice.text:
        return index
    same = [i for i, entry in enumerate(texts) if entry.get("text") == choice.text]
    if not same:
        raise InputError(
            f"{run.label} is a trace folder and recorded no text equal to {choice.short}: it shows only the "
            f"{len(texts)} text(s) it recorded"
        )
    return same[0]


def make_tokens(choice: TextChoice, run: Run) -> Input:
    """Token ids for a text choice, read with the run's tokenizer (analysis.runs.texts sample_input / text_input).
    Cached.

    A trace folder reads its recorded text ``choice`` names (``_recorded_index``; text 0 for a choice that is no
    recorded text: it has no model to read another); one Input per (folder, text), so its trace is read once."""
    if run.recorded is not None:
        return _recorded_tokens(run.fingerprint, _recorded_index(choice, run), run)
    check_text(choice)
    return _cached_tokens(choice.key(), run.fingerprint, choice, run)


# ----------------------------------------------------------------------------------------- traces
@st.cache_data(show_spinner=False, max_entries=64)
def _recorded_entries(fingerprint: str, path: str) -> list[tuple[str, str, str | None, int]]:
    from k3core.interp.trace_folder import read_trace_dir
    from k3core.interp.trace_npz import TraceError

    try:
        texts = read_trace_dir(path).texts
    except TraceError as exc:
        raise CheckpointError(str(exc)) from exc
    entries = []
    for i, entry in enumerate(texts):
        text = entry.get("text") if isinstance(entry.get("text"), str) else None
        tokens = entry.get("tokens") if isinstance(entry.get("tokens"), list) else []
        entries.append((runs.recorded_text_label(entry, i), str(entry.get("name") or f"text {i}"), text, len(tokens)))
    return entries


def recorded_texts(ref: RunRef | None) -> list[tuple[str, str, str | None, int]] | None:
    """Per recorded text of a trace folder: (picker label, name, text as traced or None, tokens), or None when ``ref``
    is a checkpoint. The label is ``analysis.runs.loading.recorded_text_label`` (index, name, tokens, first words);
    label, name and text are raw file-controlled text: escape them for Markdown. Read once per run card; raises
    CheckpointError."""
    if ref is None or not is_trace_dir(ref.path):
        return None
    return _recorded_entries(run_fingerprint(ref.path), str(ref.path))


def trace_items(record_attn: bool) -> tuple[str, ...]:
    """What the recorder captures: everything, attention matrices only when asked."""
    return tuple(sorted(WHAT_ALL if record_attn else WHAT_DEFAULT))


_TRACED: dict[tuple, tuple[float, int]] = {}  # trace key -> (tokens per second of its forward, its tokens)


RECORDED_HINT = "record fewer tokens per text (`k3lab trace --max-tokens`), or give the server more job memory"
TRACE_SPINNER = "Running the model on the text and recording its trace..."


def _cached_trace(
    fingerprint: str,
    device: str,
    dtype: str,
    digest: str,
    what: tuple[str, ...],
    run: Run,
    tokens: Input,
    edits: str = "",
    recorded: int | None = None,
) -> AnalysisContext:
    """The traced context of (run, tokens, trace items, edits), kept among the server's finished results
    (``app.server.kept_results``: by bytes, it grows with what is computed on it) and made once however many sessions
    ask at once."""
    key = ("trace", fingerprint, device, dtype, digest, what, edits, recorded)

    def make() -> AnalysisContext:
        return _run_trace(fingerprint, device, dtype, digest, what, run, tokens, edits)

    kept = job_budget.budget().kept
    return kept.get(key, make, job_memory.context_bytes, grows=True, holder=lambda ctx: ctx.trace)


def _run_trace(
    fingerprint: str, device: str, dtype: str, digest: str, what: tuple[str, ...], run: Run, tokens: Input, edits: str
) -> AnalysisContext:
    from k3core.interp.interventions import edits_from_json

    read_cap = None  # a trace folder's text: its file's checks made and its bytes counted before it is inflated
    if run.model is None:
        index = tokens.extra.get("recorded_index") or 0
        need = read_cap = runs.recorded_bytes(run, index)
        what_job, hint = f"Reading the trace of text {index} ({tokens.n:,} tokens)", RECORDED_HINT
    else:
        attention = MAX_ATTN_LEN if "attn_probs" in what else None
        need = job_memory.trace_peak_bytes(run.config, tokens.n, attention)
        what_job, hint = f"Recording the trace of {tokens.n:,} tokens", "use fewer tokens"
    notice = st.empty()  # says why the page waits while the job is queued for memory
    with job_budget.budget().admit(need, what_job, notice.info, hint=hint) as job:
        notice.empty()
        start = time.perf_counter()
        with st.spinner(TRACE_SPINNER), model_use(run.model) if run.model is not None else contextlib.nullcontext():
            ctx = runs.trace_run(
                run,
                tokens,
                what=list(what),
                max_attn_len=MAX_ATTN_LEN,
                edits=edits_from_json(edits) if edits else None,
                max_read_bytes=read_cap,
            )
        if job_memory.context_bytes(ctx) > job_budget.budget().kept.capacity:
            job.hold_until_freed(ctx.trace)  # too large to keep: counted among the running jobs while it is used
    if not edits:
        speed = tokens.n / max(time.perf_counter() - start, 1e-9)
        _TRACED[(fingerprint, device, dtype, digest, what)] = (speed, tokens.n)
    return ctx


def is_traced(key: tuple) -> bool:
    """Whether (fingerprint, device, dtype, token digest, trace items) was traced in this process."""
    return key in _TRACED


def forward_speed(fingerprint: str, device: str, dtype: str) -> tuple[float, int] | None:
    """(tokens per second, tokens) of this run's last recorded forward in this process (None: never run)."""
    speeds = [v for k, v in _TRACED.items() if k[:3] == (fingerprint, device, dtype)]
    return speeds[-1] if speeds else None


def forward_seconds_range(measured: tuple[float, int], tokens: int) -> tuple[float, float]:
    """(low, high) seconds of a forward of ``tokens`` from one measured at (speed, n tokens): low scales the time
    linearly in tokens, high quadratically past n (attention over the whole text), as a range, not one number."""
    speed, n = measured
    low = tokens / speed
    return low, low * max(1.0, tokens / max(n, 1))


@dataclass
class Loaded:
    """What an app page draws from: the picked run (``RunRef``), its ``Run`` (None on the weights path and for
    the training history), the ``AnalysisContext``, the ``Input`` it read, and the key its figures are cached
    under (``build_view``). Made by ``load`` / ``trace`` (``app.render.page_scaffold.load_or_stop``) and
    ``load_weights``."""

    ref: RunRef
    run: Run | None  # None for contexts without a model (training history)
    ctx: AnalysisContext
    key: tuple
    tokens: Input | None
    notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> Any:
        return None if self.run is None else self.run.model


def load(
    ref: RunRef,
    choice: TextChoice,
    device: str = "cpu",
    dtype: str = "float32",
    record_attn: bool = True,
    options: dict[str, Any] | None = None,
    label: str | None = None,
    edits: str = "",
) -> Loaded:
    """Run + traced AnalysisContext for a run on a text choice (all cached); ``edits`` (JSON of
    ``k3core.interp.interventions`` edits): the edited forward's trace instead.

    Raises CheckpointError (bad checkpoint) or InputError (bad text / device / options / edits).
    """
    run = load_run(ref, device, dtype)
    return trace(ref, run, make_tokens(choice, run), record_attn, options, label, edits)


def trace(
    ref: RunRef,
    run: Run,
    tokens: Input,
    record_attn: bool = True,
    options: dict[str, Any] | None = None,
    label: str | None = None,
    edits: str = "",
) -> Loaded:
    """The traced AnalysisContext of a loaded run on its tokens (cached per run, tokens, trace items and edits),
    under ``label`` and the view ``options``. Raises InputError for bad options or edits that do not fit."""
    options = dict(options or {})
    check_options(options)
    what = trace_items(record_attn)
    if edits:
        from k3core.interp.edit_kinds import EditError
        from k3core.interp.interventions import compile_edits, edits_from_json

        try:
            parsed = edits_from_json(edits)
            compile_edits(run.config, parsed)
        except EditError as exc:
            raise InputError(f"the edits do not fit {ref.label}: {exc}") from exc
        # the experiment views of an edited trace (Compare, baseline vs edited) read its edits from the options
        options.setdefault("edits", [e.to_dict() for e in parsed])
    recorded = tokens.extra.get("recorded_index")  # a trace folder's text: one cache entry per text
    base = _cached_trace(run.fingerprint, run.device, run.dtype, tokens.digest, what, run, tokens, edits, recorded)
    label = label or ref.label
    ctx = base.with_options(label=label, **options)
    notes = []
    if ctx.loss is not None and not math.isfinite(ctx.loss):
        notes.append(f"The forward pass gave a non-finite loss ({ctx.loss}); try float32.")
    key = (
        run.fingerprint,
        run.device,
        run.dtype,
        tokens.digest,
        what,
        label,
        options_key(options),
        metrics_digest(run.metrics),
        edits,
        recorded,
    )
    return Loaded(ref=ref, run=run, ctx=ctx, key=key, tokens=tokens, notes=notes)


# ----------------------------------------------------------------------------------------- weights
@st.cache_resource(show_spinner="Reading the checkpoint's small tensors...", max_entries=8)
def _weight_summary(fingerprint: str, path: str, experts: bool, _progress=None) -> WeightSummary:
    return read_weight_summary(path, experts=experts, progress=_progress)


def load_weights(ref: RunRef, experts: bool = False, progress=None) -> Loaded:
    """A context for the views drawn from the weights alone (``analysis.weights.read_weight_summary``: headers
    and small tensors, no model built), cached per folder state; ``experts`` also reads every expert matrix.
    Raises CheckpointError / OSError / ValueError."""
    if is_trace_dir(ref.path):
        raise CheckpointError(f"{ref.label} is a trace folder without its weights: this page needs the checkpoint")
    fingerprint = run_fingerprint(ref.path)
    summary = _weight_summary(fingerprint, str(ref.path), experts, progress)
    ctx = AnalysisContext(trace=None, config=summary.config, label=ref.label, weights=summary)
    return Loaded(ref=ref, run=None, ctx=ctx, key=("weights", fingerprint, experts, ref.label), tokens=None)
