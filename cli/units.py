"""How people write and read byte counts: '64GiB' in, '64.0 GiB' out."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
    "p": 1 << 50,
    "pib": 1 << 50,
    "pb": 1000**5,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736. Bare K/M/G/T are binary, as in daxctl's -s."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 64GiB, 512M or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
