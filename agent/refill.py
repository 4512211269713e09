"""How much delegated capacity should this host ask poold for, or give back?

The refill and give-back policy of agent/delegation.py, as plain values in and plain
values out: recent demand (an EWMA of bytes and leases granted per interval, per tenant
and media class) sizes the headroom the agent keeps reserved and budgeted; below a low
watermark it asks for more, above a high one it gives back. Which reservations and
budgets are held, and the caps and debits on them, are :class:`DelegatedCapacity`'s;
asking poold is :class:`agent.local_grants.LocalGrants`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RefillPolicy:
    """How much the agent asks to hold: headroom for ``horizon_intervals`` of recent
    demand (an EWMA of bytes and leases granted per interval), at least ``min_*``, at most
    ``max_reserve_bytes``; below half of that it asks for more, above twice it gives back."""

    min_reserve_bytes: int = 64 << 20
    max_reserve_bytes: int = 4 << 30
    min_budget_leases: int = 16
    horizon_intervals: float = 4.0
    alpha: float = 0.3
    low_fraction: float = 0.5
    high_factor: float = 2.0
    # A tenant with no lease here for this long gives its budget back (asks 0).
    idle_budget_s: float = 600.0
    # A larger budget poold answered by leaving the budget as it was (the tenant's quota
    # or fair share holds it) is not asked again for this long: the tenant's leases go
    # central meanwhile, and every ask costs poold a delegation transaction.
    unmoved_hold_s: float = 5.0

    def headroom_bytes(self, rate: float) -> int:
        """Bytes to keep ahead of a demand of ``rate`` bytes per interval."""
        return int(
            min(self.max_reserve_bytes, max(self.min_reserve_bytes, rate * self.horizon_intervals))
        )

    def headroom_leases(self, rate: float) -> int:
        """Leases to keep ahead of a demand of ``rate`` leases per interval."""
        return int(max(self.min_budget_leases, rate * self.horizon_intervals))


@dataclass
class Demand:
    """What was granted on this host lately (local and central), per tenant and media."""

    bytes_now: dict[tuple[str, str], int] = field(default_factory=dict)
    leases_now: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes_ewma: dict[tuple[str, str], float] = field(default_factory=dict)
    leases_ewma: dict[tuple[str, str], float] = field(default_factory=dict)

    def note(self, tenant: str, media: str, length_bytes: int) -> None:
        """One lease of ``length_bytes`` granted in this interval."""
        key = (tenant, media)
        self.bytes_now[key] = self.bytes_now.get(key, 0) + length_bytes
        self.leases_now[key] = self.leases_now.get(key, 0) + 1

    def close_interval(
        self, alpha: float
    ) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
        """Fold this interval into the EWMAs and start the next; returns the rates per
        media (bytes) and per tenant (bytes, leases)."""
        keys = set(self.bytes_ewma) | set(self.bytes_now)
        for key in keys:
            self.bytes_ewma[key] = alpha * self.bytes_now.get(key, 0) + (1 - alpha) * (
                self.bytes_ewma.get(key, 0.0)
            )
            self.leases_ewma[key] = alpha * self.leases_now.get(key, 0) + (1 - alpha) * (
                self.leases_ewma.get(key, 0.0)
            )
        self.bytes_now.clear()
        self.leases_now.clear()
        by_media: dict[str, float] = {}
        by_tenant: dict[str, tuple[float, float]] = {}
        for (tenant, media), rate in self.bytes_ewma.items():
            by_media[media] = by_media.get(media, 0.0) + rate
            b, n = by_tenant.get(tenant, (0.0, 0.0))
            by_tenant[tenant] = (b + rate, n + self.leases_ewma.get((tenant, media), 0.0))
        return by_media, by_tenant

    def forget(self, tenant: str) -> None:
        """The tenant's budget goes back: its next demand starts from nothing."""
        for key in [k for k in self.bytes_ewma if k[0] == tenant]:
            self.bytes_ewma.pop(key, None)
            self.leases_ewma.pop(key, None)


@dataclass(frozen=True)
class HeldReservation:
    """A usable reservation of one media class as the refill sees it."""

    reservation_id: str
    length_bytes: int
    free_bytes: int
    occupied: bool  # some local lease lies in it


def reservation_want(
    policy: RefillPolicy, rate: float, held: Sequence[HeldReservation]
) -> tuple[int | None, list[str]]:
    """For one media class with demand ``rate``: bytes to reserve more (None: none) and the
    reservations to give back (whole ones no local lease lies in, smallest first, while
    the free bytes left stay at or above the headroom)."""
    target = policy.headroom_bytes(rate)
    free = sum(h.free_bytes for h in held)
    if free < target * policy.low_fraction:
        return target - free, []
    give_back: list[str] = []
    if free > target * policy.high_factor:
        for h in sorted(held, key=lambda h: h.length_bytes):
            if h.occupied or free - h.length_bytes < target:
                continue
            give_back.append(h.reservation_id)
            free -= h.length_bytes
    return None, give_back


def budget_want(
    policy: RefillPolicy,
    rates: tuple[float, float],
    used: tuple[int, int],
    held: tuple[int, int] | None,
    share: tuple[int, int] | None,
    floor: tuple[int, int] = (0, 0),
) -> tuple[int, int] | None:
    """The (bytes, leases) budget to ask for one tenant, or None: what is held will do.

    ``rates``: its demand (bytes, leases per interval); ``used``: what its local leases
    here hold; ``held``: the agent's view of its budget (None: no budget); ``share``:
    poold's fair share of it when other hosts of the tenant want some too; ``floor``:
    never ask less (its local leases poold has yet to hear the end of: their commits,
    queued, must still fit the budget when poold applies them after this ask).
    """
    used_bytes, used_leases = used
    head_bytes = policy.headroom_bytes(rates[0])
    head_leases = policy.headroom_leases(rates[1])
    held_bytes, held_leases = (0, 0) if held is None else held
    free_bytes = held_bytes - used_bytes
    free_leases = held_leases - used_leases
    low = (
        held is None
        or free_bytes < head_bytes * policy.low_fraction
        or free_leases < head_leases * policy.low_fraction
    )
    high = free_bytes > head_bytes * policy.high_factor
    want_bytes, want_leases = used_bytes + head_bytes, used_leases + head_leases
    if share is not None:
        # Other hosts of the tenant want some: ask no more than a fair share (never
        # less than what is granted here).
        share_bytes, share_leases = share
        want_bytes = min(want_bytes, max(used_bytes, share_bytes))
        want_leases = min(want_leases, max(used_leases, share_leases))
        high = high or held_bytes > want_bytes or held_leases > want_leases
    if low or high:
        return max(want_bytes, floor[0]), max(want_leases, floor[1])
    return None


def budget_ask_moves(
    policy: RefillPolicy,
    want: tuple[int, int],
    budget: tuple[int, int],
    last_raise: tuple[float, tuple[int, int]] | None,
    now: float,
) -> bool:
    """Could asking poold for ``want`` change the tenant's ``budget`` (poold's figure,
    (0, 0) without one)? Not when it is that budget: poold keeps a budget asked for what
    it is (poold/ledger/budget_sizing.py). Not for more while poold left the budget as
    it was when last asked for more (``last_raise``: when, and the budget then; the quota
    or a fair share holds it) until ``unmoved_hold_s`` has passed. A smaller ask always
    moves it."""
    if want == budget:
        return False
    if want[0] < budget[0] or want[1] < budget[1]:
        return True
    return not (
        last_raise is not None
        and last_raise[1] == budget
        and now - last_raise[0] < policy.unmoved_hold_s
    )
