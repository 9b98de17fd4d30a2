"""k3core.utils.input_limits (issue 28): every numeric input and text bounded in one place, for the CLI and the links
alike. Each case the issue found (a traceback, a silent wrap or a runaway) now gets a message within 2 s and
200 MB of extra memory (``bounded`` from tests/repo/test_hostile_inputs.py); the CLI exits with 2 and no traceback."""

from __future__ import annotations

import json
import math
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from app.state.links import from_params
from k3core.interp.edit_kinds import EditError, ValueEdit
from k3core.interp.interventions import edits_from_json, intervene, parse_edit
from k3core.modeling.model import K3ForCausalLM
from k3core.utils import input_limits as limits
from k3lab.cli import main as k3lab
from tests.repo.test_hostile_inputs import LIMIT_BYTES, LIMIT_S, bounded

SAMPLE = Path(__file__).resolve().parents[3] / "sample_checkpoints" / "k3-full"
DEEP = "[" * 50_000 + "]" * 50_000


# ----------------------------------------------------------------------------------------- the module
@pytest.mark.parametrize(
    ("value", "ok"),
    [(3, 3), ("7", 7), (4.0, 4), (True, None), (3.5, None), ("1e9", None), (math.nan, None), ("x", None)],
)
def test_bounded_int_takes_whole_numbers_only(value, ok):
    if ok is None:
        with pytest.raises(limits.InputLimitError, match="whole number"):
            limits.bounded_int(value, "n", 0, 10)
    else:
        assert limits.bounded_int(value, "n", 0, 10) == ok
    with pytest.raises(limits.InputLimitError, match="n must be in 0..10, got 11"):
        limits.bounded_int(11, "n", 0, 10)


def test_positions_accept_minus_one_as_last_and_no_other_negative():
    assert limits.position(-1, 12, "--position") == 11 and limits.position(0, 12, "p") == 0
    with pytest.raises(limits.InputLimitError, match="positions are 0..11, or -1 for the last"):
        limits.position(-2, 12, "--position")
    with pytest.raises(limits.InputLimitError, match="12 tokens"):
        limits.position(12, 12, "--position")
    assert limits.span("2", "5", 8, "--span") == (2, 5)
    for start, stop in (("5", "2"), ("0", "9"), ("-1", "3")):
        with pytest.raises(limits.InputLimitError, match="--span"):
            limits.span(start, stop, 8, "--span")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e31, "2"])
def test_values_must_be_finite_numbers(value):
    with pytest.raises(limits.InputLimitError, match="number"):
        limits.finite_values([1.0, value], "v")


def test_json_depth_counts_brackets_outside_strings():
    limits.json_depth('[{"a": "[[[[[[[[[[[[[[[[[[[[[[[["}]', "x")  # brackets in a string do not count
    with pytest.raises(limits.InputLimitError, match="nested more than 16"):
        limits.json_depth("[" * 17, "x")


# ----------------------------------------------------------------------------------------- edits
def test_negative_channels_are_refused_never_wrapped():
    for text in ("value.zero point=kda.g channels=-100000", "value.zero point=kda.g channels=-1"):
        message = bounded(lambda t=text: parse_edit(t), EditError, "negative")
        assert "never counted from the end" in message
    bounded(lambda: edits_from_json('{"kind": "value", "op": "zero", "heads": [-3]}'), EditError, "heads=-3")
    bounded(lambda: parse_edit("kda.pin_g layer=-1 value=0"), EditError, "layer=-1 is negative")
    bounded(lambda: parse_edit("mla.mask_keys layer=3 keys=-2:1"), EditError, "negative")


def test_an_index_past_the_axis_is_an_error_not_a_silent_no_op():
    model = K3ForCausalLM.from_config("k3-nano").eval()
    ids = torch.randint(0, 256, (1, 8))
    for text, match in (("value.zero point=kda.g channels=100000", r"channel \[100000\] out of range"),
                        ("value.zero point=mixer_out tokens=50:60", "token range 50:60 is out of range")):  # fmt: skip
        edit = parse_edit(text)

        def run(e=edit):
            with intervene(model, [e]):
                model(ids)

        bounded(run, EditError, match)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"kind": "value", "op": "scale", "value": NaN}', "NaN is not a JSON value"),
        ('{"kind": "value", "op": "scale", "value": Infinity}', "Infinity is not a JSON value"),
        ('{"kind": "value", "op": "add", "value": [1, -Infinity]}', "-Infinity is not a JSON value"),
        ('{"kind": "value", "op": "scale", "value": 1e999}', "1e999 is out of range"),
        ("value.scale point=mixer_out value=nan", "must be a finite number .* got nan"),
        ("value.scale point=mixer_out value=inf", "must be a finite number .* got inf"),
        ("kda.scale_beta layer=1 value=-inf", "must be a finite number .* got -inf"),
    ],
)
def test_nan_and_infinity_as_edit_values_are_refused(text, names):
    """Each refusal names the value it refused (the JSON token or the parsed number)."""
    bounded(lambda: parse_edit(text), EditError, names)


def test_edits_nested_fifty_thousand_deep_are_a_message():
    message = bounded(lambda: edits_from_json(DEEP), EditError, "nested more than 16 levels")
    assert "edits" in message
    out, notes = from_params({"edits": DEEP}, [])  # a link: a note, and the experiment starts with none
    assert "k3lab_exp_edits" not in str(out) and any("nested more than" in n for n in notes)
    bounded(lambda: edits_from_json(json.dumps([{"kind": "moe", "op": "ban"}] * 65)), EditError, "65 edits")
    bounded(lambda: parse_edit("x" * (limits.MAX_EDIT_JSON_CHARS + 1)), EditError, "over the limit")


def test_direct_edits_are_checked_too():
    with pytest.raises(EditError, match="negative"):
        ValueEdit("mixer_out", "zero", channels=[-1])


# ----------------------------------------------------------------------------------------- the CLI
def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run a k3lab command in this process within the time and memory bounds; (exit code, stderr)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            code = k3lab(argv)
        except SystemExit as exc:  # argparse's own exit for a refused option
            code = exc.code
        seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert seconds < LIMIT_S + 3, seconds  # + the model load of the sample (about 0.5 s) on a loaded machine
    assert peak < LIMIT_BYTES, peak
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attribute", "--prompt", "ab", "--target", "c", "--steps", "-1"], "--steps: must be in 1..512, got -1"),
        (["attribute", "--prompt", "ab", "--target", "c", "--steps", "1000000000"], "--steps: must be in 1..512"),
        (["attribute", "--prompt", "ab", "--target", "c", "--steps", "1e9"], "--steps: must be a whole number"),
        (["attribute", "--prompt", "ab", "--target", "c", "--samples", "1000000000"], "--samples: must be in 1..256"),
        (["experiment", "--edit", "moe.ban layer=2 experts=1", "--text", "ab", "--max-tokens", "999999999999"],
         "--max-tokens: must be in 2..65,536"),
        (["patch", "--clean", "ab", "--corrupted", "cd", "--position", "-5"], "--position: must be in -1..65,535"),
        (["trace", "--max-tokens", "1", "--text", "x"], "--max-tokens: must be in 2..65,536, got 1"),
        (["generate", "--tokens", "-1"], "--tokens: must be in 0..65,536"),
    ],
)  # fmt: skip
def test_refused_options_are_argparse_messages(argv, message, capsys, tmp_path):
    code, err = _cli([argv[0], str(SAMPLE), *argv[1:], *(["--out", str(tmp_path / "o")] if argv[0] != "generate"
                                                         else [])], capsys)  # fmt: skip
    assert code == 2 and message in err, err


def test_patch_position_past_the_text_is_a_message(capsys, tmp_path):
    common = ["patch", str(SAMPLE), "--clean", "abcd", "--corrupted", "abce", "--out", str(tmp_path / "o")]
    tokens = ["--correct", "#1", "--wrong", "#2"]
    code, err = _cli([*common, *tokens, "--position", "99999"], capsys)
    assert code == 2 and "--position: must be in -1..65,535, got 99,999" in err, err
    code, err = _cli([*common, *tokens, "--position", "999"], capsys)  # parsed, then checked against the text
    assert code == 2 and "--position (the text has 4 tokens; -1 is the last) must be in 0..3, got 999" in err, err
    code, err = _cli([*common, "--metric", "span_loss", "--span", "3:1"], capsys)
    assert code == 2 and "--span stop must be in 4..4, got 1" in err, err


def test_a_ten_megabyte_text_is_refused_before_tokenising(capsys, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("a" * 10_000_000)
    code, err = _cli(["experiment", str(SAMPLE), "--edit", "moe.ban layer=2 experts=1", "--text-file", str(big),
                      "--max-tokens", "65536", "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "over the limit of" in err, err
    code, err = _cli(["generate", str(SAMPLE), "--prompt", "a" * 10_000_000], capsys)
    assert code == 2 and "--prompt is 10,000,000 characters" in err
    code, err = _cli(["attribute", str(SAMPLE), "--prompt", "ab", "--target", "c", "--baseline-token", "4096",
                      "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "--baseline-token must be in 0..255" in err, err
