"""The command line's caps (issue 36): a refused input is quoted back cut (``k3core.utils.input_limits.shown``, one
helper for every echo: edits, argparse's own messages, unknown commands), the prompt of `k3lab generate` has the app's
token cap (one constant), `k3lab train --steps` has a cap, and every numeric option of every command states its range
in --help. Each refusal within 2 s and 200 MB (``bounded``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from k3core.utils import input_limits as limits
from k3lab import cli
from k3lab.options import arg_float, arg_int
from tests.repo.test_hostile_inputs import bounded

SAMPLE = Path(__file__).resolve().parents[2] / "sample_checkpoints" / "k3-full"
LONG = "x" * 100_000
MAX_ECHO = 2_000  # characters of stderr a refused input may cause (its message, argparse's usage lines)


class Refused(Exception):
    """A command's non-zero exit, with what it wrote to stderr."""


def _refusal(argv: list[str], capsys) -> str:
    """Run `k3lab ARGV` in this process, within 2 s and 200 MB; it must refuse (exit status 2, argparse's or the
    command's); its stderr, which must be short."""

    def run() -> None:
        capsys.readouterr()
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        if code != 0:
            raise Refused(err)

    err = bounded(run, Refused, r"(?s).")
    assert len(err) < MAX_ECHO, f"{len(err):,} characters on stderr: {err[:300]}"
    return err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["experiment", str(SAMPLE), "--out", "unused", "--edit", LONG], "unknown edit kind 'xxxx"),
        (["experiment", str(SAMPLE), "--out", "unused", "--edit", "moe.ban layer=1 " + LONG], "expected key=value"),
        (["experiment", str(SAMPLE), "--out", "unused", "--edit", '{"kind": "' + LONG + '"}'], "unknown edit kind"),
        (["experiment", str(SAMPLE), "--out", "unused", "--edit", '{"kind": "moe", "' + LONG + '": 1}'], "no field"),
        (["inspect", str(SAMPLE), "--sample", LONG], "invalid choice"),
        (["report", str(SAMPLE), "--out", "unused", "--text-index", LONG], "expected a text number"),
        (["long", str(SAMPLE), "--out", "unused", "--lengths", LONG], "comma-separated token counts"),
        (["generate", str(SAMPLE), "--temperature", LONG], "must be a number"),
        (["train", "k3-nano", "--lr", LONG], "must be a number"),
        (["train", "k3-nano", "--batch-size", LONG], "--batch-size"),
        ([LONG], "unknown command"),
    ],
)
def test_a_refused_input_is_quoted_back_cut(argv, says, capsys):
    err = _refusal(argv, capsys)
    assert says in err and "characters)" in err, err


def test_an_edit_of_many_heads_is_quoted_back_cut(capsys):
    heads = ",".join(str(h) for h in range(60_000))
    err = _refusal(["experiment", str(SAMPLE), "--out", "unused", "--edit", f"mla.mask_keys layer=3 heads={heads}"],
                   capsys)  # fmt: skip
    assert "items)" in err or "characters)" in err, err


def test_shown_cuts_long_values_and_keeps_short_ones():
    assert limits.shown("abc") == "'abc'"
    assert limits.shown("y" * 10_000) == "'" + "y" * 79 + f"... ({10_002:,} characters)"
    assert limits.shown(list(range(100_000))).endswith("... (100,000 items)]")
    assert limits.clip_quoted("a 'short' one") == "a 'short' one"


def test_a_prompt_over_the_token_cap_is_refused_before_the_model_loads(capsys):
    """A 120,000-character prompt (a byte model: 120,000 tokens) gave no output for 200 s; now a message at once,
    the cap the app's Generate page applies (one constant)."""
    err = _refusal(["generate", str(SAMPLE), "--prompt", "y" * 120_000, "--tokens", "1"], capsys)
    assert f"the prompt is 120,000 tokens, over the limit of {limits.MAX_PROMPT_TOKENS:,}" in err
    assert cli.main(["generate", str(SAMPLE), "--prompt", "y" * limits.MAX_PROMPT_TOKENS, "--tokens", "1",
                     "--temperature", "0"]) == 0  # fmt: skip
    page = (Path(__file__).resolve().parents[2] / "app" / "page_scripts" / "generate.py").read_text()
    assert "[-MAX_PROMPT_TOKENS:]" in page  # the page reads the prompt's last MAX_PROMPT_TOKENS tokens


def test_train_steps_are_capped(capsys):
    err = _refusal(["train", "k3-nano", "--steps", "1000000000000"], capsys)
    assert f"--steps: must be in 0..{limits.MAX_TRAIN_STEPS:,}, got 1,000,000,000,000" in err


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, caught as it parses (nothing runs)."""

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    found = {}
    for command in cli.COMMANDS:
        with pytest.raises(_Parsed) as info:
            cli.entry(command)(["x"])
        found[command] = info.value.parser
    return found


def test_every_numeric_option_states_its_cap_in_help(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert set(parsers) == set(cli.COMMANDS)
    bounded_kinds = (arg_int(0, 1).__qualname__, arg_float(0, 1).__qualname__)
    checked = []
    for command, parser in parsers.items():
        formatter = parser.formatter_class(prog=parser.prog)
        for action in parser._actions:
            name = action.option_strings[-1] if action.option_strings else action.dest
            assert action.type not in (int, float), f"k3lab {command} {name}: a number without a cap"
            if getattr(action.type, "__qualname__", None) in bounded_kinds:
                help_text = formatter._get_help_string(action) or ""
                assert action.type.cap[1] in help_text, f"k3lab {command} {name}: --help does not state its cap"
                checked.append((command, name))
        parser.format_help()  # every help still formats
    assert ("train", "--steps") in checked and ("generate", "--temperature") in checked
    assert {("train", "--lr"), ("train", "--batch-size"), ("train", "--threads")} <= set(checked)
    assert ("app", "--port") in checked and ("survey", "--batch-size") in checked
    assert len(checked) >= 30, checked
