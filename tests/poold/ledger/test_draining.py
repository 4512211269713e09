"""Draining, on SQLite and PostgreSQL: an undrain says how many live leases the target
still holds, device and host alike."""

from __future__ import annotations

from sqlalchemy import func, select

from poold.ledger import draining, leases
from poold.ledger.db import Ledger
from poold.ledger.models import Event
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
