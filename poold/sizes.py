"""How people write byte counts, everywhere: flags, config files, poolctl, the tenant client.

One rule, stated in the README: ``K``/``M``/``G``/``T``/``P`` and ``KiB``…``PiB`` are
binary (``64G`` == ``64GiB`` == 64 * 2**30, as daxctl's ``-s`` reads them), and a size
is decimal only when spelled with a capital ``B`` after the prefix: ``64GB`` == 64 * 10**9
(``kB`` and ``KB`` alike). ``64gb`` or ``64Gb`` is refused rather than guessed, since
people mean either. Letters other than the decimal ones are case-insensitive; a bare
number (or ``B``) is bytes; a fraction must come out as whole bytes (``1.5G`` is fine,
``0.5B`` is not).

No imports from the rest of the project: the wire, both daemons, the tenant client and
poolctl all read sizes through this module.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Final

from pydantic import BeforeValidator

_BINARY: Final = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL: Final = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "p": 1000**5}
_SIZE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_HINT: Final = "try 64GiB, 512M, 64GB (decimal) or a byte count"


def _multiplier(unit: str, text: str) -> int:
    if unit in ("", "b", "B"):
        return 1
    prefix, rest = unit[0].lower(), unit[1:]
    if prefix not in _BINARY:
        raise ValueError(f"not a size: {text!r} ({_HINT})")
    if rest == "" or rest.lower() == "ib":
        return _BINARY[prefix]
    # Decimal only when spelled so: GB, MB, TB, PB, and both kB and KB.
    if rest == "B" and (unit[0].isupper() or unit[0] == "k"):
        return _DECIMAL[prefix]
    if rest.lower() == "b":
        raise ValueError(
            f"ambiguous size: {text!r}: write {unit[0].upper()}iB (binary) or "
            f"{unit[0].upper()}B (decimal)"
        )
    raise ValueError(f"not a size: {text!r} ({_HINT})")


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736; '64G' the same; '64GB' -> 64000000000; ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} ({_HINT})")
    number, unit = match.groups()
    try:
        value = Decimal(number) * _multiplier(unit, text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"not a size: {text!r} ({_HINT})") from None
    if value != value.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def as_bytes(value: Any) -> Any:
    """A size as given (int, or a string by the rule above) -> int; anything else as is."""
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, bool):
        # pydantic's lax int takes True as 1: `max_body_bytes = true` in a TOML file
        # would be a 1-byte limit rather than the mistake it is.
        raise ValueError(f"not a size: {value!r} ({_HINT})")
    return value


# A byte count field that also takes "64GiB" (config files, env, flags, the client).
ByteCount = Annotated[int, BeforeValidator(as_bytes)]


def format_size(n: int) -> str:
    """68719476736 -> '64.0 GiB': binary units, one decimal, as `poolctl` prints them."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns
