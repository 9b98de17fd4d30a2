"""Loading a run (a checkpoint folder) and tracing it on a text: the shared entry of report, inspect and app.

A run folder holds ``config.json`` + ``model.safetensors`` (Hugging Face layout, see k3core.loading.pretrained)
and optionally ``metrics.json`` (the training history, see analysis.metrics.history) and a ``README.md`` model
card. ``load_run`` raises ``k3core.loading.tensor_info.CheckpointError`` for anything wrong with the checkpoint;
a missing or unreadable ``metrics.json`` is not an error (``Run.metrics`` is None and
``Run.card["notes"]`` says why).

Inputs (built-in samples, user text) come from ``analysis.runs.texts``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from analysis.runs.context import AnalysisContext
from analysis.runs.texts import REPEAT_START, Input
from k3core.interp.trace_folder import TraceDir, is_trace_dir, read_trace_dir, trace_dir_fingerprint
from k3core.interp.trace_npz import TraceError
from k3core.interp.trace_size import trace_estimate
from k3core.loading.folder import folder_fingerprint
from k3core.loading.tensor_info import DTYPES as STORED
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.config import K3Config
from k3core.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer
from k3core.utils.files import open_for_reading, parse_json, read_bytes_limited
from k3core.utils.runtime import configure_threads

if TYPE_CHECKING:  # imported where a run is loaded (load_run), not when this module is
    from k3core.modeling.model import K3ForCausalLM

METRICS_NAME = "metrics.json"
MAX_METRICS_BYTES = 64 * 1024**2
CARD_NAMES = ("README.md", "MODEL_CARD.md", "model_card.md")
#: the dtypes a run computes in, by the names the app, the CLI and links use ("float32"): a choice of the one table of
#: torch dtypes, k3core.loading.tensor_info.DTYPES
DTYPES: dict[str, torch.dtype] = {str(STORED[k]).removeprefix("torch."): STORED[k] for k in ("F32", "BF16", "F16")}


@dataclass
class Run:
    """A loaded checkpoint: the first step of the flow (``load_run``: folder -> Run). ``trace_run`` runs it on an
    ``Input`` and returns the ``AnalysisContext`` the views draw from."""

    model: Any  # K3ForCausalLM in eval mode
    config: K3Config
    metrics: dict | None
    card: dict[str, Any]
    path: Path
    fingerprint: str
    device: str = "cpu"
    dtype: str = "float32"  # a key of DTYPES
    tokenizer: Tokenizer | None = None  # the checkpoint's own tokenizer; None: token ids only (see notes)
    recorded: TraceDir | None = None  # a trace folder opened without its weights (model None; load_trace_folder)

    @property
    def label(self) -> str:
        return self.path.name or str(self.path)


# ----------------------------------------------------------------------------- loading
def read_metrics(path: str | Path) -> tuple[dict | None, str | None]:
    """``metrics.json`` of a run folder as a dict, or (None, reason). Never raises for a bad file."""
    file = Path(path) / METRICS_NAME
    if not file.is_file():
        return None, f"no {METRICS_NAME} in the run folder"
    try:
        data = parse_json(read_bytes_limited(file, MAX_METRICS_BYTES), METRICS_NAME)
    except (OSError, ValueError) as exc:
        return None, f"{METRICS_NAME}: unreadable ({str(exc)[:200]})"
    if isinstance(data, list):
        data = {"history": data}
    if not isinstance(data, dict):
        return None, f"{METRICS_NAME}: expected a JSON object, got {type(data).__name__}"
    return data, None


def read_card_text(path: str | Path, max_chars: int = 4000) -> str | None:
    """The model card text (README.md / MODEL_CARD.md) of a run folder, truncated to ``max_chars``."""
    for name in CARD_NAMES:
        file = Path(path) / name
        if file.is_file():
            try:  # at most 4 bytes per character: a huge README is never read whole
                with os.fdopen(open_for_reading(file), "rb") as fh:
                    text = fh.read(4 * max_chars + 4).decode("utf-8", errors="replace")
            except OSError:
                return None
            return text if len(text) <= max_chars else text[:max_chars] + "\n..."
    return None


def dtype_name(dtype: str | torch.dtype | None) -> str:
    """ "float32" / "bfloat16" / "float16" for a name or a torch dtype (None: float32). Raises ValueError."""
    if dtype is None:
        return "float32"
    for name, value in DTYPES.items():
        if dtype in (name, value):
            return name
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")


def load_run(
    path: str | Path,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    fingerprint: str | None = None,
    progress: Callable[[int, int], None] | bool | None = None,
    offload_folder: str | Path | None = None,
    max_memory: str | int | None = None,
) -> Run:
    """Load a checkpoint folder (config.json + weights [+ metrics.json, README.md, tokenizer]) into a Run.

    The model is in eval mode on ``device`` in ``dtype``; torch's thread count is set for its size
    (``k3core.utils.runtime.configure_threads``). ``fingerprint`` (``k3core.loading.folder.folder_fingerprint``)
    may be passed when the caller already has it; ``progress`` is a (bytes done, total) callback or True for a tqdm bar;
    ``offload_folder`` is where ``device="auto"`` puts weights that fit on no device; ``max_memory`` (e.g. "8GB"):
    run it from the checkpoint files within that budget on ``device`` (``k3core.loading.streamed_run``). Raises
    CheckpointError (missing folder, bad config, bad weights) and ValueError (unknown dtype)."""
    from k3core.modeling.model import K3ForCausalLM

    path = Path(path)
    if is_trace_dir(path):
        return load_trace_folder(path)
    dtype = dtype_name(dtype)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a checkpoint folder (expected a folder with config.json and model.safetensors)"
        )
    fingerprint = fingerprint or folder_fingerprint(path)
    if max_memory:
        budget_device = "cpu" if str(device) == "auto" else str(device)
        model = K3ForCausalLM.from_pretrained(
            path,
            device=budget_device,
            dtype=DTYPES[dtype],
            max_memory={budget_device: max_memory},
            stream=True,
            trace_estimate=trace_estimate,
        )
    else:
        model = K3ForCausalLM.from_pretrained(
            path, device=device, dtype=DTYPES[dtype], progress=progress, offload_folder=offload_folder
        ).eval()
    configure_threads(model)
    metrics, note = read_metrics(path)
    card = model_card(model, metrics, read_card_text(path))
    if note:
        card["notes"].append(note)
    tokenizer, tokenizer_note = run_tokenizer(path, model.config.vocab_size)
    card["tokenizer"] = tokenizer.name if tokenizer is not None else None
    if tokenizer_note:
        card["notes"].append(tokenizer_note)
    return Run(
        model=model,
        config=model.config,
        metrics=metrics,
        card=card,
        path=path,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        device=str(device),
        dtype=dtype,
    )


def load_trace_folder(path: str | Path) -> Run:
    """A trace folder (``k3core.interp.trace_folder``, written by ``k3lab trace``) as a Run without a model: its traces
    are what ``trace_run`` returns; views that need the weights say so. Raises CheckpointError for a bad folder."""
    path = Path(path)
    try:
        folder = read_trace_dir(path)
        config = K3Config.from_dict(folder.card["config"])
    except (TraceError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path.name}: not a readable trace folder ({exc})") from exc
    made = folder.card.get("made") if isinstance(folder.card.get("made"), dict) else {}
    metrics, _ = read_metrics(path)
    tokenizer, tokenizer_note = run_tokenizer(path, config.vocab_size)
    card: dict[str, Any] = {"notes": [TRACE_ONLY_NOTE], "trace_folder": made, "tokenizer": folder.card.get("tokenizer")}
    if tokenizer_note:
        card["notes"].append(tokenizer_note)
    return Run(
        model=None,
        config=config,
        metrics=metrics,
        card=card,
        path=path,
        fingerprint=trace_dir_fingerprint(path),
        device=str(made.get("device", "cpu")),
        dtype=str(made.get("dtype", "float32")),
        tokenizer=tokenizer,
        recorded=folder,
    )


TRACE_ONLY_NOTE = (
    "a trace folder without the weights: every view drawn from the trace works; views that run the model or "
    "read the weights need the checkpoint"
)


def recorded_count(run: Run) -> int:
    """How many texts a trace folder's run recorded (0 for a checkpoint)."""
    return 0 if run.recorded is None else len(run.recorded.texts)


def check_text_index(run: Run, index: int) -> int:
    """``index`` when the trace folder's run recorded a text of that number; ValueError naming how many it has."""
    if run.recorded is None:
        raise ValueError(
            f"{run.label} is a checkpoint, not a trace folder: a text index picks one of a trace folder's recorded "
            "texts; give the checkpoint a text or a sample instead"
        )
    count = recorded_count(run)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        names = ", ".join(recorded_text_label(e, i) for i, e in enumerate(run.recorded.texts[:8]))
        more = f", and {count - 8} more" if count > 8 else ""
        raise ValueError(
            f"{run.label}: no text {index!r}; the trace folder recorded {count} text(s), numbered 0..{count - 1}: "
            f"{names}{more}"
        )
    return index


def first_words(text: str, max_words: int = 8, max_chars: int = 48) -> str:
    """The first ``max_words`` words of ``text`` on one line (whitespace collapsed), at most ``max_chars``
    characters, with "..." when cut."""
    words = text.split()
    head = " ".join(words[:max_words])
    if len(head) > max_chars:
        head = head[:max_chars].rstrip()
    return head + ("..." if head != " ".join(words) else "")


def recorded_text_label(entry: dict[str, Any], index: int) -> str:
    """A trace folder's text as a picker names it: "1 · b.txt · 24 tokens · To be, or not to be..." (its index,
    name, token count and first words: the recorded text, else its readable token strings). Raw file-controlled
    text: escape it where it is shown as Markdown."""
    tokens = entry.get("tokens") if isinstance(entry.get("tokens"), list) else []
    text = entry.get("text")
    if not isinstance(text, str) or not text.strip():
        strings = entry.get("token_strings")
        text = "".join(str(s) for s in strings) if isinstance(strings, list) else ""
    name = " ".join(str(entry.get("name") or f"text {index}").split())
    parts = [str(index), name if len(name) <= 40 else name[:40] + "...", f"{len(tokens):,} tokens"]
    if text.strip():
        parts.append(first_words(text))
    return " · ".join(parts)


def recorded_input(run: Run, index: int = 0) -> Input:
    """Text ``index`` of a trace folder's run (``load_trace_folder``) as an Input, as it was traced
    (``extra["recorded_index"]`` says which, so ``trace_run`` reads that text's trace file and no other).
    Raises ValueError for an index the folder has no text for (the message says how many it has)."""
    entry = run.recorded.texts[check_text_index(run, index)]
    ids = torch.tensor([[int(t) for t in entry.get("tokens", [])]], dtype=torch.long)
    name = str(entry.get("name") or f"text {index}")
    description = str(entry.get("description") or f"{name}: {ids.shape[1]} tokens (recorded)")
    return Input(
        name,
        ids,
        text=entry.get("text"),
        description=description,
        source=f"recorded: {name} (text {index})",
        extra={"recorded_index": index},
    )


def recorded_bytes(run: Run, index: int) -> int:
    """The bytes reading text ``index`` of a trace folder's run allocates (``TraceDir.inflated_bytes``: from its
    file's zip directory, after every check of names and shapes against the run card; nothing inflated), what a
    server admits before ``trace_run(..., max_read_bytes=)``. Raises CheckpointError."""
    try:
        return run.recorded.inflated_bytes(index)
    except TraceError as exc:
        raise CheckpointError(str(exc)) from exc


def _recorded_context(
    run: Run,
    input_ids: torch.Tensor,
    label: str | None,
    options: dict | None,
    index: int | None = None,
    max_bytes: int | None = None,
) -> AnalysisContext:
    """The stored trace of text ``index`` of a trace folder (None: the text whose tokens are ``input_ids``), read
    within ``max_bytes`` (None: the trace file limits); ValueError when it holds none."""
    wanted = [int(t) for t in input_ids[0]]
    texts = run.recorded.texts
    if index is None or not 0 <= index < len(texts) or [int(t) for t in texts[index].get("tokens", [])] != wanted:
        index = next((i for i, e in enumerate(texts) if [int(t) for t in e.get("tokens", [])] == wanted), None)
    if index is None:
        raise ValueError(
            f"{run.label} is a trace folder of {len(texts)} recorded text(s); running the model on another "
            "text needs the checkpoint"
        )
    try:
        trace = run.recorded.trace(index, max_bytes=max_bytes)
    except TraceError as exc:
        raise CheckpointError(str(exc)) from exc
    return _context(run, trace, input_ids, label, options)


def run_tokenizer(path: str | Path, vocab_size: int) -> tuple[Tokenizer | None, str | None]:
    """The checkpoint folder's own tokenizer (``k3core.tokenizer.load_tokenizer``), or (None, why not).

    A missing or bad tokenizer is no checkpoint error: the weights and synthetic-id inputs (MQAR) still work,
    and text inputs say why they cannot be read."""
    try:
        return load_tokenizer(path, vocab_size), None
    except TokenizerError as exc:
        return None, f"text inputs unavailable: {exc}"


def model_card(model: K3ForCausalLM, metrics: dict | None = None, card_text: str | None = None) -> dict[str, Any]:
    """A JSON-able card: parameter counts, notes and the final training numbers (the config's own summary is
    ``analysis.weights.checkpoint_summary.config_summary``)."""
    card: dict[str, Any] = {
        "parameters": int(model.num_parameters()),
        "active_parameters": int(model.num_parameters(active=True)),
        "notes": [],
    }
    if metrics:
        from analysis.metrics.history import final_numbers

        card["training"] = final_numbers(metrics)
        for key in ("status", "run_name", "code_version"):
            if isinstance(metrics.get(key), str):
                card[f"training_{key}"] = metrics[key]
    if card_text:
        card["card_text"] = card_text
    return card


# ----------------------------------------------------------------------------- tracing
@torch.no_grad()
def trace_run(
    run: Run,
    input_ids: torch.Tensor | Input,
    what: Any = "all",
    targets: torch.Tensor | None = None,
    label: str | None = None,
    max_attn_len: int = 1024,
    options: dict[str, Any] | None = None,
    edits: list | None = None,
    window: int | None = None,
    max_read_bytes: int | None = None,
) -> AnalysisContext:
    """Run the model once on ``input_ids`` [B, T] inside ``record`` and wrap the trace in an AnalysisContext.

    ``edits`` (``k3core.interp.interventions``): record the edited forward instead (``trace.meta["edits"]`` lists them).

    The loss (``token_nll``) uses ``targets`` when given (aligned, -100 ignored), else next-token labels.
    Everything is recorded for the whole input (``max_tokens`` = T); attention maps for the first ``max_attn_len``
    queries (their statistics for every position); ``window`` (None: all) bounds the bulky per-token arrays
    (hidden states, KDA decays, MoE latents), which then are summarised over every position by bins.
    The recorder is per call (a context variable), so several threads may trace shared models at once.
    A trace folder's run reads its stored trace instead, inflating at most ``max_read_bytes`` (what a server admitted:
    ``TraceDir.inflated_bytes``; None: the trace file limits).
    """
    from k3core.interp.recorder import record

    sample_name = recorded_index = repeat_start = None
    if isinstance(input_ids, Input):
        recorded_index = input_ids.extra.get("recorded_index")
        repeat_start = input_ids.extra.get(REPEAT_START)
        targets = input_ids.targets if targets is None else targets
        sample_name = input_ids.name
        input_ids = input_ids.input_ids
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if run.recorded is not None:
        if edits:
            raise ValueError(
                f"{run.label} is a trace folder: an edited forward reruns the model and needs the checkpoint"
            )
        return _recorded_context(run, input_ids, label, options, recorded_index, max_read_bytes)
    model = run.model
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    T = int(ids.shape[1])
    kwargs = {"targets": targets.to(device)} if targets is not None else {"labels": ids}
    from k3core.interp.interventions import intervene

    with (
        intervene(model, edits or []),
        record(
            model, what=what, max_tokens=T, max_batch=ids.shape[0], max_attn_len=max_attn_len, window=window
        ) as trace,
    ):
        out = model(ids, **kwargs)
    if edits:
        trace.meta["edits"] = [e.to_dict() for e in edits]
    trace.meta["run"] = {
        "path": str(run.path),
        "fingerprint": run.fingerprint,
        "sample": sample_name,
        REPEAT_START: repeat_start,
        "loss": float(out.loss) if out.loss is not None else None,
        "tokenizer": run.tokenizer.describe() if run.tokenizer is not None else None,
    }
    return _context(run, trace, input_ids, label, options)


def _context(run: Run, trace: Any, input_ids: torch.Tensor, label: str | None, options: dict | None) -> AnalysisContext:
    """The AnalysisContext of a run's trace on ``input_ids`` (the run's model: None for a trace folder)."""
    return AnalysisContext(
        trace=trace,
        config=run.config,
        model=run.model,
        input_ids=input_ids.cpu(),
        metrics=run.metrics,
        label=label or run.label,
        tokenizer=run.tokenizer,
        options=dict(options or {}),
    )


def run_from_model(model: K3ForCausalLM, path: str | Path = "in-memory", metrics: dict | None = None) -> Run:
    """Wrap an in-memory model as a Run (no checkpoint folder; fingerprint 'unsaved'; bytes for vocab 256)."""
    return Run(
        model=model.eval(),
        config=model.config,
        metrics=metrics,
        card=model_card(model, metrics),
        path=Path(path),
        fingerprint="unsaved",
        tokenizer=ByteTokenizer() if model.config.vocab_size == ByteTokenizer.vocab_size else None,
    )
