"""Every number and text a user types, bounded and checked in one place: the command line (``k3lab``'s parsers
use ``k3lab.options.arg_int``, which calls ``bounded_int``), the edits (``k3core.interp.edit_kinds``,
``k3core.interp.interventions``) and the app's links and pages call these. A refusal is an ``InputLimitError`` (a
ValueError) whose message names the input, the value and the range; never a traceback, never a silent wrap or clip.
A value is quoted back with ``shown`` (cut to SHOWN_CHARS characters): every message that echoes user input uses it.

Conventions: indices are 0-based and never negative (``channels=-1`` is refused, not "the last one"), except a
*position* where -1 alone means the last token (documented in each option's help), and an AttnRes source, which
``k3core.interp.edit_kinds`` documents as counted from the end when negative; ranges are [start, stop).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

MAX_TOKENS = 65_536  # tokens of one text: k3lab trace / experiment / patch / attribute --max-tokens
MAX_TEXT_CHARS = 1_000_000  # one text typed, pasted or read from a file (about 250k tokens of English)
MAX_TEXT_BYTES = 4 * MAX_TEXT_CHARS  # a text file (UTF-8: at most 4 bytes a character)
MAX_INDEX = 1 << 24  # a layer, head, channel, expert, source or chunk index, and a range end
MAX_INDICES = 1 << 16  # indices in one list
MAX_VECTOR = 1 << 20  # numbers in one edit value vector
MAX_ABS_VALUE = 1e30  # an edit value (finite, and well inside float32)
MAX_EDITS = 64  # edits in one experiment
MAX_EDIT_JSON_CHARS = 1 << 20
MAX_JSON_DEPTH = 16  # edits are a list of flat objects: 3 levels; nothing a person writes needs 16
MAX_IG_STEPS = 512  # integrated gradients: each step is a forward and backward over the whole input
MAX_SHAPLEY_SAMPLES = 256  # Shapley value sampling: each permutation is one forward per input token
MAX_POSITIONS = 256  # positions listed for prediction changes
MAX_PROMPT_TOKENS = 8192  # a prompt read before generating (the CLI and the app's Generate page)
MAX_TRAIN_STEPS = 10_000_000  # optimizer steps of one training run
MAX_SEED = 2**63 - 1
MAX_THREADS = 1024  # torch threads
MAX_RANKS = 65_536  # processes of a pipeline plan


class InputLimitError(ValueError):
    """An input outside its bounds or of the wrong kind; the message names it and says what is allowed."""


SHOWN_CHARS = 80  # of a user's input quoted back in a message


def shown(value: Any, max_chars: int = SHOWN_CHARS) -> str:
    """``value`` as a message quotes it back: its repr (a string's, a list's, ...), cut to ``max_chars`` characters
    with how long it was ("'xxxx...' (100,002 characters)"). The one way every message echoes what a user typed, so
    a refused 100,000-character input gets a message of a line, not of 100,000 characters."""
    text = repr(value) if not isinstance(value, (list, tuple, set, frozenset)) or len(value) <= 64 else None
    if text is None:  # a long list: never written out whole to be cut
        items = list(value)
        text = f"{repr(items[:16])[:-1]}, ... ({len(items):,} items)]"
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text):,} characters)"


_QUOTED = re.compile("'[^'\\n]{" + str(SHOWN_CHARS + 1) + ",}'")


def clip_quoted(message: str) -> str:
    """A message built elsewhere (argparse's "invalid choice: 'xxx...'") with every quoted value longer than
    SHOWN_CHARS cut as ``shown`` cuts it."""
    return _QUOTED.sub(lambda m: shown(m.group(0)[1:-1]), message)


def bounded_int(value: Any, what: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high] (a whole number: 3, "3", 3.0; never True, 3.5, "1e9" or NaN)."""
    if isinstance(value, bool):
        raise InputLimitError(f"{what} must be a whole number in {low:,}..{high:,}, got {shown(value)}")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("+-").isdigit() or len(text) > 20:
            raise InputLimitError(f"{what} must be a whole number in {low:,}..{high:,}, got {shown(value)}")
        value = int(text)
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise InputLimitError(f"{what} must be a whole number in {low:,}..{high:,}, got {shown(value)}")
        value = int(value)
    elif not isinstance(value, int):
        raise InputLimitError(f"{what} must be a whole number in {low:,}..{high:,}, got {shown(value)}")
    if not low <= value <= high:
        raise InputLimitError(f"{what} must be in {low:,}..{high:,}, got {value:,}")
    return value


def finite_number(value: Any, what: str, bound: float = MAX_ABS_VALUE) -> float:
    """``value`` as a float with |value| <= bound; NaN and infinities refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputLimitError(f"{what} must be a number, got {shown(value)}")
    number = float(value) if not isinstance(value, int) or abs(value) <= bound else math.inf
    if not math.isfinite(number) or abs(number) > bound:
        raise InputLimitError(f"{what} must be a finite number of at most {bound:g} in size, got {shown(value)}")
    return number


def finite_values(value: Any, what: str) -> Any:
    """A number or a flat list of at most MAX_VECTOR numbers, each finite (``finite_number``); None passes."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_VECTOR:
            raise InputLimitError(f"{what} holds {len(value):,} numbers, over the limit of {MAX_VECTOR:,}")
        return [finite_number(v, f"{what}[{i}]") for i, v in enumerate(value)]
    return finite_number(value, what)


def index(value: Any, what: str, high: int = MAX_INDEX) -> int:
    """A 0-based index: 0 <= value <= high; a negative one is refused (never counted from the end)."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise InputLimitError(
            f"{what}={value} is negative: indices count from 0 and are never counted from the end here"
        )
    return bounded_int(value, what, 0, high)


def indices(values: Iterable[Any], what: str) -> list[int]:
    """A list of at most MAX_INDICES 0-based indices (``index`` each)."""
    values = list(values)
    if len(values) > MAX_INDICES:
        raise InputLimitError(f"{what} lists {len(values):,} indices, over the limit of {MAX_INDICES:,}")
    return [index(v, what) for v in values]


def position(value: Any, length: int, what: str) -> int:
    """A token position of a text of ``length`` tokens: 0..length-1, or -1 for the last one (the only negative
    accepted); returned as 0..length-1."""
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        return length - 1
    if isinstance(value, int) and not isinstance(value, bool) and value < -1:
        raise InputLimitError(f"{what}={value}: positions are 0..{length - 1}, or -1 for the last token")
    return bounded_int(value, f"{what} (the text has {length:,} tokens; -1 is the last)", 0, length - 1)


def span(start: Any, stop: Any, length: int, what: str) -> tuple[int, int]:
    """[start, stop) positions of a text of ``length`` tokens: 0 <= start < stop <= length."""
    a = bounded_int(start, f"{what} start", 0, max(length - 1, 0))
    b = bounded_int(stop, f"{what} stop", a + 1, length) if a + 1 <= length else None
    if b is None:
        raise InputLimitError(f"{what} must be START:STOP with 0 <= START < STOP <= {length}")
    return a, b


def text(value: Any, what: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """A text of at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InputLimitError(f"{what} must be text, got {type(value).__name__}")
    if len(value) > max_chars:
        raise InputLimitError(
            f"{what} is {len(value):,} characters, over the limit of {max_chars:,}: use a shorter text "
            "(only the first --max-tokens tokens are read anyway)"
        )
    return value


def json_depth(source: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (brackets counted outside strings, one pass, no parse)."""
    depth, in_string, escaped = 0, False, False
    for ch in source:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise InputLimitError(f"{what} is nested more than {max_depth} levels deep")
        elif ch in "]}":
            depth -= 1
