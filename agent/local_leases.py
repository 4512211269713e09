"""Which leases has this agent granted alone, and what do they occupy? The table of
local leases, with the two questions every local grant asks of it answered from sums
kept as leases come and go: what occupies a reservation, and what a tenant uses here.

A released local lease stays in the table until poold has applied its release
(agent/delegation.py), so at a few thousand leases a second it holds hundreds; a pass
over all of them per grant was a fifth of the request thread's time. So were the free
extents of a reservation, sorted and merged from those hundreds on every grant: they
are kept too (:meth:`LocalLeases.holes`), cut as a lease is added, and made again only
after leases went (one batch of poold's acknowledgements, not one per grant). Pure and
not thread-safe: :class:`agent.delegation.DelegatedCapacity`'s lock guards it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from poold.extents import Extent, free_extents


@dataclass
class LocalLease:
    """A lease this agent granted inside a reservation: the extent it occupies."""

    lease_id: str
    reservation_id: str
    tenant: str
    offset_bytes: int
    length_bytes: int
    epoch: int
    # poold's last delegation does not list its reservation (flagged, reported).
    stray: bool = False
    # Its release is queued for poold: its budget is spent no more, its extent stays
    # occupied until poold has applied the release (see LocalLeases.release).
    released: bool = False


class LocalLeases:
    """The local leases by id, their extents by reservation, and the sums of both."""

    def __init__(self) -> None:
        self._by_id: dict[str, LocalLease] = {}
        self._in_res: dict[str, dict[str, Extent]] = {}  # reservation -> lease id -> extent
        self._res_used: dict[str, int] = {}  # reservation -> bytes of its leases
        self._use: dict[str, list[int]] = {}  # tenant -> [bytes, leases]
        # tenant -> [bytes, leases] of every lease of it listed, released ones too
        self._listed: dict[str, list[int]] = {}
        # reservation -> (window start, window end, the window's free extents in order)
        self._holes: dict[str, tuple[int, int, list[Extent]]] = {}
        # tenant -> its leases whose release is queued (see release), oldest first
        self._released: dict[str, dict[str, LocalLease]] = {}
        # Reservations a restart restored leases into: only there may leases overlap
        # (a chain of released leases on the same bytes, see taken_only_by_releases).
        self._restored_in: set[str] = set()

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[LocalLease]:
        return iter(self._by_id.values())

    def get(self, lease_id: str) -> LocalLease | None:
        return self._by_id.get(lease_id)

    def add(self, lease: LocalLease, *, restored: bool = False, taking: str | None = None) -> None:
        """Add ``lease`` (one of the same id goes first); ``restored``: from the journal,
        after a restart; ``taking``: a released lease of its tenant whose extent it takes
        (:meth:`taken_only_by_releases`), which stays, its release still to be applied by
        poold, but is taken no more."""
        self.pop(lease.lease_id)
        self._by_id[lease.lease_id] = lease
        rid = lease.reservation_id
        if restored:
            self._restored_in.add(rid)
        self._in_res.setdefault(rid, {})[lease.lease_id] = Extent(
            lease.offset_bytes, lease.length_bytes
        )
        self._res_used[rid] = self._res_used.get(rid, 0) + lease.length_bytes
        for sums in (self._use, self._listed):
            use = sums.setdefault(lease.tenant, [0, 0])
            use[0] += lease.length_bytes
            use[1] += 1
        if taking is not None:
            # Its bytes were occupied already: the kept free extents stand as they are.
            queued = self._released.get(lease.tenant)
            if queued is not None:
                queued.pop(taking, None)
                if not queued:
                    del self._released[lease.tenant]
            return
        self._cut(rid, lease.offset_bytes, lease.length_bytes)

    def _cut(self, rid: str, offset: int, length: int) -> None:
        """Take ``[offset, offset+length)`` out of the reservation's kept free extents;
        forget them when it is not inside one (an adopted lease, an overlap): the next
        :meth:`holes` makes them again from the leases."""
        kept = self._holes.get(rid)
        if kept is None or length <= 0:
            return
        holes = kept[2]
        at = bisect.bisect_right(holes, offset, key=lambda e: e.offset) - 1
        if at < 0 or offset + length > holes[at].offset + holes[at].length:
            del self._holes[rid]
            return
        hole = holes[at]
        pieces = []
        if offset > hole.offset:
            pieces.append(Extent(hole.offset, offset - hole.offset))
        end, hole_end = offset + length, hole.offset + hole.length
        if hole_end > end:
            pieces.append(Extent(end, hole_end - end))
        holes[at : at + 1] = pieces

    def pop(self, lease_id: str) -> LocalLease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is None:
            return None
        rid = lease.reservation_id
        self._holes.pop(rid, None)  # made again when next asked: once per batch of pops
        inside = self._in_res[rid]
        del inside[lease_id]
        self._res_used[rid] -= lease.length_bytes
        if not inside:
            del self._in_res[rid]
            del self._res_used[rid]
            self._restored_in.discard(rid)
        if lease.released:
            queued = self._released.get(lease.tenant)  # not there once its bytes were taken
            if queued is not None:
                queued.pop(lease_id, None)
                if not queued:
                    del self._released[lease.tenant]
        else:
            self._unuse(lease)
        self._unuse(lease, self._listed)
        return lease

    def release(self, lease_id: str) -> None:
        """The lease's release is queued for poold: the tenant's use here no longer counts
        it, its extent still does. A later local grant may spend that budget at once, since
        the outbox sends a tenant's local ops to poold in the order they were queued and
        poold applies a batch's releases before its grants (agent/link.py `_take_ops`,
        poold/ledger/leases.py `apply_ops`). The extent waits for poold: another tenant's
        grant on it would be ordered after nothing."""
        lease = self._by_id.get(lease_id)
        if lease is None or lease.released:
            return
        lease.released = True
        self._released.setdefault(lease.tenant, {})[lease_id] = lease
        self._unuse(lease)

    def _unuse(self, lease: LocalLease, sums: dict[str, list[int]] | None = None) -> None:
        sums = self._use if sums is None else sums
        use = sums[lease.tenant]
        use[0] -= lease.length_bytes
        use[1] -= 1
        if not use[1]:
            del sums[lease.tenant]

    def shrink(self, lease_id: str, length_bytes: int) -> None:
        """The lease's tail given back: it holds at most ``length_bytes`` now."""
        lease = self._by_id.get(lease_id)
        if lease is None or length_bytes >= lease.length_bytes:
            return
        cut = lease.length_bytes - length_bytes
        lease.length_bytes = length_bytes
        self._holes.pop(lease.reservation_id, None)
        self._in_res[lease.reservation_id][lease_id] = Extent(lease.offset_bytes, length_bytes)
        self._res_used[lease.reservation_id] -= cut
        self._listed[lease.tenant][0] -= cut
        if not lease.released:
            self._use[lease.tenant][0] -= cut

    def occupied(self, reservation_id: str) -> list[Extent]:
        """The extents of the reservation local leases occupy."""
        return list(self._in_res.get(reservation_id, {}).values())

    def holes(self, reservation_id: str, start: int, end: int) -> list[Extent]:
        """The free extents of ``[start, end)`` (the reservation on its device) that no
        local lease occupies, in offset order: what ``poold.extents.free_extents`` says
        of the window with everything outside it used. Kept; the caller must not change
        the list."""
        kept = self._holes.get(reservation_id)
        if kept is not None and kept[0] == start and kept[1] == end:
            return kept[2]
        used = [Extent(0, start), *self._in_res.get(reservation_id, {}).values()]
        holes = free_extents(end, used)
        self._holes[reservation_id] = (start, end, holes)
        return holes

    def released_of(self, tenant: str) -> list[LocalLease]:
        """The tenant's leases whose release is queued for poold, their extents still
        occupied here (:meth:`release`) and not taken by another lease yet, oldest
        first."""
        return list(self._released.get(tenant, {}).values())

    def taken_only_by_releases(self, lease: LocalLease) -> bool:
        """Whether every other local lease overlapping ``lease``'s extent is, like it
        should be, its tenant's and released. A lease that takes a released one's bytes
        (``add(taking=)``) makes a chain of them on one extent, each but the last released;
        only the last is offered again (:meth:`released_of`), so outside a reservation a
        restart restored leases into (where the journal gives back every lease of a chain,
        offered again as their releases are queued again) the answer is yes."""
        if lease.reservation_id not in self._restored_in:
            return True
        start, end = lease.offset_bytes, lease.offset_bytes + lease.length_bytes
        for other_id, e in self._in_res.get(lease.reservation_id, {}).items():
            if other_id == lease.lease_id or not (e.offset < end and start < e.offset + e.length):
                continue
            other = self._by_id[other_id]
            if not other.released or other.tenant != lease.tenant:
                return False
        return True

    def used_in(self, reservation_id: str) -> int:
        """Bytes of the reservation local leases occupy."""
        return self._res_used.get(reservation_id, 0)

    def any_in(self, reservation_id: str) -> bool:
        return reservation_id in self._in_res

    def used_by(self, tenant: str) -> tuple[int, int]:
        """(bytes, leases) of the tenant's local leases, those whose release is queued
        left out."""
        use = self._use.get(tenant)
        return (0, 0) if use is None else (use[0], use[1])

    def listed_of(self, tenant: str) -> tuple[int, int]:
        """(bytes, leases) of every listed lease of the tenant, those whose release is
        queued included: at most what poold's local use of it can reach while it applies
        the tenant's queued ops in order, grants and releases alike."""
        use = self._listed.get(tenant)
        return (0, 0) if use is None else (use[0], use[1])
