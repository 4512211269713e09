"""Where should a lease go? Pure placement over the devices a host reaches.

Order of preference (DESIGN.md, isolation issue): media the tenant allows and
the request asks for; healthy devices that take new leases; the lowest
latency tier from the requesting host; then best fit. Emulated memory is
never chosen on a host that has real far memory unless asked for by name:
a tenant would silently get ordinary DRAM while paying for far memory.

A whole-only device (a static dax region, which its agent can only lease whole) is a
candidate only for a request of exactly its usable size, and only while nothing is on
it: a smaller lease placed there would be granted, then fail in the agent and be
aborted, where another device (or ``no_capacity``) is the right answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from poold import extents
from poold.extents import Extent

EMULATED = "emulated"


@dataclass(frozen=True)
class Candidate:
    """A device as seen from the requesting host, with what already occupies it."""

    device_id: int
    kind: str
    media: str
    state: str
    health: str
    capacity_bytes: int
    alignment_bytes: int
    used: tuple[Extent, ...] = ()
    read_latency_ns: int | None = None
    distance: int | None = None
    generation: int = 0
    whole_only: bool = False
    # The part of ``used`` that is held by dax devices poold did not place: never free,
    # and not part of the device's usable size either (what a whole-only device gives).
    reserved: tuple[Extent, ...] = ()
    # The gaps between ``used``, when the caller keeps them already (the agent's local
    # grants: agent/local_leases.py): then ``used`` is not read. Not for a whole-only device.
    free: Sequence[Extent] | None = None


@dataclass(frozen=True)
class Request:
    size_bytes: int
    media: str | None = None  # an explicit media class asked for, or None for any
    allowed_media: frozenset[str] = field(default_factory=frozenset)  # empty = any


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    extent: Extent


@dataclass(frozen=True)
class Refusal:
    """Why nothing fits: enough to tell the tenant what is free and where."""

    reason: str
    largest_free_bytes: int
    free_by_device: dict[int, int]


def _latency_key(c: Candidate) -> tuple[int, int]:
    # HMAT latency when the kernel reports it; NUMA distance otherwise; unknown last.
    latency = c.read_latency_ns if c.read_latency_ns is not None else 1 << 30
    distance = c.distance if c.distance is not None else 1 << 30
    return (latency, distance)


def eligible(req: Request, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The devices this request may use at all (media, state, health)."""
    has_real = any(c.media != EMULATED and c.kind != EMULATED for c in candidates)
    out = []
    for c in candidates:
        if req.media is not None and c.media != req.media:
            continue
        if req.allowed_media and c.media not in req.allowed_media:
            continue
        if req.media is None and has_real and (c.media == EMULATED or c.kind == EMULATED):
            continue
        if c.state != "online" or c.health in ("critical",):
            continue
        out.append(c)
    return out


def place(req: Request, candidates: Sequence[Candidate]) -> Choice | Refusal:
    """Pick the device and extent for `req`, or say why none fits."""
    usable = eligible(req, candidates)
    if not usable:
        return Refusal("no device matches the requested media or is online", 0, {})
    # Healthy before warning, then latency tier, then best fit inside the tier.
    ranked = sorted(
        usable, key=lambda c: (c.health != "ok" and c.health != "unknown", _latency_key(c))
    )
    best: tuple[tuple[bool, tuple[int, int], int, int], Choice] | None = None
    for c in ranked:
        fit = _fit(c, req.size_bytes)
        if fit is None:
            continue
        ext, hole = fit
        key = (c.health not in ("ok", "unknown"), _latency_key(c), hole, c.device_id)
        if best is None or key < best[0]:
            best = (key, Choice(c, ext))
    if best is not None:
        return best[1]
    free = {c.device_id: _largest(c) for c in usable}
    reason = "no device has a free extent that large"
    whole = sorted({free[c.device_id] for c in usable if c.whole_only and free[c.device_id]})
    if whole:
        reason += f" (whole-only devices take exactly {', '.join(map(str, whole))} bytes)"
    return Refusal(reason, max(free.values(), default=0), free)


def _fit(c: Candidate, size_bytes: int) -> tuple[Extent, int] | None:
    """The extent ``c`` would give, and the length of the hole it is cut from."""
    if c.whole_only:
        ext = extents.whole_fit(c.capacity_bytes, c.alignment_bytes, c.used, c.reserved, size_bytes)
        return None if ext is None else (ext, _hole_size(c, ext))
    holes = c.free if c.free is not None else extents.free_extents(c.capacity_bytes, c.used)
    return extents.best_fit_in(holes, c.alignment_bytes, size_bytes)


def _largest(c: Candidate) -> int:
    if c.whole_only:
        return extents.whole_free(c.capacity_bytes, c.alignment_bytes, c.used, c.reserved)
    if c.free is not None:
        return extents.largest_free_in(c.free, c.alignment_bytes)
    return extents.largest_free(c.capacity_bytes, c.alignment_bytes, c.used)


def _hole_size(c: Candidate, ext: Extent) -> int:
    for hole in extents.free_extents(c.capacity_bytes, c.used):
        if hole.offset <= ext.offset and ext.end <= hole.end:
            return hole.length
    return c.capacity_bytes
