"""Where on a device is there room? Pure extent arithmetic, no I/O.

A device is the byte range [0, capacity). Live leases (and quarantined ranges)
occupy extents; everything else is free. Allocation is best-fit over the free
extents, after rounding the request up to the device alignment, because
best-fit keeps large holes whole for the large KV-cache leases that follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Extent(NamedTuple):
    """A half-open byte range [offset, offset + length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, other: Extent) -> bool:
        return self.offset < other.end and other.offset < self.end


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= `value`."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    return (value // alignment) * alignment


def normalise_used(capacity: int, used: Iterable[Extent]) -> list[Extent]:
    """Sort the used extents, merging overlaps and clipping to the device.

    Quarantined ranges may overlap leases, so overlap is legal here; the
    allocator only needs the union of what is not free. Plain ints in the loop:
    it runs for every candidate of every grant, over every lease of a device (on
    PostgreSQL the ledger hands over runs already merged: poold/ledger/granting.py).
    """
    merged: list[Extent] = []
    start = end = -1
    for offset, stop in sorted([(e.offset, e.offset + e.length) for e in used if e.length > 0]):
        if offset < 0:
            offset = 0
        if stop > capacity:
            stop = capacity
        if offset >= stop:
            continue
        if offset <= end:
            if stop > end:
                end = stop
            continue
        if end >= 0:
            merged.append(Extent(start, end - start))
        start, end = offset, stop
    if end >= 0:
        merged.append(Extent(start, end - start))
    return merged


def free_extents(capacity: int, used: Iterable[Extent]) -> list[Extent]:
    """The gaps between used extents, in offset order."""
    free: list[Extent] = []
    cursor = 0
    for offset, length in normalise_used(capacity, used):
        if offset > cursor:
            free.append(Extent(cursor, offset - cursor))
        cursor = offset + length
    if cursor < capacity:
        free.append(Extent(cursor, capacity - cursor))
    return free


def free_bytes(capacity: int, used: Iterable[Extent]) -> int:
    return sum(e.length for e in free_extents(capacity, used))


def best_fit(capacity: int, alignment: int, used: Iterable[Extent], size: int) -> Extent | None:
    """The aligned extent of `size` (rounded up to `alignment`) that wastes least, or None.

    Ties go to the lowest offset so that allocation is deterministic.
    """
    fit = best_fit_in(free_extents(capacity, used), alignment, size)
    return None if fit is None else fit[0]


def best_fit_in(holes: Iterable[Extent], alignment: int, size: int) -> tuple[Extent, int] | None:
    """:func:`best_fit` over holes already computed, with the length of the hole it
    lies in (what placement ranks devices by), or None."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    length = align_up(size, alignment)
    best: tuple[int, int] | None = None  # (hole length, aligned offset)
    for offset, hole_length in holes:
        start = -(-offset // alignment) * alignment
        if start + length > offset + hole_length:
            continue
        if best is None or (hole_length, start) < best:
            best = (hole_length, start)
    if best is None:
        return None
    return Extent(best[1], length), best[0]


def largest_free(capacity: int, alignment: int, used: Iterable[Extent]) -> int:
    """The largest aligned request that would still fit: what `no_capacity` reports."""
    return largest_free_in(free_extents(capacity, used), alignment)


def largest_free_in(holes: Iterable[Extent], alignment: int) -> int:
    """:func:`largest_free` over holes already computed."""
    largest = 0
    for hole in holes:
        start = align_up(hole.offset, alignment)
        usable = align_down(hole.end - start, alignment) if hole.end > start else 0
        largest = max(largest, usable)
    return largest


def whole_fit(
    capacity: int, alignment: int, used: Iterable[Extent], reserved: Iterable[Extent], size: int
) -> Extent | None:
    """The one extent a whole-only device gives (a static dax region, leased only whole):
    all of its usable space, when nothing but ``reserved`` occupies it, that space is one
    aligned hole, and ``size`` rounded up to ``alignment`` is exactly that hole; else None.

    ``used`` is everything occupied (leases, quarantine and ``reserved``): a device with
    any lease or scrub on it has no whole to give.
    """
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    usable = free_extents(capacity, reserved)
    if len(usable) != 1 or free_extents(capacity, used) != usable:
        return None
    hole = usable[0]
    if hole.offset % alignment or hole.length % alignment:
        return None
    return hole if align_up(size, alignment) == hole.length else None


def whole_free(
    capacity: int, alignment: int, used: Iterable[Extent], reserved: Iterable[Extent]
) -> int:
    """What ``no_capacity`` reports for a whole-only device: its usable size while nothing
    is on it (the one size it takes), else 0."""
    usable = free_extents(capacity, reserved)
    if len(usable) != 1 or free_extents(capacity, used) != usable:
        return 0
    hole = usable[0]
    return hole.length if not (hole.offset % alignment or hole.length % alignment) else 0
