"""How the app shows what went wrong: the user-facing error types of every layer, caught at the page scaffold,
and text from users or files made safe for Markdown.

Each layer of the stack has its own error type (k3core: ``CheckpointError``, ``ConfigError``,
``TokenizerError``, ``EditError``; analysis: ``PatchingError``, ``AttributionError``, ``TokenDetailError``;
the app: ``LibraryError``, ``PathRefused``, ``ZipRefused``, ``InputError``, ``JobRefused``). ``shown_errors``
turns any of them into an ``st.error`` with its message, and anything else into a short message naming the
error's type (the traceback goes to the server log, never to the browser), so every page keeps serving.
Messages never carry server folders (``plain`` keeps only a path's last component).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import streamlit as st

from analysis.experiments.attribution_inputs import AttributionError
from analysis.experiments.patching import PatchingError
from analysis.metrics.token_detail import TokenDetailError
from app.library.roots import PathRefused
from app.library.run_folders import LibraryError
from app.library.safe_zip import ZipRefused
from app.server.job_budget import JobRefused
from app.state.inputs import InputError
from k3core.interp.edit_kinds import EditError
from k3core.loading.tensor_info import CheckpointError
from k3core.modeling.config import ConfigError
from k3core.tokenizer import TokenizerError

log = logging.getLogger("k3lab.app")

USER_ERRORS = (
    JobRefused,
    CheckpointError,
    ConfigError,
    TokenizerError,
    EditError,
    PatchingError,
    AttributionError,
    TokenDetailError,
    LibraryError,
    PathRefused,
    ZipRefused,
    InputError,
)
MAX_MESSAGE_CHARS = 1000
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character may be backslash-escaped
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/])/(?:[^\s'\"/:,;()\[\]]+/)+([^\s'\"/:,;()\[\]]*)")
_AUTOLINK = re.compile(r"(?<=:)(?=//)|(?i:(?<=www)(?=\.))|(?<=@)")  # GFM links these even in escaped text
ZERO_WIDTH = "\u200b"


def md_escape(text: object) -> str:
    """``text`` as Markdown that shows these characters and nothing more: no links, images, code spans,
    emphasis, colour directives, icons or math (CommonMark backslash-escapes every ASCII punctuation
    character). GFM also links bare URLs, www. names and e-mail addresses after escapes are resolved, so
    those get an invisible zero-width space (``http:\u200b//``) that their pattern does not match."""
    return _PUNCTUATION.sub(r"\\\1", _AUTOLINK.sub(ZERO_WIDTH, str(text)))


def strip_paths(text: str) -> str:
    """Absolute server paths in ``text`` cut to their last component: '/srv/runs/a/config.json' -> 'config.json'."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "(folder)", text)


def plain(exc: BaseException | str) -> str:
    """An error's message for users: library folders named as runs (``app.library.run_messages.message``), other server
    paths cut to their last component, at most MAX_MESSAGE_CHARS, escaped for Markdown."""
    from app.library.run_messages import message

    text = str(exc) if not isinstance(exc, OSError) or not exc.strerror else exc.strerror
    text = strip_paths(message(text))
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + " ..."
    return md_escape(text)


def describe(exc: BaseException) -> str:
    """A user error's message, or for anything else its type with a pointer to the server log (escaped)."""
    if isinstance(exc, USER_ERRORS):
        return plain(exc)
    if isinstance(exc, (MemoryError, OSError)):
        return f"{type(exc).__name__}: {plain(exc)}"
    return f"an unexpected {type(exc).__name__} (details are in the server's log)"


@contextmanager
def shown_errors(where: str = "This page") -> Iterator[None]:
    """Run a page (or the sidebar): an exception becomes an ``st.error`` and the app keeps serving.

    Streamlit's own control flow (``st.stop``, ``st.rerun``) is a BaseException and passes through."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the scaffold: whatever a page raises, the server stays up
        if not isinstance(exc, USER_ERRORS):
            log.exception("%s failed", where)
        st.error(f"{where} cannot be shown: {describe(exc)}")


_BLANK_HEADER = re.compile(r"^\|(?:[ \t]*\|)+[ \t]*$(?=\n\|[ \t:-]*-)", re.MULTILINE)


def _named_header(match: re.Match) -> str:
    cells = match.group(0).count("|") - 1
    return "| " + " | ".join(["item"] + ["value"] * (cells - 1)) + " |"


def markdown_card(text: str) -> str:
    """A model card (README.md from a checkpoint folder) as Markdown that loads nothing from elsewhere:
    images (``![alt](url)``, ``![alt][ref]``) become plain links, raw HTML is left to Streamlit, which escapes it.
    A table whose header row is blank (``| | |``, drawn as an empty row) gets the header "item | value"."""
    return _BLANK_HEADER.sub(_named_header, re.sub(r"!(?=\[)", r"\\!", text))
