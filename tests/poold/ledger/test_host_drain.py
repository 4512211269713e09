"""Draining a host with a deadline, on SQLite and PostgreSQL: the reaper revokes at it.

The deadline lives in the `host.drain` event, as a device's lives in `device.drain`;
`now_` revokes at once; undraining cancels it (draining again never postpones it:
tests/poold/ledger/test_draining.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from poold.errors import NoCapacity
from poold.ledger import draining, heartbeat, hosts, lease_views, leases
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Host
from poold.ledger.reaper import ACTOR, Reaper, ReaperPolicy, host_drain_deadlines
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, Heartbeat
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed

POLICY = ReaperPolicy(revoke_deadline_s=20)


def grant(ledger: Ledger, host: str = "h1") -> LeaseOut:
    return leases.grant(
        ledger,
        host,
        GrantRequest(tenant="t1", size_bytes=4 * MiB, uid=UID, pid=42, ttl_s=3600, activate=True),
        "agent:test",
    )


def reaper(ledger: Ledger) -> Reaper:
    return Reaper(ledger, POLICY, started_at=utcnow() - timedelta(days=1))


def last_event(ledger: Ledger, lease_id: str) -> Event:
    with ledger.read() as s:
        event = s.scalars(
            select(Event).where(Event.lease_id == lease_id).order_by(Event.id.desc()).limit(1)
        ).one()
        s.expunge(event)
    return event


def test_reaper_revokes_a_drained_hosts_leases_at_the_deadline(ledger: Ledger) -> None:
    seed(ledger)
    seed(ledger, host="h2", devices=[device("dev-1", local_name="node3")], tenant=None)
    mine = [grant(ledger), grant(ledger)]
    other = grant(ledger, "h2")
    start = utcnow()
    out = draining.drain_host(
        ledger, "h1", "admin", deadline_s=60, now_=False, revoke_deadline_s=20
    )
    assert out.state == "draining" and out.live_leases == 2 and out.revoked == []
    assert out.deadline_at is not None
    assert start + timedelta(seconds=59) < out.deadline_at <= utcnow() + timedelta(seconds=60)
    [(_host_id, name, deadline)] = host_drain_deadlines(ledger)
    assert name == "h1" and deadline == out.deadline_at

    r = reaper(ledger)
    assert r.run_once(now=out.deadline_at - timedelta(seconds=1)).revoked == []
    revoked = r.run_once(now=out.deadline_at + timedelta(seconds=1)).revoked
    assert sorted(revoked) == sorted(x.id for x in mine)
    assert lease_views.show(ledger, other.id).state == "active"  # another host's lease stays
    for lease in mine:
        assert lease_views.show(ledger, lease.id).state == "revoking"
        event = last_event(ledger, lease.id)
        assert (event.kind, event.actor) == ("lease.revoke", ACTOR)
        assert event.reason is not None and "host h1 drained" in event.reason
        assert "deadline_at" in event.detail  # the agent's own revocation deadline
    # The agent learns it from its next heartbeat reply.
    with ledger.write() as s:
        reply = heartbeat.heartbeat(s, hosts.get_by_name(s, "h1"), Heartbeat())
    assert sorted(x.lease_id for x in reply.revocations) == sorted(x.id for x in mine)
    # Nothing is revoked twice.
    assert r.run_once(now=out.deadline_at + timedelta(seconds=2)).revoked == []


def test_drain_now_revokes_at_once(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    out = draining.drain_host(ledger, "h1", "admin", now_=True, revoke_deadline_s=20)
    assert out.revoked == [lease.id] and out.state == "draining"
    event = last_event(ledger, lease.id)
    assert (event.kind, event.actor, event.reason) == ("lease.revoke", "admin", "host h1 drained")
    assert lease_views.show(ledger, lease.id).state == "revoking"


def test_undrain_cancels_the_deadline_and_a_plain_drain_has_none(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    out = draining.drain_host(ledger, "h1", "admin", deadline_s=60)
    assert out.deadline_at is not None
    after: datetime = out.deadline_at + timedelta(seconds=5)
    draining.drain_host(ledger, "h1", "admin", draining=False)
    assert host_drain_deadlines(ledger) == []
    r = reaper(ledger)
    assert r.run_once(now=after).revoked == []
    # Drained again without a deadline: the latest `host.drain` wins, leases run on.
    plain = draining.drain_host(ledger, "h1", "admin")
    assert plain.deadline_at is None and plain.revoked == []
    [(_id, _name, deadline)] = host_drain_deadlines(ledger)
    assert deadline is None
    assert r.run_once(now=after).revoked == []
    assert lease_views.show(ledger, lease.id).state == "active"
    with ledger.read() as s:
        assert s.scalar(select(Host.status)) == "draining"
        kinds = list(
            s.scalars(select(Event.kind).where(Event.host_id.is_not(None)).order_by(Event.id))
        )
    assert kinds[-3:] == ["host.drain", "host.undrain", "host.drain"]


@pytest.mark.parametrize("devices", [[device()], []], ids=["with devices", "without"])
def test_a_draining_host_gets_no_new_lease(ledger: Ledger, devices: list[Any]) -> None:
    # A grant reads the host's status with its devices; one without any, alone.
    seed(ledger, devices=devices)
    draining.drain_host(ledger, "h1", "admin", now_=False, revoke_deadline_s=20)
    with pytest.raises(NoCapacity) as refused:
        grant(ledger)
    assert refused.value.detail["host_status"] == "draining"
