"""The ``k3lab`` command: dispatch to one module per command, each wiring the functions the app uses.

k3lab app [RUN ...]        open the Streamlit app (default: the shipped sample checkpoints)   k3lab/app.py
k3lab train ...            train a config (see k3lab train --help)                            k3lab/train.py
k3lab report RUN [RUN2]    headless HTML report with every figure and its data                k3lab/report.py
k3lab trace RUN --out DIR  trace a checkpoint into a folder the app opens without weights   k3lab/trace.py
k3lab inspect RUN          config, parameter counts, layer map, headline numbers              k3lab/inspect.py
k3lab weights PATH --out DIR   weight-only diagnostics of a checkpoint of any size            k3lab/weights.py
k3lab generate RUN         sample text from a checkpoint                                      k3lab/generate.py
k3lab presets              list the named configurations and their sizes                      k3lab/presets.py
k3lab experiment RUN --edit E --text T --out DIR   an edited forward beside the baseline          k3lab/experiment.py
k3lab patch RUN --clean A --corrupted B --out DIR  activation patching                            k3lab/experiment.py
k3lab attribute RUN --prompt P --target Y --out DIR  Captum attribution per output x input token  k3lab/experiment.py
k3lab survey RUN --sample NAME --out DIR   statistics over a corpus: expert atlas, expert cache   k3lab/survey.py

Each command module has ``main(argv) -> exit code`` (k3lab/experiment.py one per command it serves: ``ENTRY``)
and imports its heavy libraries (torch) inside it, so ``k3lab --help`` stays instant.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

COMMANDS = {
    "app": "open the Streamlit app",
    "train": "train a K3 config (byte-level, Shakespeare by default)",
    "report": "write a headless HTML report for one or two runs",
    "long": "long-context diagnostics of one or two runs on one long text (cost estimate first)",
    "trace": "trace a checkpoint on texts into a trace folder (one process, or under torchrun)",
    "inspect": "print config, parameter counts, layer map and headline numbers",
    "weights": "weight-only diagnostics (decay, depth, routing) of a checkpoint of any size",
    "generate": "generate text from a checkpoint",
    "presets": "list the named configurations",
    "experiment": "run a text with edits (interventions) beside the baseline, per token",
    "patch": "activation patching between a clean and a corrupted text",
    "attribute": "attribution of a continuation to the prompt's tokens (Captum)",
    "survey": "statistics over a corpus: MoE load, expert atlas, expert-cache hit rates (resumable, torchrun)",
}


# commands served by a function other than their own module's ``main``: "module:function"
ENTRY = {"patch": "experiment:patch_main", "attribute": "experiment:attribute_main"}


def entry(command: str) -> Callable[[list[str]], int]:
    """The function that runs ``command`` (its arguments in, exit code out); imported on call."""
    module, _, function = ENTRY.get(command, f"{command}:main").partition(":")
    return getattr(importlib.import_module(f"k3lab.{module}"), function)


def _usage() -> str:
    lines = ["usage: k3lab COMMAND [options]", "", "commands:"]
    lines += [f"  {name:10s} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run `k3lab COMMAND --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        from k3core.utils.input_limits import shown

        print(f"k3lab: unknown command {shown(command)}\n\n{_usage()}", file=sys.stderr)
        return 2
    return entry(command)(rest)


if __name__ == "__main__":
    sys.exit(main())
