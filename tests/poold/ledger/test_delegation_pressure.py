"""Does pressure ask unused reservations back before any lease, and does a waiting request
get the bytes they free? (SQLite and PostgreSQL.)

Reserved-but-unleased bytes are not free; under pressure a reservation with no lease
inside is recalled (it leaves the host's delegation, and its agent gives it back), a
recalled one counts as coming and is not asked again, and only what reservations cannot
cover is asked of leases. A request waiting for room (admission wait_s) is then placed
in the bytes the reservation gave back.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from poold.errors import NoCapacity
from poold.ledger import delegation, heartbeat, leases, op_batches
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Reservation
from poold.wire.agent import GrantRequest, Heartbeat, LeaseReport
from poold.wire.delegation import BudgetWant, DelegationRequest, ReserveWant
from tests.poold.conftest import UID, MiB, device, local_grant_op, seed


def _grant(size_bytes: int) -> GrantRequest:
    return GrantRequest(tenant="t1", size_bytes=size_bytes, uid=UID, pid=1, ttl_s=60, activate=True)


def _setup(ledger: Ledger) -> tuple[str, str]:
    """A 128 MiB device: a 64 MiB central lease that uses nothing, and a 16 MiB
    reservation of h1 with no lease inside (48 MiB free)."""
    seed(ledger, devices=[device(capacity_bytes=128 * MiB)])
    lease = leases.grant(ledger, "h1", _grant(64 * MiB), "agent:h1")
    d = delegation.delegate(
        ledger,
        "h1",
        DelegationRequest(
            reserve=[ReserveWant(bytes=16 * MiB)],
            budgets=[BudgetWant(tenant="t1", bytes=16 * MiB, leases=4)],
        ),
        "agent:h1",
    )
    [res] = d.reservations
    assert res.length_bytes == 16 * MiB
    report = LeaseReport(lease_id=lease.id, used_bytes=0, exclusive_bytes=0, replica_bytes=0)
    heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(reports=[report]), "agent:h1")
    return lease.id, res.id


def _state(ledger: Ledger, rid: str) -> str | None:
    with ledger.read() as s:
        return s.scalar(select(Reservation.state).where(Reservation.id == rid))


def test_pressure_recalls_unleased_reservations_before_asking_any_lease(ledger: Ledger) -> None:
    lease_id, rid = _setup(ledger)
    # A request for 56 MiB waits: 48 MiB free, the watermark 6.4 MiB: 14.4 MiB short,
    # which the empty reservation covers.
    beat = Heartbeat(admission_wanted_bytes=56 * MiB)
    reply = heartbeat.receive_heartbeat(ledger, "h1", beat, "agent:h1")
    assert reply.shrink == []
    assert reply.delegation is not None and reply.delegation.reservations == []
    assert _state(ledger, rid) == delegation.RECALLED
    with ledger.read() as s:
        kinds = s.execute(select(Event.kind, Event.reason).where(Event.kind.like("reservation.%")))
        assert ("reservation.recall", "pressure: reserved but unleased") in list(kinds)
    # Asked again, it is still coming: no lease is asked meanwhile, nothing recalled twice.
    reply = heartbeat.receive_heartbeat(ledger, "h1", beat, "agent:h1")
    assert reply.shrink == []
    # The central path does not place in a recalled reservation: still no room.
    with pytest.raises(NoCapacity):
        leases.grant(ledger, "h1", _grant(56 * MiB), "agent:h1")
    # The agent gives it back (as it does on seeing it gone); the waiting request fits.
    d = delegation.delegate(ledger, "h1", DelegationRequest(give_back=[rid]), "agent:h1")
    assert d.reservations == []
    assert _state(ledger, rid) is None
    served = leases.grant(ledger, "h1", _grant(56 * MiB), "agent:h1")
    assert served.length_bytes == 56 * MiB
    assert lease_id != served.id
    # Giving back what is gone already is no error (a reply may cross the give-back).
    delegation.delegate(ledger, "h1", DelegationRequest(give_back=[rid]), "agent:h1")


def test_leases_are_asked_only_for_what_reservations_cannot_cover(ledger: Ledger) -> None:
    lease_id, rid = _setup(ledger)
    # 72 MiB wanted: 72 + 6.4 - 48 = 30.4 MiB short; 16 from the reservation first.
    reply = heartbeat.receive_heartbeat(
        ledger, "h1", Heartbeat(admission_wanted_bytes=72 * MiB), "agent:h1"
    )
    assert _state(ledger, rid) == delegation.RECALLED
    [hint] = reply.shrink
    assert hint.lease_id == lease_id
    need = 72 * MiB + -(-128 * MiB * 5 // 100) - 48 * MiB
    assert hint.target_bytes == need - 16 * MiB


def test_a_reservation_with_a_lease_inside_is_not_recalled(ledger: Ledger) -> None:
    lease_id, rid = _setup(ledger)
    d = delegation.delegate(ledger, "h1", DelegationRequest(), "agent:h1")
    op = local_grant_op(d, "L1", 0, epoch=0)
    assert [r.code for r in op_batches.apply_ops(ledger, "h1", [op], "agent:h1")] == [None]
    reply = heartbeat.receive_heartbeat(
        ledger, "h1", Heartbeat(admission_wanted_bytes=56 * MiB), "agent:h1"
    )
    assert _state(ledger, rid) == delegation.HELD
    assert reply.delegation is not None and [r.id for r in reply.delegation.reservations] == [rid]
    assert [h.lease_id for h in reply.shrink] == [lease_id]  # the lease is asked instead
