"""What does a device's byte range hold, drawn as a strip of cells? Pure arithmetic, no I/O.

`layout` turns what occupies a device (leases, ranges the ledger quarantined, ranges
reserved by dax devices poold did not place) into a partition of [0, capacity): sorted
extents that touch end to end, each leased, quarantined, reserved or free. Where claims
overlap (a quarantine may lie under a live lease; leases should not overlap, the audit
reports it), a lease wins over a quarantined range, that over a reserved one and, among
leases, the one starting first (then the one listed first) wins, so every byte is
counted once.

`cells` cuts that partition into at most `width` cells of (nearly) equal size: cell
i covers [i*capacity // n, (i+1)*capacity // n) for n = min(width, capacity) cells,
so the cells cover the device exactly, none is empty, and their lengths differ by at
most one byte. A cell's kind is the kind holding most of its bytes; a tie goes to
leased, then quarantined, then reserved, then free, so that a cell half taken shows as
taken and the strip never hides memory in use (nor memory never to be used again). A
leased cell is drawn for the tenant holding most of its leased bytes (a tie: the tenant
whose bytes come first). `mixed` says the cell holds bytes of more than one kind or
tenant: what the majority rule drew over.

`fragmentation` gives the free bytes, the free extents, the largest one and its share
of the free bytes (1.0: one hole; near 0: free memory in crumbs; None: nothing free).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

# "delegated": reserved for a host whose agent grants inside it (its leases win over it).
Kind = Literal["leased", "quarantined", "reserved", "delegated", "free"]

# Lower wins: where claims overlap, and where a cell's kinds tie.
_RANK: dict[Kind, int] = {"leased": 0, "quarantined": 1, "reserved": 2, "delegated": 3, "free": 4}


@dataclass(frozen=True)
class Claim:
    """Something occupying [offset, offset + length) of a device: a lease, a quarantined
    or a reserved range."""

    offset: int
    length: int
    kind: Literal["leased", "quarantined", "reserved", "delegated"]
    tenant: str | None = None
    lease_id: str | None = None
    state: str | None = None


@dataclass(frozen=True)
class Span:
    """One extent of a device's partition: [offset, offset + length) and what holds it."""

    offset: int
    length: int
    kind: Kind
    tenant: str | None = None
    lease_id: str | None = None
    state: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Cell:
    """One character of the strip: its bytes, the kind (and tenant) drawn, and whether
    it also holds bytes of another kind or tenant."""

    offset: int
    length: int
    kind: Kind
    tenant: str | None
    mixed: bool

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Fragmentation:
    free_bytes: int
    free_extents: int
    largest_free_bytes: int
    largest_free_ratio: float | None  # largest / free; None when nothing is free


def layout(capacity: int, claims: Iterable[Claim]) -> list[Span]:
    """The partition of [0, capacity) into leased, quarantined, reserved and free extents.

    Claims are clipped to the device; adjacent pieces of one lease (or of quarantined,
    reserved or free space) are merged.
    """
    if capacity < 0:
        raise ValueError(f"capacity must not be negative, got {capacity}")
    # (start, end, rank, index, claim) for every claim with bytes inside the device
    clipped: list[tuple[int, int, int, int, Claim]] = []
    for index, claim in enumerate(claims):
        start, end = max(claim.offset, 0), min(claim.offset + claim.length, capacity)
        if start < end:
            clipped.append((start, end, _RANK[claim.kind], index, claim))
    clipped.sort()
    points = sorted({0, capacity, *(c[0] for c in clipped), *(c[1] for c in clipped)})
    # heap: (rank, the claim's own offset, index, clipped end, claim): the winner on top
    active: list[tuple[int, int, int, int, Claim]] = []
    spans: list[Span] = []
    nxt = 0
    for a, b in itertools.pairwise(points):
        while nxt < len(clipped) and clipped[nxt][0] <= a:
            start, end, rank, index, claim = clipped[nxt]
            heapq.heappush(active, (rank, claim.offset, index, end, claim))
            nxt += 1
        while active and active[0][3] <= a:
            heapq.heappop(active)  # ended before this piece (lazy removal)
        if active:
            c = active[0][4]
            piece = Span(a, b - a, c.kind, c.tenant, c.lease_id, c.state)
        else:
            piece = Span(a, b - a, "free")
        last = spans[-1] if spans else None
        if last is not None and _same_holder(last, piece):
            spans[-1] = Span(
                last.offset,
                last.length + piece.length,
                last.kind,
                last.tenant,
                last.lease_id,
                last.state,
            )
        else:
            spans.append(piece)
    return spans


def _same_holder(a: Span, b: Span) -> bool:
    return (a.kind, a.tenant, a.lease_id, a.state) == (b.kind, b.tenant, b.lease_id, b.state)


def cell_bounds(capacity: int, width: int) -> list[tuple[int, int]]:
    """[start, end) of each cell: min(width, capacity) cells covering [0, capacity)."""
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    n = min(width, capacity)
    return [(i * capacity // n, (i + 1) * capacity // n) for i in range(n)]


def cells(spans: Sequence[Span], capacity: int, width: int) -> list[Cell]:
    """The strip: each cell's majority kind (and tenant), by the rule of the docstring.

    `spans` must be a partition of [0, capacity), as `layout` returns.
    """
    out: list[Cell] = []
    j = 0
    for start, end in cell_bounds(capacity, width):
        # bytes per (kind, tenant), in the order they appear in the cell
        held: dict[tuple[Kind, str | None], int] = {}
        while j < len(spans) and spans[j].end <= start:
            j += 1
        k = j
        while k < len(spans) and spans[k].offset < end:
            s = spans[k]
            overlap = min(s.end, end) - max(s.offset, start)
            if overlap > 0:
                key = (s.kind, s.tenant if s.kind == "leased" else None)
                held[key] = held.get(key, 0) + overlap
            k += 1
        by_kind: dict[Kind, int] = {}
        for (kind, _), n in held.items():
            by_kind[kind] = by_kind.get(kind, 0) + n
        kind = min(by_kind, key=lambda kd: (-by_kind[kd], _RANK[kd]))
        tenant = None
        if kind == "leased":
            tenants = [(n, i, t) for i, ((kd, t), n) in enumerate(held.items()) if kd == "leased"]
            tenant = min(tenants, key=lambda x: (-x[0], x[1]))[2]
        out.append(Cell(start, end - start, kind, tenant, mixed=len(held) > 1))
    return out


def fragmentation(spans: Iterable[Span]) -> Fragmentation:
    """How the free bytes lie: how many, in how many extents, the largest and its share."""
    free = [s.length for s in spans if s.kind == "free"]
    total = sum(free)
    largest = max(free, default=0)
    return Fragmentation(
        free_bytes=total,
        free_extents=len(free),
        largest_free_bytes=largest,
        largest_free_ratio=largest / total if total else None,
    )


def bytes_by_kind(spans: Iterable[Span]) -> dict[Kind, int]:
    """Leased, quarantined, reserved and free bytes of a partition (they sum to the capacity)."""
    out: dict[Kind, int] = {
        "leased": 0,
        "quarantined": 0,
        "reserved": 0,
        "delegated": 0,
        "free": 0,
    }
    for s in spans:
        out[s.kind] += s.length
    return out
