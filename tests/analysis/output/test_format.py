"""analysis.output.format: the one number formatter, against hand-written expectations."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.output.format import format_bytes, format_count, format_number, format_tokens


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "n/a"),
        (float("nan"), "n/a"),
        (float("inf"), "∞"),
        (-float("inf"), "-∞"),
        (True, "True"),
        (12345, "12,345"),
        (np.int64(-7), "-7"),
        (2.51234, "2.512"),
        (0.000123456, "0.0001235"),
        (123456.7, "1.235e+05"),
        (np.float32(0.5), "0.5"),
        ("label", "label"),
    ],
)
def test_format_number(value, shown):
    assert format_number(value) == shown


def test_format_number_digits():
    assert format_number(3.14159, digits=2) == "3.1"


@pytest.mark.parametrize(
    ("n", "shown"), [(999, "999"), (1234, "1.23K"), (1_568_728, "1.57M"), (2.5e9, "2.50B"), (3e12, "3.00T")]
)
def test_format_count(n, shown):
    assert format_count(n) == shown


@pytest.mark.parametrize(
    ("n", "shown"), [(1000, "1000"), (1024, "1K"), (131072, "128K"), (1 << 20, "1M"), (1536, "1536")]
)
def test_format_tokens(n, shown):
    assert format_tokens(n) == shown


@pytest.mark.parametrize(
    ("n", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (846296, "826.5 KiB"), (98.25e9, "91.5 GiB"),
     (2.78e12 * 2, "5.1 TiB"), (3 * 1024**5, "3.0 PiB")],
)  # fmt: skip
def test_format_bytes(n, shown):
    assert format_bytes(n) == shown
