"""The one size rule: G and GiB binary, decimal only when spelled GB, nothing guessed."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from poold.sizes import ByteCount, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("10B", 10),
        ("64G", 64 << 30),
        ("64g", 64 << 30),
        ("64GiB", 64 << 30),
        ("64gib", 64 << 30),
        ("64 GiB", 64 << 30),
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("2T", 2 << 40),
        ("64GB", 64 * 10**9),
        ("64MB", 64 * 10**6),
        ("64kB", 64_000),
        ("64KB", 64_000),
        ("1PB", 10**15),
    ],
)
def test_sizes_parse_by_the_rule(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["64gb", "64Gb", "64mb", "64kb", "1tb"])
def test_lowercase_b_is_refused_not_guessed(text: str) -> None:
    with pytest.raises(ValueError, match="ambiguous size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["lots", "-1", "64X", "64GiBs", "", "1e9", "0x10"])
def test_non_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_a_fraction_must_come_out_whole() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size("0.5B")
    assert parse_size("0.5K") == 512


def test_byte_count_fields_take_ints_and_strings() -> None:
    class M(BaseModel):
        n: ByteCount

    assert M(n=5).n == 5
    assert M.model_validate({"n": "64MiB"}).n == 64 << 20
    with pytest.raises(ValidationError, match="ambiguous"):
        M.model_validate({"n": "64mb"})
    for flag in (True, False):  # `= true` in a TOML file is no size (lax int: 1)
        with pytest.raises(ValidationError, match="not a size"):
            M.model_validate({"n": flag})


def test_format_size() -> None:
    assert format_size(64 << 30) == "64.0 GiB"
    assert format_size(512) == "512 B"
    assert format_size(3 << 49) == "1536.0 TiB"
