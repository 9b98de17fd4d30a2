"""Options several commands share: --device / --dtype / --max-memory (/ --offload-folder) of every command that
loads a model (generate, report, inspect) and --out / --no-static / --quiet of those that write a folder of figures
(report, weights). Kept free of torch so that ``k3lab --help`` stays instant."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


class _StatesCaps(argparse.HelpFormatter):
    """Help that states every bounded number's range: an option whose ``type`` is ``arg_int`` / ``arg_float`` gets
    "[low..high]" after its help unless the help already names the upper bound."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        cap = getattr(action.type, "cap", None)
        if cap is None or (text and cap[1] in text):
            return text
        return f"{text or ''} [{cap[0]}..{cap[1]}]".strip()


class Parser(argparse.ArgumentParser):
    """Every command's argument parser: argparse's, with a refused value quoted back as
    ``k3core.utils.input_limits.shown`` quotes it (argparse echoes a rejected value whole: 100,000 characters of an
    invalid choice would be 100,000 characters on stderr), and every bounded number's range stated in --help."""

    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter, **kwargs) -> None:
        formatter = type(f"Caps{formatter_class.__name__}", (_StatesCaps, formatter_class), {})
        super().__init__(*args, formatter_class=formatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        from k3core.utils.input_limits import clip_quoted

        super().error(clip_quoted(message))


def add_device_options(parser: argparse.ArgumentParser, offload_folder: bool = False, when: str = "") -> None:
    """Add --device (cpu, cuda, cuda:N, auto) and --dtype; with ``offload_folder`` also --offload-folder.
    ``when`` prefixes the help (e.g. "with --text/--sample: ") for commands that load a model only sometimes."""
    auto = (
        "then --offload-folder on disk (accelerate), printing the plan first"
        if offload_folder
        else "then a temporary folder on disk (accelerate)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help=f"{when}cpu (default), a GPU such as cuda or cuda:0, or auto: spread the decoder layers over every "
        f"visible GPU, then the CPU, {auto}",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_CHOICES,
        help=f"{when}weights dtype (default float32); gates, convolutions and router biases stay float32",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help=f"{when}memory budget on --device (e.g. 8GB, 6GiB): run from the checkpoint files within it, routed "
        "experts read as the router chooses them (LRU cache), dense parts resident when they fit, else read "
        "module by module; prints the plan (what stays, what streams, bytes and expected time per prompt) first",
    )
    if offload_folder:
        parser.add_argument(
            "--offload-folder",
            default=None,
            metavar="DIR",
            help="with --device auto: where weights that fit on no device go (default: a temp folder)",
        )


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """Add --out DIR (required), --no-static (no PNG/SVG) and --quiet (no progress bar)."""
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created if needed)")
    parser.add_argument("--no-static", action="store_true", help="skip PNG/SVG export (no browser start; fastest)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def arg_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number in [low, high] (``k3core.utils.input_limits.bounded_int``); argparse prints
    the message and exits with 2, no traceback. ``Parser``'s help states the range."""
    from k3core.utils.input_limits import InputLimitError, bounded_int

    def parse(value: str) -> int:
        try:
            return bounded_int(value, "value", low, high)
        except InputLimitError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    parse.__name__ = f"whole number in {low}..{high}"
    parse.cap = (_number(low), _number(high))  # type: ignore[attr-defined]
    return parse


def arg_float(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number in [low, high]; argparse prints the message and exits with 2.
    ``Parser``'s help states the range."""
    from k3core.utils.input_limits import shown

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not low <= number <= high:  # NaN and infinities fail too
            raise argparse.ArgumentTypeError(f"must be a number in {_number(low)}..{_number(high)}, got {shown(value)}")
        return number

    parse.__name__ = f"number in {low}..{high}"
    parse.cap = (_number(low), _number(high))  # type: ignore[attr-defined]
    return parse


def arg_position() -> Callable[[str], int]:
    """An argparse ``type=`` for a token position: a whole number >= -1 (-1: the last token); the text's length
    is checked once it is known (``k3core.utils.input_limits.position``)."""
    from k3core.utils.input_limits import MAX_TOKENS

    return arg_int(-1, MAX_TOKENS - 1)
