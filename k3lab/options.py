"""Options several commands share: --device / --dtype / --max-memory (/ --offload-folder) of every command that
loads a model (generate, report, inspect) and --out / --no-static / --quiet of those that write a folder of figures
(report, weights). Kept free of torch so that ``k3lab --help`` stays instant."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


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


def arg_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number in [low, high] (``k3core.utils.input_limits.bounded_int``); argparse prints
    the message and exits with 2, no traceback."""
    from k3core.utils.input_limits import InputLimitError, bounded_int

    def parse(value: str) -> int:
        try:
            return bounded_int(value, "value", low, high)
        except InputLimitError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    parse.__name__ = f"whole number in {low}..{high}"
    return parse


def arg_position() -> Callable[[str], int]:
    """An argparse ``type=`` for a token position: a whole number >= -1 (-1: the last token); the text's length
    is checked once it is known (``k3core.utils.input_limits.position``)."""
    from k3core.utils.input_limits import MAX_TOKENS

    return arg_int(-1, MAX_TOKENS - 1)
