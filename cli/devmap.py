"""`poolctl devices map`: where on each device the leases, the quarantined and reserved
ranges and the free holes lie, and how fragmented the free memory is.

Built from what the API already returns: each device's capacity, quarantined extents
(never to be allocated: poison, a failed scrub) and reserved extents (`GET /v1/status`)
and every live lease's device, offset, length and tenant (`GET /v1/leases?live=true`).
The arithmetic is cli/strip.py's; this module picks glyphs and colours. On a terminal
leased cells are solid blocks in one colour per tenant; in plain text (piped) each
tenant is a letter, and a quarantined cell is an `X`.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from cli.strip import Cell, Claim, Fragmentation, Span, bytes_by_kind, cells, fragmentation, layout
from cli.units import format_size
from poold.wire.admin import DeviceStatus
from poold.wire.common import LeaseOut

# One colour per tenant on a terminal, in legend order; more tenants than colours reuse them
# (the legend still tells them apart by letter).
PALETTE = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "red",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
    "bright_blue",
    "bright_red",
)
# Plain text: tenants are letters (upper case: the cell is the tenant's alone, lower
# case: it also holds other bytes), then digits, then '*' for the rest.
TENANT_LETTERS = string.ascii_uppercase + string.digits
RESERVED = ("#", "+")  # (whole, mixed)
DELEGATED = ("=", "-")  # reserved for a host's agent, not leased yet
QUARANTINED = ("X", "x")
FREE = (".", ":")
TERMINAL_LEASED = ("█", "▒")
TERMINAL_RESERVED = ("▓", "▒")
TERMINAL_DELEGATED = ("▚", "▞")
DELEGATED_STYLE = "bright_black on grey23"
TERMINAL_QUARANTINED = ("X", "x")
TERMINAL_FREE = ("·", "░")
RESERVED_STYLE = "grey50"
QUARANTINED_STYLE = "bold bright_white on red"
FREE_STYLE = "grey37"


@dataclass(frozen=True)
class DeviceMap:
    """One device's partition, strip and fragmentation figures."""

    device: DeviceStatus
    spans: list[Span]
    cells: list[Cell]
    frag: Fragmentation


def claims_of(device: DeviceStatus, leases: Sequence[LeaseOut]) -> list[Claim]:
    """The device's live leases, quarantined and reserved ranges, as strip claims."""
    out = [
        Claim(x.offset_bytes, x.length_bytes, "leased", x.tenant, x.id, x.state)
        for x in leases
        if x.device_uid == device.uid
    ]
    out += [Claim(offset, length, "quarantined") for offset, length in device.quarantined_extents]
    out += [Claim(offset, length, "reserved") for offset, length in device.reserved_extents]
    # A host's reservation: its local leases (above) are drawn over it.
    out += [
        Claim(x.offset_bytes, x.length_bytes, "delegated", x.host, state=x.state)
        for x in device.delegations
    ]
    return out


def build(device: DeviceStatus, leases: Sequence[LeaseOut], width: int) -> DeviceMap:
    spans = layout(device.capacity_bytes, claims_of(device, leases))
    return DeviceMap(
        device, spans, cells(spans, device.capacity_bytes, width), fragmentation(spans)
    )


class Legend:
    """Tenant -> (letter, colour), fixed for one invocation: tenants sorted by name."""

    def __init__(self, tenants: Sequence[str]) -> None:
        ordered = sorted(set(tenants))
        self.letter = {
            t: TENANT_LETTERS[i] if i < len(TENANT_LETTERS) else "*" for i, t in enumerate(ordered)
        }
        self.colour = {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(ordered)}
        self.tenants = ordered

    def plain(self, cell: Cell) -> str:
        if cell.kind == "leased" and cell.tenant is not None:
            letter = self.letter.get(cell.tenant, "*")
            return letter.lower() if cell.mixed else letter
        glyphs = {"reserved": RESERVED, "quarantined": QUARANTINED, "delegated": DELEGATED}.get(
            cell.kind, FREE
        )
        return glyphs[cell.mixed]

    def styled(self, cell: Cell) -> tuple[str, str]:
        if cell.kind == "leased" and cell.tenant is not None:
            return TERMINAL_LEASED[cell.mixed], self.colour.get(cell.tenant, "white")
        if cell.kind == "reserved":
            return TERMINAL_RESERVED[cell.mixed], RESERVED_STYLE
        if cell.kind == "quarantined":
            return TERMINAL_QUARANTINED[cell.mixed], QUARANTINED_STYLE
        if cell.kind == "delegated":
            return TERMINAL_DELEGATED[cell.mixed], DELEGATED_STYLE
        return TERMINAL_FREE[cell.mixed], FREE_STYLE


def strip_text(m: DeviceMap, legend: Legend, *, colour: bool) -> Text:
    """The one-line strip between bars: styled blocks, or plain letters."""
    text = Text("|")
    for cell in m.cells:
        if colour:
            glyph, style = legend.styled(cell)
            text.append(glyph, style=style)
        else:
            text.append(legend.plain(cell))
    text.append("|")
    return text


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def heading(m: DeviceMap) -> str:
    d = m.device
    cell = format_size(d.capacity_bytes // len(m.cells)) if m.cells else "-"
    return (
        f"{d.uid} (id {d.id}, {d.kind}, {d.media}, {d.state}): {format_size(d.capacity_bytes)}, "
        f"{len(m.cells)} cells of ~{cell}"
    )


def figures(m: DeviceMap) -> str:
    """Leased, reserved (quarantined, if any) and free bytes, and how the free bytes lie."""
    held = bytes_by_kind(m.spans)
    leases = len({s.lease_id for s in m.spans if s.kind == "leased"})
    f = m.frag
    quarantined = f", quarantined {format_size(held['quarantined'])}" if held["quarantined"] else ""
    delegated = (
        f", delegated (unleased) {format_size(held['delegated'])}" if held["delegated"] else ""
    )
    return (
        f"leased {format_size(held['leased'])} in {leases} lease(s), reserved "
        f"{format_size(held['reserved'])}{quarantined}{delegated}, "
        f"free {format_size(f.free_bytes)} in "
        f"{f.free_extents} extent(s); largest free extent {format_size(f.largest_free_bytes)} "
        f"({_pct(f.largest_free_ratio)} of free); largest lease that fits "
        f"{format_size(m.device.largest_free_bytes)}"
    )


def legend_text(legend: Legend, *, colour: bool, totals: dict[str, int]) -> Text:
    """Which glyph is which tenant (with its bytes on the devices shown), reserved,
    quarantined, free."""
    text = Text("legend: ")
    for t in legend.tenants:
        if colour:
            text.append(TERMINAL_LEASED[0], style=legend.colour[t])
        else:
            text.append(legend.letter[t])
        text.append(f" {t} ({format_size(totals.get(t, 0))})  ")
    if colour:
        text.append(TERMINAL_RESERVED[0], style=RESERVED_STYLE)
        text.append(" reserved  ")
        text.append(TERMINAL_QUARANTINED[0], style=QUARANTINED_STYLE)
        text.append(" quarantined  ")
        text.append(TERMINAL_FREE[0], style=FREE_STYLE)
        text.append(" free  ")
        text.append(TERMINAL_DELEGATED[0], style=DELEGATED_STYLE)
        text.append(" delegated (reserved for a host's agent, unleased);  ")
        text.append(f"{TERMINAL_LEASED[1]} {TERMINAL_FREE[1]}", style="white")
        text.append(" (a lighter glyph)")
    else:
        text.append(
            f"{RESERVED[0]} reserved  {QUARANTINED[0]} quarantined  {FREE[0]} free  "
            f"{DELEGATED[0]} delegated;  "
            "a lower-case letter, "
        )
        text.append(f"{RESERVED[1]!r}, {QUARANTINED[1]!r}, {DELEGATED[1]!r} or {FREE[1]!r}")
    text.append(": the cell also holds bytes of another kind or tenant")
    return text


def tenant_totals(maps: Sequence[DeviceMap]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for m in maps:
        for s in m.spans:
            if s.kind == "leased" and s.tenant is not None:
                totals[s.tenant] = totals.get(s.tenant, 0) + s.length
    return totals


def as_json(m: DeviceMap) -> dict[str, Any]:
    """The device's extents (offset, length, kind, tenant, lease) and its figures."""
    d = m.device
    held = bytes_by_kind(m.spans)
    return {
        "uid": d.uid,
        "id": d.id,
        "capacity_bytes": d.capacity_bytes,
        "state": d.state,
        "extents": [
            {
                "offset_bytes": s.offset,
                "length_bytes": s.length,
                "kind": s.kind,
                "tenant": s.tenant,
                "lease_id": s.lease_id,
                "state": s.state,
            }
            for s in m.spans
        ],
        "leased_bytes": held["leased"],
        "reserved_bytes": held["reserved"],
        "quarantined_bytes": held["quarantined"],
        "delegated_bytes": held["delegated"],
        "free_bytes": m.frag.free_bytes,
        "free_extents": m.frag.free_extents,
        "largest_free_extent_bytes": m.frag.largest_free_bytes,
        "largest_free_ratio": m.frag.largest_free_ratio,
        # What poold says the largest aligned lease that still fits is.
        "largest_free_bytes": d.largest_free_bytes,
    }
