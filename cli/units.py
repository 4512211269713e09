"""How poolctl writes and reads byte counts: the one size rule, from poold.sizes."""

from __future__ import annotations

from poold.sizes import format_size, parse_size

__all__ = ["format_size", "parse_size"]
