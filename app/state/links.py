"""The view in the address bar: a copied link reopens the same page, run(s), text and choices.

The page is the URL path (``/moe``; ``st.navigation`` with a ``url_path`` per page). The rest are
query parameters, written on every run and read on a session's first run:

    run      run label (sidebar)                 text     shakespeare | mqar | repeat | paste | upload
    tokens   max tokens                          seq      sequence length of the memory views
    device   cpu | cuda                          dtype    float32 | bfloat16 | float16
    attn     0: no attention maps, no KDA stats  mode     compare: runs | texts
    b        compare: run B label                text_b   compare: text B (as ``text``)
    section  compare: one of app.page_registry.COMPARE_SECTIONS (density, attnres, ..., experiment)
    edits    experiment / compare baseline vs edited: the edits as JSON (k3core.interp.interventions)
    pick     layer / head picks of per-layer views: ``VIEW:L3H1,VIEW2:L5`` (analysis.views.picks; app.state.pickers)
    text_index    a trace folder's recorded text (0, 1, ...; instead of ``text``)
    text_index_b  compare, one trace folder on two texts: text B's number

An unknown value gets a warning that names it, and the default is used instead. Pasted and uploaded
texts are not put in links (they can be large and private): such a link opens with the text source
chosen and asks for the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import streamlit as st

from analysis.runs import loading
from app import page_registry
from app.render.errors import md_escape
from app.state import inputs as inp
from k3core.utils.input_limits import shown

TEXT_SLUGS = {
    "shakespeare": inp.TEXT_SHAKESPEARE,
    "mqar": inp.TEXT_MQAR,
    "repeat": inp.TEXT_REPEAT,
    "paste": inp.TEXT_PASTE,
    "upload": inp.TEXT_UPLOAD,
}
SLUG_OF_TEXT = {v: k for k, v in TEXT_SLUGS.items()}
TWO_RUNS, TWO_TEXTS, EDITED = "Two runs, same text", "One run, two texts", "Baseline vs edited"
MODES = {"runs": TWO_RUNS, "texts": TWO_TEXTS, "edited": EDITED}
EDITS = "k3lab_edits"  # session key: the experiment's edits, as a list of edit dicts
SLUG_OF_MODE = {v: k for k, v in MODES.items()}
PARAMS = (
    "run",
    "text",
    "tokens",
    "seq",
    "device",
    "dtype",
    "attn",
    "mode",
    "b",
    "text_b",
    "section",
    "edits",
    "pick",
    "text_index",
    "text_index_b",
)
MAX_TEXT_INDEX = 1_000_000  # a link's text number; whether the trace folder has it is checked by app.state.sidebar
PICKS = "k3lab_picks"  # session key: {view key: {"layer": 3, "head": 1}} (app.state.pickers)
TOKEN_MLA, TOKEN_KDA, TOKEN_MOE = "token_mla", "token_kda", "token_moe"  # the Experiment page's per-token pickers
PAGE_PICKERS = {TOKEN_MLA: ("layer", "head"), TOKEN_KDA: ("layer", "head"), TOKEN_MOE: ("layer",)}
APPLIED = "k3lab_link_applied"
NOTES = "k3lab_link_notes"


def _shown(value: str) -> str:
    """A query value as the notes quote it: ``k3core.utils.input_limits.shown`` at 60 characters (the notes are
    escaped where shown)."""
    return shown(value, 60)


def _choice(name: str, value: str, allowed: dict[str, Any] | Sequence[str], notes: list[str]) -> Any:
    """The session value for a query value from a fixed set, or None (with a note) when unknown."""
    if isinstance(allowed, dict):
        if value in allowed:
            return allowed[value]
        shown = sorted(allowed)
    else:
        if value in allowed:
            return value
        shown = list(allowed)
    more = f" (and {len(shown) - 8} more)" if len(shown) > 8 else ""
    notes.append(f"The link's {name}={_shown(value)} is not known here; showing the default. Known: {shown[:8]}{more}.")
    return None


def _int(name: str, value: str, low: int, high: int, notes: list[str]) -> int | None:
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or not low <= n <= high:
        notes.append(f"The link's {name}={_shown(value)} is not a whole number in {low}..{high}; showing the default.")
        return None
    return n


def from_params(params: dict[str, str], run_labels: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Session-state values for a link's query parameters, and notes naming the values that were not used."""
    notes: list[str] = []
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if value is not None:
            out[key] = value

    if "run" in params:
        put("k3lab_run", _choice("run", params["run"], list(run_labels), notes))
    if "text" in params:
        put("k3lab_text_source", _choice("text", params["text"], TEXT_SLUGS, notes))
        if params["text"] in ("paste", "upload"):
            notes.append("Links do not carry pasted or uploaded text: paste or upload it again in the sidebar.")
    if "tokens" in params:
        put("k3lab_max_tokens", _int("tokens", params["tokens"], 2, inp.MAX_TOKENS_CAP, notes))
    if "seq" in params:
        seq = _int("seq", params["seq"], inp.SEQ_LENS[0], inp.SEQ_LENS[-1], notes)
        if seq is not None and seq not in inp.SEQ_LENS:
            notes.append(f"The link's seq={seq} is not one of the slider's lengths (powers of two from 1024).")
            seq = None
        put("k3lab_seq_len", seq)
    if "device" in params:
        put("k3lab_device", _choice("device", params["device"], inp.device_choices(), notes))
    if "dtype" in params:
        put("k3lab_dtype", _choice("dtype", params["dtype"], list(loading.DTYPES), notes))
    if "attn" in params:
        put("k3lab_record_attn", _choice("attn", params["attn"], {"0": False, "1": True}, notes))
    if "mode" in params:
        put("k3lab_cmp_mode", _choice("mode", params["mode"], MODES, notes))
    if "b" in params:
        put("k3lab_cmp_run_b", _choice("b", params["b"], list(run_labels), notes))
    if "text_b" in params:
        put("k3lab_cmp_text_source", _choice("text_b", params["text_b"], TEXT_SLUGS, notes))
    for param, key in (("text_index", "k3lab_text_index"), ("text_index_b", "k3lab_cmp_text_index")):
        if param in params:
            put(key, _int(param, params[param], 0, MAX_TEXT_INDEX, notes))
    if "section" in params:
        put("k3lab_cmp_section", _choice("section", params["section"], list(page_registry.COMPARE_SECTIONS), notes))
    if "edits" in params:
        from k3core.interp.edit_kinds import EditError
        from k3core.interp.interventions import edits_from_json

        try:
            put(EDITS, [e.to_dict() for e in edits_from_json(params["edits"])])
            out["k3lab_exp_autorun"] = True  # a link to an experiment shows its result
        except EditError as exc:
            notes.append(f"The link's edits could not be read ({exc}); the experiment starts with none.")
    if "pick" in params:
        picks, pick_notes = picks_from_param(params["pick"])
        notes.extend(pick_notes)
        if picks:
            out[PICKS] = picks
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        notes.append(
            f"The link's parameter(s) {', '.join(_shown(u) for u in unknown[:8])} are not known here and were ignored."
        )
    return out, notes


def picks_from_param(value: str) -> tuple[dict[str, dict[str, int]], list[str]]:
    """``"kda_state_norm:L3H1,moe_coactivation:L5"`` -> {view key: {"layer": 3, "head": 1}, ...}, and notes for
    the entries that are not a known view's (or ``PAGE_PICKERS``') pick: an axis it has no picker for, or not
    L<n>H<n>. Whether the run has that layer or head is checked where it is drawn (``app.state.pickers.picker``)."""
    from analysis.views import picks as pk
    from analysis.views.catalogue import all_views

    axes = {v.key: v.picks.axes for v in all_views() if v.picks is not None} | PAGE_PICKERS
    out: dict[str, dict[str, int]] = {}
    notes: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        view, _, text = entry.partition(":")
        if view not in axes:
            notes.append(
                f"The link's pick {_shown(entry)} names no view with a layer/head picker; known: {sorted(axes)[:8]}."
            )
            continue
        try:
            pick = pk.parse_pick(text)
        except ValueError as exc:
            notes.append(f"The link's pick for {view} is not used: {exc}.")
            continue
        extra = sorted(set(pick) - set(axes[view]))
        if extra:
            notes.append(f"The link's pick for {view} names {', '.join(extra)}, which that view has no picker for.")
        pick = {a: v for a, v in pick.items() if a in axes[view]}
        if pick:
            out[view] = pick
    return out, notes


def picks_param(picks: dict[str, dict[str, int]]) -> str | None:
    """The ``pick`` query value of the session's picks (views in key order), or None without any."""
    from analysis.views import picks as pk

    parts = [f"{view}:{pk.pick_text(p.get('layer'), p.get('head'))}" for view, p in sorted(picks.items()) if p]
    return ",".join(parts) or None


def apply_once(run_labels: Sequence[str]) -> None:
    """On a session's first run, put the link's choices into the session (before any widget is drawn)."""
    ss = st.session_state
    if ss.get(APPLIED):
        return
    ss[APPLIED] = True
    params = {k: st.query_params[k] for k in st.query_params.keys()}
    values, notes = from_params(params, run_labels)
    for key, value in values.items():
        ss[key] = value
    ss[NOTES] = notes


def show_notes(page: str) -> None:
    """The link's unknown values, as warnings, on the page the link opened (until the user leaves it)."""
    ss = st.session_state
    notes = ss.get(NOTES) or []
    if not notes:
        return
    if ss.setdefault(NOTES + "_page", page) != page:
        ss[NOTES] = []
        return
    for note in notes:  # the notes quote the link's values: shown as text, never as Markdown
        st.warning(md_escape(note), icon=":material/link_off:")


def params_of(inputs: inp.Inputs) -> dict[str, str]:
    """The query parameters of the sidebar's choices (defaults left out, except run, text and tokens; a trace
    folder's recorded text: text_index instead of text and tokens)."""
    params: dict[str, str] = {}
    if inputs.run is not None:
        params["run"] = inputs.run.label
    if inputs.text.source == inp.TEXT_RECORDED:  # a trace folder's text: its tokens are the recorded ones
        params["text_index"] = str(inputs.text.recorded)
    else:
        params["text"] = SLUG_OF_TEXT.get(inputs.text.source, "shakespeare")
        params["tokens"] = str(inputs.text.max_tokens)
    if inputs.seq_len != inp.SEQ_LEN_DEFAULT:
        params["seq"] = str(inputs.seq_len)
    if inputs.device != "cpu":
        params["device"] = inputs.device
    if inputs.dtype != "float32":
        params["dtype"] = inputs.dtype
    if not inputs.record_attn:
        params["attn"] = "0"
    return params


def write(inputs: inp.Inputs) -> None:
    """Replace the address bar's query parameters with the sidebar's choices."""
    params = params_of(inputs)
    pick = picks_param(st.session_state.get(PICKS) or {})
    if pick:
        params["pick"] = pick
    if dict(st.query_params.to_dict()) != params:
        st.query_params.from_dict(params)


def write_picks() -> None:
    """Bring the address bar's ``pick`` up to date with the session's picks (after a picker was drawn)."""
    value = picks_param(st.session_state.get(PICKS) or {})
    current = st.query_params.to_dict().get("pick")
    if value is None and current is not None:
        del st.query_params["pick"]
    elif value is not None and current != value:
        st.query_params["pick"] = value


def write_compare(
    mode: str, run_b: str | None, text_b: str | None, section: str, text_index_b: int | None = None
) -> None:
    """Add the Compare page's choices to the address bar (``text_index_b``: text B is a trace folder's text)."""
    extra = {"mode": SLUG_OF_MODE.get(mode, "runs"), "section": section}
    if run_b is not None:
        extra["b"] = run_b
    if text_index_b is not None:
        extra["text_index_b"] = str(text_index_b)
    elif text_b is not None:
        extra["text_b"] = SLUG_OF_TEXT.get(text_b, "mqar")
    current = st.query_params.to_dict()
    if any(current.get(k) != v for k, v in extra.items()):
        st.query_params.update(extra)


def write_edits(edits: list[dict]) -> None:
    """Add the experiment's edits to the address bar (JSON), or take them out when there are none."""
    import json

    value = json.dumps(edits, separators=(",", ":")) if edits else None
    current = st.query_params.to_dict()
    if value is None:
        if "edits" in current:
            del st.query_params["edits"]
    elif current.get("edits") != value:
        st.query_params["edits"] = value
