"""The sidebar every page shares: run, text, max tokens, device, dtype and view options.

``sidebar()`` draws the widgets and stores the choices as ``app.state.inputs.Inputs`` in
``st.session_state["k3lab_inputs"]``; the link in the address bar follows them (``app.state.links``).
"""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from analysis.output.format import format_tokens
from app import page_registry
from app.library import run_list
from app.library.run_list import RunRef
from app.render import caching
from app.render.errors import md_escape
from app.state import inputs as inp
from app.state import links
from app.state.inputs import InputError, Inputs, TextChoice
from k3core.interp.trace_folder import is_trace_dir
from k3core.loading.tensor_info import CheckpointError
from k3core.utils.input_limits import shown

ORIGIN_TAGS = {
    "preloaded": "",
    "sample": " · sample",
    "uploaded": " · uploaded",
    "path": " · folder",
    "preset": " · preset",
}


def sidebar() -> Inputs:
    """Draw the sidebar inputs (run, text, max tokens, device, dtype, options) and return them.

    The chosen inputs are also stored in ``st.session_state["k3lab_inputs"]`` for the pages.
    """
    ss = st.session_state
    runs, problems = run_list.discover_runs(
        os.environ.get(run_list.RUNS_ENV), run_list.SAMPLES_DIR, run_list.library_runs()
    )
    labels = [r.label for r in runs]
    by_label = {r.label: r for r in runs}
    links.apply_once(labels)  # the link's choices, on a session's first run
    pending = ss.pop("k3lab_pending_run", None)  # a folder path: select that run (e.g. after an upload)
    pending_label = next((r.label for r in runs if pending and r.path == str(Path(pending).resolve())), None)
    if pending_label is not None:
        ss["k3lab_run"] = pending_label
    elif ss.get("k3lab_run") not in by_label:
        gone = ss.pop("k3lab_run", None)
        if gone is not None and labels:  # deleted (here or in another tab): the box shows the run used instead
            ss["k3lab_run"] = labels[0]
            ss["k3lab_run_gone"] = (
                f"The run **{md_escape(gone)}** is no longer in the runs library; showing **{md_escape(labels[0])}**."
            )

    with st.sidebar:
        run = None
        if runs:
            chosen = st.selectbox(
                "Run",
                labels,
                key="k3lab_run",
                format_func=lambda lab: lab + ORIGIN_TAGS.get(by_label[lab].origin, ""),
                help="Checkpoint folders: those given to `k3lab app`, the shipped samples and the runs library "
                "(uploads, folders opened by path, presets).",
            )
            run = by_label.get(chosen)
        else:
            st.warning(
                f"No checkpoints found. Add one on the {page_registry.page('runs_library').mention}, "
                "or start the app with `k3lab app PATH`."
            )
        for problem in problems:
            st.warning(problem)
        if ss.get("k3lab_run_gone"):
            st.info(ss.pop("k3lab_run_gone"))

        choice, text_error = text_choice("k3lab", ref=run)
        st.divider()
        c1, c2 = st.columns(2)
        device = c1.selectbox("Device", inp.device_choices(), key="k3lab_device")
        if ss.get("k3lab_dtype") not in inp.dtype_choices(device):  # e.g. float16 chosen on cuda, then cpu
            ss.pop("k3lab_dtype", None)
        dtype = c2.selectbox("dtype", inp.dtype_choices(device), key="k3lab_dtype")
        max_memory = st.text_input(
            "Memory budget",
            key="k3lab_max_memory",
            placeholder="e.g. 8GB (empty: load the whole model)",
            help="Run the model from its checkpoint files within this much memory on the device: routed experts "
            "are read when the router chooses them (and cached), dense parts stay when they fit, else are read "
            "layer by layer. For checkpoints larger than memory, such as Kimi K3 (1.56 TB). The plan and the "
            "expected time are shown before anything runs.",
        )
        try:
            max_memory = inp.check_max_memory(max_memory)
        except InputError as exc:
            st.error(md_escape(exc))
            max_memory = ""
        ss.setdefault("k3lab_seq_len", inp.SEQ_LEN_DEFAULT)
        ss.setdefault("k3lab_record_attn", True)
        seq_len = st.select_slider(
            "Sequence length for memory views",
            options=list(inp.SEQ_LENS),
            key="k3lab_seq_len",
            format_func=format_tokens,
            help="The length at which cache memory and FLOPs per token are computed (density views). "
            "Changing it redraws those figures from the config; the model does not run again.",
        )
        record_attn = st.checkbox(
            inp.ATTENTION_CHECKBOX,
            key="k3lab_record_attn",
            help=f"Adds the MLA and KDA attention maps (the first {inp.MAX_ATTN_LEN:,} positions: quadratic in "
            "length) and KDA's implicit-attention statistics over the whole text (O(T^2 K) per head: about 7x a plain "
            "forward's time at 16K tokens). MLA entropy and sink statistics are recorded without it.",
        )

    inputs = Inputs(
        runs=tuple(runs),
        run=run,
        text=choice,
        text_error=text_error,
        device=device,
        dtype=dtype,
        seq_len=int(seq_len),
        record_attn=bool(record_attn),
        problems=tuple(problems),
        max_memory=max_memory,
    )
    ss["k3lab_inputs"] = inputs
    # the streaming plan and its buttons: drawn once per script run (app.render.page_scaffold)
    ss["k3lab_stream_drawn"] = False
    links.write(inputs)
    return inputs


def text_choice(
    prefix: str,
    max_tokens: int | None = None,
    default: str = inp.TEXT_SHAKESPEARE,
    label: str = "Text",
    ref: RunRef | None = None,
    default_index: int = 0,
) -> tuple[TextChoice, str | None]:
    """Text source picker (+ text box / file uploader, + max tokens unless given). Returns (choice, error).

    When ``ref`` is a trace folder, its recorded texts instead (``recorded_choice``): it has no model to read another.
    """
    try:  # a checkpoint never enters the cache layer for this
        recorded = caching.recorded_texts(ref) if ref is not None and is_trace_dir(ref.path) else None
    except CheckpointError:
        recorded = None  # an unreadable run card: the page that loads the run says why
    if recorded is not None:
        return recorded_choice(prefix, ref, recorded, label, default_index), None
    st.session_state.setdefault(f"{prefix}_text_source", default)
    source = st.selectbox(
        label,
        inp.TEXT_SOURCES,
        key=f"{prefix}_text_source",
        help="What the model reads. The Shakespeare passage is from a play held out of training; "
        "MQAR is a synthetic associative-recall sequence (loss on the answers only).",
    )
    max_tokens = max_tokens or _max_tokens(prefix)
    text, name, error = None, "", None
    if source == inp.TEXT_PASTE:
        text = st.text_area(
            "Your text", key=f"{prefix}_paste", height=140, placeholder="Paste any text; it is read as UTF-8 bytes."
        )
    elif source == inp.TEXT_UPLOAD:
        up = st.file_uploader("Text file", type=["txt"], key=f"{prefix}_text_file")
        if up is not None:
            name = up.name
            try:
                text = inp.decode_upload(up.getvalue(), up.name)
            except InputError as exc:
                error = str(exc)
    choice = TextChoice(source=source, max_tokens=int(max_tokens), text=text, name=name)
    if error is None:
        try:
            inp.check_text(choice)
        except InputError as exc:
            error = str(exc)
    if error is None and text is not None:
        size = len(text.encode("utf-8", "replace"))
        if size > choice.max_tokens:
            st.caption(f"{size:,} bytes of text: the first {choice.max_tokens:,} are read (max tokens).")
        else:
            st.caption(f"{size:,} bytes of text.")
    return choice, error


def _max_tokens(prefix: str) -> int:
    """The max-tokens input (texts are cut to their first N tokens)."""
    st.session_state.setdefault(f"{prefix}_max_tokens", inp.MAX_TOKENS_DEFAULT)
    return int(
        st.number_input(
            "Max tokens",
            min_value=2,
            max_value=inp.MAX_TOKENS_CAP,
            step=128,
            key=f"{prefix}_max_tokens",
            help=f"Longer texts are cut to their first N tokens (bytes); at most {inp.MAX_TOKENS_CAP:,}. A trace "
            "folder's recorded texts are shown as traced.",
        )
    )


def recorded_choice(
    prefix: str, ref: RunRef, recorded: list[tuple[str, str, str | None, int]], label: str, default_index: int = 0
) -> TextChoice:
    """A picker of a trace folder's recorded texts (index, name, tokens, first words), kept in
    ``st.session_state[prefix + "_text_index"]`` (the link's ``text_index``, ``app.state.links``). A number the folder
    has no text for (a link's, or one kept from another run) falls back to ``default_index`` with a warning that stays
    until a text is picked."""
    ss = st.session_state
    key, note_key = f"{prefix}_text_index", f"{prefix}_text_index_note"
    count = len(recorded)
    fallback = default_index if 0 <= default_index < count else 0
    wanted = ss.get(key, fallback)
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted < count:
        ss[note_key] = (
            ref.label,
            f"There is no text {shown(wanted)} in the trace folder {ref.label}: it recorded {count} text(s), numbered "
            f"0..{count - 1}. Showing text {fallback}.",
        )
        wanted = fallback
    ss[key] = wanted
    index = st.selectbox(
        label,
        list(range(count)),
        key=key,
        format_func=lambda i: recorded[i][0],
        on_change=lambda: ss.pop(note_key, None),
        help="A trace folder holds the traces of the texts it was made with (`k3lab trace --text A --text B ...`): "
        "pick one. Each label is its number, name, token count and first words.",
    )
    note = ss.get(note_key)
    if note is not None and note[0] == ref.label:
        st.warning(md_escape(note[1]), icon=":material/link_off:")
    st.caption(
        "A trace folder has no model, so it cannot read a new text: it shows the texts it recorded. To run another "
        "text, open the checkpoint it was traced from."
    )
    _, name, text, count = recorded[index]
    # max tokens: the recorded count, so a checkpoint compared with the folder reads the text as it was traced
    return TextChoice(inp.TEXT_RECORDED, min(max(count, 2), inp.MAX_TOKENS_CAP), text=text, name=name, recorded=index)
