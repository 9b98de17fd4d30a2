"""k3core.utils.units.parse_bytes: the one reader of sizes typed by people (--max-memory, --gpu-memory, the app)."""

import pytest

from k3core.utils.units import parse_bytes


@pytest.mark.parametrize(
    "text,bare,expected",
    [
        ("141GB", 1, 141 * 10**9),
        ("80GiB", 1, 80 * 2**30),
        ("80Gi", 1, 80 * 2**30),
        ("80G", 1, 80 * 10**9),
        ("512MiB", 1, 512 * 2**20),
        ("1.5TB", 1, 15 * 10**11),
        (" 6 gb ", 1, 6 * 10**9),
        ("4096B", 2**30, 4096),
        ("2", 2**30, 2 * 2**30),
        ("6e9", 1, 6 * 10**9),
        (6e9, 1, 6 * 10**9),
        (2, 2**30, 2 * 2**30),
    ],
)
def test_sizes_in_decimal_and_binary_units(text, bare, expected):
    assert parse_bytes(text, bare=bare) == expected


@pytest.mark.parametrize("bad", ["lots", "", "GB", "-1GB", "0", "1XB", "1e30TB", True, 0, -5])
def test_unreadable_or_non_positive_sizes_name_what_was_read(bad):
    with pytest.raises(ValueError, match=r"the memory budget"):
        parse_bytes(bad, what="the memory budget")


def test_zero_only_where_allowed():
    assert parse_bytes("0", zero_ok=True) == 0
    with pytest.raises(ValueError, match="must be positive"):
        parse_bytes("0GB")
