"""Which leases has this agent granted alone, and what do they occupy? The table of
local leases, with the two questions every local grant asks of it answered from sums
kept as leases come and go: what occupies a reservation, and what a tenant uses here.

A released local lease stays in the table until poold has applied its release
(agent/delegation.py), so at a few thousand leases a second it holds hundreds; a pass
over all of them per grant was a fifth of the request thread's time. Pure and not
thread-safe: :class:`agent.delegation.DelegatedCapacity`'s lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from poold.extents import Extent


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


class LocalLeases:
    """The local leases by id, their extents by reservation, and the sums of both."""

    def __init__(self) -> None:
        self._by_id: dict[str, LocalLease] = {}
        self._in_res: dict[str, dict[str, Extent]] = {}  # reservation -> lease id -> extent
        self._res_used: dict[str, int] = {}  # reservation -> bytes of its leases
        self._use: dict[str, list[int]] = {}  # tenant -> [bytes, leases]

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[LocalLease]:
        return iter(self._by_id.values())

    def get(self, lease_id: str) -> LocalLease | None:
        return self._by_id.get(lease_id)

    def add(self, lease: LocalLease) -> None:
        """Add ``lease`` (one of the same id goes first)."""
        self.pop(lease.lease_id)
        self._by_id[lease.lease_id] = lease
        rid = lease.reservation_id
        self._in_res.setdefault(rid, {})[lease.lease_id] = Extent(
            lease.offset_bytes, lease.length_bytes
        )
        self._res_used[rid] = self._res_used.get(rid, 0) + lease.length_bytes
        use = self._use.setdefault(lease.tenant, [0, 0])
        use[0] += lease.length_bytes
        use[1] += 1

    def pop(self, lease_id: str) -> LocalLease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is None:
            return None
        rid = lease.reservation_id
        inside = self._in_res[rid]
        del inside[lease_id]
        self._res_used[rid] -= lease.length_bytes
        if not inside:
            del self._in_res[rid]
            del self._res_used[rid]
        use = self._use[lease.tenant]
        use[0] -= lease.length_bytes
        use[1] -= 1
        if not use[1]:
            del self._use[lease.tenant]
        return lease

    def shrink(self, lease_id: str, length_bytes: int) -> None:
        """The lease's tail given back: it holds at most ``length_bytes`` now."""
        lease = self._by_id.get(lease_id)
        if lease is None or length_bytes >= lease.length_bytes:
            return
        cut = lease.length_bytes - length_bytes
        lease.length_bytes = length_bytes
        self._in_res[lease.reservation_id][lease_id] = Extent(lease.offset_bytes, length_bytes)
        self._res_used[lease.reservation_id] -= cut
        self._use[lease.tenant][0] -= cut

    def occupied(self, reservation_id: str) -> list[Extent]:
        """The extents of the reservation local leases occupy."""
        return list(self._in_res.get(reservation_id, {}).values())

    def used_in(self, reservation_id: str) -> int:
        """Bytes of the reservation local leases occupy."""
        return self._res_used.get(reservation_id, 0)

    def any_in(self, reservation_id: str) -> bool:
        return reservation_id in self._in_res

    def used_by(self, tenant: str) -> tuple[int, int]:
        """(bytes, leases) of the tenant's local leases."""
        use = self._use.get(tenant)
        return (0, 0) if use is None else (use[0], use[1])
