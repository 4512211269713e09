"""Draining, on SQLite and PostgreSQL: a repeated drain never postpones the deadline it
set (a cron re-running `drain --deadline-s N` would otherwise never revoke), and an
undrain says how many live leases the target still holds, device and host alike."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from poold.ledger import draining, leases
from poold.ledger.db import Ledger
from poold.ledger.models import Event
from poold.ledger.reaper import drain_deadlines, host_drain_deadlines
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, seed

DEV = "dev-0"


def grant(ledger: Ledger) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=4 * MiB, uid=UID, pid=42, ttl_s=3600, activate=True),
        "agent:test",
    )


def drain_events(ledger: Ledger, kind: str) -> int:
    with ledger.read() as s:
        return int(s.scalar(select(func.count(Event.id)).where(Event.kind == kind)) or 0)


def test_a_repeated_device_drain_keeps_the_earliest_deadline(ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger)
    first = draining.drain_device(
        ledger, DEV, "admin", deadline_s=60, now_=False, revoke_deadline_s=20
    )
    assert first.changed and first.deadline_at is not None
    # The same drain again (a cron), and a longer one: nothing moves.
    for deadline_s in (60, 600):
        again = draining.drain_device(
            ledger, DEV, "admin", deadline_s=deadline_s, now_=False, revoke_deadline_s=20
        )
        assert (again.changed, again.deadline_at, again.revoked) == (False, first.deadline_at, [])
        assert again.live_leases == 1
    assert drain_events(ledger, "device.drain") == 1
    [(_id, _uid, deadline)] = drain_deadlines(ledger)
    assert deadline == first.deadline_at
    # A shorter one brings it forward.
    sooner = draining.drain_device(
        ledger, DEV, "admin", deadline_s=10, now_=False, revoke_deadline_s=20
    )
    assert sooner.changed and sooner.deadline_at is not None
    assert sooner.deadline_at < first.deadline_at
    assert sooner.deadline_at <= utcnow() + timedelta(seconds=10)
    [(_id, _uid, deadline)] = drain_deadlines(ledger)
    assert deadline == sooner.deadline_at
    # --now is the earliest of all: revoked at once.
    now = draining.drain_device(ledger, DEV, "admin", deadline_s=0, now_=True, revoke_deadline_s=20)
    assert now.changed and len(now.revoked) == 1


def test_a_repeated_host_drain_keeps_the_earliest_deadline(ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger)
    plain = draining.drain_host(ledger, "h1", "admin")
    assert plain.changed and plain.deadline_at is None
    first = draining.drain_host(ledger, "h1", "admin", deadline_s=60)
    assert first.changed and first.deadline_at is not None  # no deadline yet: one is set
    for again in (
        draining.drain_host(ledger, "h1", "admin", deadline_s=60),
        draining.drain_host(ledger, "h1", "admin", deadline_s=3600),
        draining.drain_host(ledger, "h1", "admin"),  # no deadline cancels none
    ):
        assert (again.changed, again.deadline_at) == (False, first.deadline_at)
    [(_id, _name, deadline)] = host_drain_deadlines(ledger)
    assert deadline == first.deadline_at
    assert drain_events(ledger, "host.drain") == 2


def test_undrain_counts_live_leases_of_a_device_as_of_a_host(ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger)
    grant(ledger)
    draining.drain_device(ledger, DEV, "admin", deadline_s=60, now_=False, revoke_deadline_s=20)
    out = draining.undrain_device(ledger, DEV, "admin")
    assert (out.state, out.live_leases, out.changed) == ("online", 2, True)
    again = draining.undrain_device(ledger, DEV, "admin")
    assert (again.live_leases, again.changed) == (2, False)
    draining.drain_host(ledger, "h1", "admin")
    assert draining.drain_host(ledger, "h1", "admin", draining=False).live_leases == 2
