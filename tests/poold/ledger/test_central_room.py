"""A tenant whose quota sits in its hosts' unspent budgets is not refused for good.

The bench's tight tenants (a 48 MiB, 3-lease quota split over hosts, leases of 32 MiB)
were refused `quota_exceeded` while holding nothing: each host's share was too small
for the lease, and the central grant found the quota full of unspent budgets. Now such
a refusal says so and keeps that much room out of budgets (poold/ledger/central_room.py);
the hosts hear their smaller share, give it back, and the same grant then succeeds.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from poold.errors import QuotaExceeded
from poold.lease_states import LeaseEvent
from poold.ledger import central_room, delegation, granting, heartbeat, leases
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Tenant
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, Heartbeat
from poold.wire.delegation import BudgetWant, Delegation, DelegationRequest
from tests.poold.conftest import UID, MiB, device, seed

QUOTA = 48 * MiB


def _delegate(ledger: Ledger, host: str, nbytes: int, nleases: int) -> Delegation:
    req = DelegationRequest(budgets=[BudgetWant(tenant="t1", bytes=nbytes, leases=nleases)])
    return delegation.delegate(ledger, host, req, f"agent:{host}")


def _grant(size_bytes: int) -> GrantRequest:
    return GrantRequest(tenant="t1", size_bytes=size_bytes, uid=UID, pid=1, ttl_s=60, activate=True)


def _budgets(ledger: Ledger) -> dict[int, tuple[int, int]]:
    with ledger.write_conn() as conn:
        return dict(granting.quota_use(conn, 1).budgets)


def _room(ledger: Ledger) -> tuple[int, bool]:
    with ledger.read() as s:
        nbytes, until = s.execute(
            select(Tenant.central_room_bytes, Tenant.central_room_until)
        ).one()
    return int(nbytes), until is not None and until > utcnow()


def _share(ledger: Ledger, host: str) -> tuple[int | None, int | None]:
    reply = heartbeat.receive_heartbeat(ledger, host, Heartbeat(), f"agent:{host}")
    assert reply.delegation is not None
    if not reply.delegation.budgets:  # a zero budget is not listed
        return None, None
    [b] = reply.delegation.budgets
    return b.share_bytes, b.share_leases


def _split(ledger: Ledger, quota_bytes: int, quota_leases: int, n: int) -> list[str]:
    """t1's whole quota held as unspent budgets, a fair share on each of n hosts, as
    their agents leave it after hearing their shares (asking for more each time)."""
    hosts = [f"h{i + 1}" for i in range(n)]
    seed(ledger, quota_bytes=quota_bytes, quota_leases=quota_leases)
    for i, host in enumerate(hosts[1:], start=1):
        seed(ledger, host=host, devices=[device(f"dev-{i}")], tenant=None)
    for _ in range(n):
        for host in hosts:
            _delegate(ledger, host, 1 << 40, 1000)
            share = _share(ledger, host)
            if share[0] is not None:
                _delegate(ledger, host, share[0], share[1] or 0)
    return hosts


def test_a_grant_refused_only_for_unspent_budgets_gets_room_and_then_fits(ledger: Ledger) -> None:
    hosts = _split(ledger, 64 * MiB, 8, 4)
    assert _budgets(ledger) == {h: (16 * MiB, 2) for h in (1, 2, 3, 4)}
    # Holding nothing, t1 asks h1 for 24 MiB: h1's own 16 MiB cannot cover it, the
    # others' are unspent. Refused, saying why, and the room is kept.
    tokens = [ledger.news.token(h) for h in (1, 2, 3, 4)]
    with pytest.raises(QuotaExceeded) as refused:
        leases.grant(ledger, "h1", _grant(24 * MiB), "agent:h1")
    assert refused.value.detail.get("held_by_budgets") is True
    assert "retry" in refused.value.message
    assert _room(ledger) == (24 * MiB, True)
    with ledger.read() as s:
        [room] = s.execute(select(Event.detail).where(Event.kind == "budget.room")).scalars()
    assert (room["room_bytes"], room["hosts_told"]) == (24 * MiB, 4)
    if ledger.engine.dialect.name == "sqlite":  # PostgreSQL: NOTIFY, heard by a listener
        # Every host of the tenant is told at once, so its agent hears its share now.
        assert all(ledger.news.token(h) != t for h, t in zip((1, 2, 3, 4), tokens, strict=True))
    # Refused again before the hosts give back: the room stands, nothing is written.
    with ledger.read() as s:
        until = s.execute(select(Tenant.central_room_until)).scalar_one()
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h2", _grant(24 * MiB), "agent:h2")
    with ledger.read() as s:
        assert s.execute(select(Tenant.central_room_until)).scalar_one() == until
        kinds = s.execute(select(Event.kind).where(Event.kind == "budget.room")).scalars()
        assert len(list(kinds)) == 1
    # Each host hears a share of what the room leaves (40 MiB and 7 leases over four,
    # rounded down: the shares leave the room whole) and asks no more; a host asking for
    # more is held to it.
    for host in hosts:
        assert _share(ledger, host) == (10 * MiB, 1)
        _delegate(ledger, host, 10 * MiB, 1)
    assert _delegate(ledger, "h1", 1 << 40, 1000).budgets[0].bytes == 10 * MiB
    assert _budgets(ledger) == {h: (10 * MiB, 1) for h in (1, 2, 3, 4)}
    # The same grant now fits beside the budgets, and never past the quota.
    lease = leases.grant(ledger, "h1", _grant(24 * MiB), "agent:h1")
    assert lease.reservation_id is None and lease.length_bytes == 24 * MiB
    with ledger.write_conn() as conn:
        use = granting.quota_use(conn, 1)
    assert use.bytes() <= 64 * MiB and use.leases() <= 8


def test_a_room_past_half_the_quota_keeps_the_whole_quota_central(ledger: Ledger) -> None:
    _split(ledger, QUOTA, 3, 2)
    assert _budgets(ledger) == {1: (24 * MiB, 2), 2: (24 * MiB, 1)}
    with pytest.raises(QuotaExceeded) as refused:
        leases.grant(ledger, "h2", _grant(32 * MiB), "agent:h2")
    assert refused.value.detail.get("held_by_budgets") is True
    # What budgets could still hold (16 MiB) is smaller than the tenant's leases: its
    # whole quota goes central. The hosts give theirs back; asking again gets none.
    for host in ("h1", "h2"):
        assert _share(ledger, host) == (0, 0)
        _delegate(ledger, host, 0, 0)
    assert _budgets(ledger) == {}
    assert _delegate(ledger, "h1", 1 << 40, 1000).budgets == []
    lease = leases.grant(ledger, "h2", _grant(32 * MiB), "agent:h2")
    assert lease.length_bytes == 32 * MiB
    leases.grant(ledger, "h1", _grant(16 * MiB), "agent:h1")
    with pytest.raises(QuotaExceeded) as full:  # now for what it holds: no room kept
        leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
    assert "held_by_budgets" not in full.value.detail


def test_a_refusal_for_what_the_tenant_holds_keeps_no_room(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=QUOTA, quota_leases=3)
    leases.grant(ledger, "h1", _grant(32 * MiB), "agent:h1")
    with pytest.raises(QuotaExceeded) as refused:
        leases.grant(ledger, "h1", _grant(32 * MiB), "agent:h1")
    assert "held_by_budgets" not in refused.value.detail
    assert _room(ledger) == (0, False)
    # Nor does a lease larger than the whole quota (refused wherever it goes).
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h1", _grant(64 * MiB), "agent:h1")
    assert _room(ledger) == (0, False)


def test_a_lapsed_room_lets_budgets_grow_again_and_a_grant_its_size_renews_it(
    ledger: Ledger,
) -> None:
    hosts = _split(ledger, 64 * MiB, 8, 4)
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h1", _grant(24 * MiB), "agent:h1")
    for host in hosts:
        _delegate(ledger, host, 10 * MiB, 1)
    # Past half its time, a central grant of its size renews it ...
    half_gone = utcnow() + timedelta(seconds=central_room.ROOM_S / 2 - 5)
    with ledger.write_conn() as conn:
        conn.execute(update(Tenant).values(central_room_until=half_gone))
    lease = leases.grant(ledger, "h1", _grant(24 * MiB), "agent:h1")
    with ledger.read() as s:
        until = s.execute(select(Tenant.central_room_until)).scalar_one()
    assert until > half_gone + timedelta(seconds=60)
    leases.end(ledger, lease.id, LeaseEvent.RELEASE, "test")
    # ... and once it has lapsed, budgets are sized from the whole quota again.
    with ledger.write_conn() as conn:
        conn.execute(update(Tenant).values(central_room_until=utcnow() - timedelta(seconds=1)))
    assert _delegate(ledger, "h1", 1 << 40, 1000).budgets[0].bytes == 16 * MiB
    assert _share(ledger, "h1") == (None, None)


def test_blocked_by_budgets_counts_what_hosts_leased_and_what_the_agent_reports() -> None:
    use = QuotaUse(
        central_bytes=8 * MiB,
        central_leases=1,
        local={1: (8 * MiB, 1)},
        budgets={1: (16 * MiB, 2), 2: (24 * MiB, 1)},
    )
    # Leased: 16 MiB, 2 leases of 48 MiB, 4: a 32 MiB grant fits but for the budgets.
    assert central_room.blocked_by_budgets(use, QUOTA, 4, 32 * MiB, 2)
    # Not when it would not fit the leases alone.
    assert not central_room.blocked_by_budgets(use, QUOTA, 4, 40 * MiB, 2)
    assert not central_room.blocked_by_budgets(use, QUOTA, 2, 2 * MiB, 2)
    # The asking host's own report of local grants poold has not heard of counts.
    assert not central_room.blocked_by_budgets(use, QUOTA, 4, 32 * MiB, 1, (16 * MiB, 2))


@pytest.mark.parametrize(
    ("quota_leases", "why"),
    [(3, "three hosts' shares of the two leases left were three"), (100, "bytes, rounded up")],
)
def test_a_host_without_a_budget_gets_the_room_once_the_shares_are_given_back(
    ledger: Ledger, quota_leases: int, why: str
) -> None:
    """Rounded up, the shares of what the room leaves added up to more than it: nobody
    gave back, and a host with no budget was refused for as long as it asked."""
    hosts = _split(ledger, 96 * MiB, quota_leases, 3)
    seed(ledger, host="h4", devices=[device("dev-9")], tenant=None)
    with pytest.raises(QuotaExceeded) as refused:
        leases.grant(ledger, "h4", _grant(8 * MiB), "agent:h4")
    assert refused.value.detail.get("held_by_budgets") is True, why
    for host in hosts:
        share = _share(ledger, host)
        if share[0] is not None:
            _delegate(ledger, host, share[0], share[1] or 0)
    lease = leases.grant(ledger, "h4", _grant(8 * MiB), "agent:h4")
    assert lease.length_bytes == 8 * MiB, why


def test_a_note_moves_the_generation_and_keeps_the_larger_room(ledger: Ledger) -> None:
    """A delegate call that read the tenant before the note reruns (its swap fails) and
    sizes budgets with the room; a smaller note never shrinks a running room."""
    seed(ledger, quota_bytes=1 << 30, quota_leases=100)
    with ledger.read() as s:
        before = s.execute(select(Tenant.generation)).scalar_one()
    central_room.note(ledger, 1, 64 * MiB, "test")
    central_room.note(ledger, 1, 8 * MiB, "test")
    with ledger.read() as s:
        after = s.execute(select(Tenant.generation)).scalar_one()
    assert after > before
    assert _room(ledger) == (64 * MiB, True)


def test_a_room_grows_by_doubling_and_never_past_the_quota() -> None:
    assert central_room.grown(0, 6 * MiB, QUOTA) == 6 * MiB
    assert central_room.grown(6 * MiB, 4 * MiB, QUOTA) == 6 * MiB
    assert central_room.grown(6 * MiB, 8 * MiB, QUOTA) == 12 * MiB  # not 8: fewer tells
    assert central_room.grown(6 * MiB, 20 * MiB, QUOTA) == 20 * MiB
    assert central_room.grown(32 * MiB, 40 * MiB, QUOTA) == QUOTA
