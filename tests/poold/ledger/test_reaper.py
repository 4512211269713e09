"""The reaper, revoke and drain against the real ledger, on SQLite and PostgreSQL.

Clocks are moved by passing `now` to a pass and by writing a host's last
heartbeat, so each test says exactly when a lease ends instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from poold.errors import InvalidTransition, NoCapacity
from poold.lease_states import LeaseEvent, LeaseState
from poold.ledger import (
    admin_ops,
    draining,
    heartbeat,
    hosts,
    lease_views,
    leases,
    op_batches,
    transitions,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Event, Host, Lease
from poold.ledger.reaper import (
    ACTOR,
    Reaper,
    ReaperPolicy,
    ReaperThread,
    host_contact,
    may_expire,
)
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, Heartbeat, Renewal
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed

POLICY = ReaperPolicy(
    activation_deadline_s=30,
    expiry_grace_s=30,
    revoke_deadline_s=20,
    host_down_after_s=60,
    host_silent_after_s=10,
    host_silent_grace_s=300,
)
LONG_AGO = utcnow() - timedelta(days=1)


def grant(
    ledger: Ledger, size: int = 4 * MiB, *, activate: bool = True, ttl_s: int = 60
) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=size, uid=UID, pid=42, ttl_s=ttl_s, activate=activate),
        "agent:test",
    )


def heard(ledger: Ledger, at: datetime, host: str = "h1") -> None:
    with ledger.write() as s:
        s.execute(update(Host).where(Host.name == host).values(last_heartbeat_at=at, status="up"))


def state(ledger: Ledger, lease_id: str) -> str:
    with ledger.read() as s:
        return str(s.scalar(select(Lease.state).where(Lease.id == lease_id)))


def events_of(ledger: Ledger, lease_id: str) -> list[tuple[str, str | None, str, str | None]]:
    with ledger.read() as s:
        rows = s.execute(
            select(Event.kind, Event.to_state, Event.actor, Event.reason)
            .where(Event.lease_id == lease_id)
            .order_by(Event.id)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


def reaper(ledger: Ledger, **kw: Any) -> Reaper:
    kw.setdefault("started_at", LONG_AGO)
    return Reaper(ledger, POLICY, **kw)


# --- pure rules -----------------------------------------------------------------


def test_outage_rule_pure() -> None:
    now = utcnow()
    started = now - timedelta(hours=1)
    fresh = host_contact(
        1, "h", now - timedelta(seconds=1), now=now, started_at=started, silent_after_s=10
    )
    assert fresh.in_contact and fresh.silence_s == pytest.approx(1, abs=0.01)
    # Heard before this poold started: not in contact, silence counts from the start.
    restarted = host_contact(
        1,
        "h",
        now - timedelta(hours=2),
        now=now,
        started_at=now - timedelta(seconds=5),
        silent_after_s=10,
    )
    assert not restarted.in_contact and restarted.silence_s == pytest.approx(5, abs=0.01)
    lapsed = now - timedelta(seconds=3)
    assert may_expire(now + timedelta(seconds=1), fresh, now=now, silent_grace_s=300) is None
    assert may_expire(lapsed, fresh, now=now, silent_grace_s=300) == "ttl passed without renewal"
    assert may_expire(lapsed, restarted, now=now, silent_grace_s=300) is None
    assert "silent" in (may_expire(lapsed, restarted, now=now, silent_grace_s=5) or "")


# --- expiry and reclamation -----------------------------------------------------


def test_lease_expires_on_time_and_is_reclaimed_after_grace(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, ttl_s=5)
    r = reaper(ledger)
    at = lease.expires_at
    heard(ledger, at + timedelta(seconds=1))  # the agent beat after the expiry, no renewal
    assert r.run_once(now=at - timedelta(milliseconds=1)).expired == []
    assert state(ledger, lease.id) == "active"
    assert r.run_once(now=at).expired == [lease.id]
    assert state(ledger, lease.id) == "expired"
    # Within the grace it stays expired; at expiry + grace it is reclaimed.
    assert r.run_once(now=at + timedelta(seconds=29.9)).reclaimed == []
    with ledger.read() as s:
        gen_before = s.scalar(select(Device.generation))
    assert r.run_once(now=at + timedelta(seconds=30)).reclaimed == [lease.id]
    assert state(ledger, lease.id) == "reclaimed"
    with ledger.read() as s:
        # Freeing moves no generation (poold/ledger/transitions.py): grants racing it keep theirs.
        assert s.scalar(select(Device.generation)) == gen_before
        assert s.scalar(select(Lease.ended_at).where(Lease.id == lease.id)) is not None
    evs = events_of(ledger, lease.id)
    assert [e[:3] for e in evs[-2:]] == [
        ("lease.expire", "expired", ACTOR),
        ("lease.reclaim", "reclaimed", ACTOR),
    ]
    assert all(e[3] for e in evs[-2:])  # every reaper event says why
    # Nothing more to do: a further pass writes nothing.
    assert r.run_once(now=at + timedelta(seconds=60)).transitions() == 0
    assert len(events_of(ledger, lease.id)) == len(evs)


def test_stale_grant_is_aborted(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, activate=False)
    r = reaper(ledger)
    assert r.run_once(now=lease.granted_at + timedelta(seconds=29)).aborted == []
    assert r.run_once(now=lease.granted_at + timedelta(seconds=30)).aborted == [lease.id]
    assert state(ledger, lease.id) == "aborted"
    assert events_of(ledger, lease.id)[-1][:3] == ("lease.abort", "aborted", ACTOR)


def test_orphan_is_reclaimed_after_grace(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    orphaned_at = utcnow()
    with ledger.write() as s:
        assert transitions.move_if(
            s.connection(),
            lease.id,
            LeaseState.ACTIVE,
            LeaseEvent.ORPHAN,
            actor="agent:h1",
            reason="holder died",
            now=orphaned_at,
        )
    r = reaper(ledger)
    assert r.run_once(now=orphaned_at + timedelta(seconds=29)).reclaimed == []
    assert r.run_once(now=orphaned_at + timedelta(seconds=30)).reclaimed == [lease.id]
    assert state(ledger, lease.id) == "reclaimed"


# --- the outage rule --------------------------------------------------------------


def test_lease_of_unheard_host_is_held_not_expired(ledger: Ledger) -> None:
    """The agent went quiet before the lease lapsed: it may hold renewals, so keep it."""
    seed(ledger)
    lease = grant(ledger, ttl_s=5)
    heard(ledger, lease.expires_at - timedelta(seconds=3))
    r = reaper(ledger)
    now = lease.expires_at + timedelta(seconds=8)  # host silent 11 s > host_silent_after_s
    result = r.run_once(now=now)
    assert result.expired == [] and result.held == 1
    assert state(ledger, lease.id) == "active"
    with ledger.read() as s:
        pushed = s.scalar(select(Lease.expires_at).where(Lease.id == lease.id))
    assert pushed == now + timedelta(seconds=POLICY.host_silent_after_s)
    # Silent past the grace: the host is presumed dead and the lease expires.
    late = now + timedelta(seconds=POLICY.host_silent_grace_s + 20)
    result = r.run_once(now=late)
    assert result.expired == [lease.id]
    # Its expiry lies further back than the grace, so the same pass reclaims it.
    assert result.reclaimed == [lease.id]
    expire = [e for e in events_of(ledger, lease.id) if e[0] == "lease.expire"]
    assert "silent" in (expire[0][3] or "")


def test_poold_restart_does_not_expire_leases(ledger: Ledger) -> None:
    """poold was down 10 min; at start it holds leases so the replayed renewals land."""
    seed(ledger)
    lease = grant(ledger, ttl_s=60)
    with ledger.write() as s:
        s.execute(
            update(Lease)
            .where(Lease.id == lease.id)
            .values(expires_at=utcnow() - timedelta(minutes=9))
        )
    heard(ledger, utcnow() - timedelta(minutes=10))
    started = utcnow()
    r = Reaper(ledger, POLICY, started_at=started)  # what poold does before serving
    result = r.run_once()
    assert result.expired == [] and result.held == 1
    # The agent's first heartbeat after the outage carries the held renewal: it lands.
    with ledger.write() as s:
        host = hosts.get_by_name(s, "h1")
        reply = heartbeat.heartbeat(
            s, host, Heartbeat(renewals=[Renewal(lease_id=lease.id, ttl_s=60)])
        )
    assert reply.renewed[0].code is None
    assert state(ledger, lease.id) == "active"
    assert r.run_once().expired == []
    assert [e[0] for e in events_of(ledger, lease.id)] == ["lease.grant", "lease.activate"]


def test_hosts_without_heartbeat_are_marked_down(ledger: Ledger) -> None:
    seed(ledger)
    now = utcnow()
    heard(ledger, now - timedelta(seconds=61))
    r = reaper(ledger)
    assert r.run_once(now=now).hosts_down == ["h1"]
    assert r.run_once(now=now).hosts_down == []  # once
    with ledger.read() as s:
        assert s.scalar(select(Host.status)) == "down"
        kinds = s.scalars(select(Event.kind).where(Event.kind == "host.down")).all()
    assert kinds == ["host.down"]


def test_concurrent_reapers_write_each_transition_once(ledger: Ledger) -> None:
    seed(ledger, devices=[device(capacity_bytes=256 * MiB)])
    ids = [grant(ledger, 2 * MiB, ttl_s=5).id for _ in range(40)]
    now = utcnow() + timedelta(seconds=10)
    heard(ledger, now)
    results: list[list[str]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        try:
            barrier.wait()
            results.append(reaper(ledger).run_once(now=now).expired)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(x for r in results for x in r) == sorted(ids)  # each expired by one reaper
    with ledger.read() as s:
        expire_events = s.scalars(select(Event.lease_id).where(Event.kind == "lease.expire")).all()
    assert sorted(expire_events) == sorted(ids)


def test_reaper_thread_runs_passes(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, ttl_s=1)
    heard(ledger, utcnow() + timedelta(seconds=2))  # "heard after the expiry"
    thread = ReaperThread(reaper(ledger), interval_s=0.05)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while state(ledger, lease.id) != "expired" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        thread.stop()
    assert state(ledger, lease.id) == "expired"


# --- revoke and drain ---------------------------------------------------------------


def test_revoke_reaches_heartbeat_and_agent_confirmation_reclaims(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    out = admin_ops.revoke_lease(ledger, lease.id, "maintenance", "admin", deadline_s=20)
    assert out.state == "revoking"
    with ledger.write() as s:
        reply = heartbeat.heartbeat(s, hosts.get_by_name(s, "h1"), Heartbeat())
    assert [r.lease_id for r in reply.revocations] == [lease.id]
    # A second revoke is refused with a stable code.
    with pytest.raises(InvalidTransition):
        admin_ops.revoke_lease(ledger, lease.id, "again", "admin", deadline_s=20)
    [res] = admin_ops.confirm_revoked(ledger, "h1", [lease.id], "agent:h1")
    assert res.state == "reclaimed" and res.code is None
    assert [e[:2] for e in events_of(ledger, lease.id)[-2:]] == [
        ("lease.revoke", "revoking"),
        ("lease.reclaim", "reclaimed"),
    ]
    [again] = admin_ops.confirm_revoked(ledger, "h1", [lease.id], "agent:h1")
    assert again.code == "invalid_transition"


def test_unconfirmed_revocation_is_reclaimed_at_deadline(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    before = utcnow()
    admin_ops.revoke_lease(ledger, lease.id, "bad tenant", "admin", deadline_s=20)
    r = reaper(ledger)
    assert r.run_once(now=before + timedelta(seconds=19)).reclaimed == []
    assert r.run_once(now=before + timedelta(seconds=21)).reclaimed == [lease.id]
    assert events_of(ledger, lease.id)[-1][2] == ACTOR


def test_drained_device_gets_no_new_leases_and_revokes_at_deadline(ledger: Ledger) -> None:
    seed(ledger, devices=[device("d0", capacity_bytes=64 * MiB), device("d1", local_name="dax1.0")])
    granted = [grant(ledger) for _ in range(2)]
    start = utcnow()
    drained = granted[0].device_uid
    other = "d1" if drained == "d0" else "d0"
    on_drained = [x for x in granted if x.device_uid == drained]
    out = draining.drain_device(
        ledger, drained, "admin", deadline_s=60, now_=False, revoke_deadline_s=20
    )
    assert out.state == "draining" and out.live_leases == len(on_drained) and out.revoked == []
    for _ in range(3):
        assert grant(ledger).device_uid == other
    r = reaper(ledger)
    assert r.run_once(now=start + timedelta(seconds=59)).revoked == []
    revoked = r.run_once(now=start + timedelta(seconds=61)).revoked
    assert sorted(revoked) == sorted(x.id for x in on_drained)
    assert all(state(ledger, x.id) == "revoking" for x in on_drained)
    on_d0 = on_drained
    assert "drained" in (events_of(ledger, on_d0[0].id)[-1][3] or "")


def test_drain_now_revokes_at_once_and_last_device_refuses(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    out = draining.drain_device(
        ledger, "dev-0", "admin", deadline_s=0, now_=True, revoke_deadline_s=20
    )
    assert out.revoked == [lease.id]
    assert state(ledger, lease.id) == "revoking"
    with pytest.raises(NoCapacity):
        grant(ledger)
    draining.undrain_device(ledger, "dev-0", "admin")
    assert grant(ledger).state == "active"


def test_drained_host_refuses_grants_keeps_leases(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    out = draining.drain_host(ledger, "h1", "admin")
    assert out.state == "draining" and out.live_leases == 1
    with pytest.raises(NoCapacity) as info:
        grant(ledger)
    assert info.value.detail["host_status"] == "draining"
    # A heartbeat does not undo the drain; renewals still work.
    with ledger.write() as s:
        reply = heartbeat.heartbeat(
            s,
            hosts.get_by_name(s, "h1"),
            Heartbeat(renewals=[Renewal(lease_id=lease.id, ttl_s=60)]),
        )
        assert s.scalar(select(Host.status)) == "draining"
    assert reply.renewed[0].code is None
    draining.drain_host(ledger, "h1", "admin", draining=False)
    assert grant(ledger).state == "active"


def test_devdax_ranges_are_scrubbed_before_they_are_free(ledger: Ledger) -> None:
    """devdax reuses the same physical bytes: reclaim goes through scrubbing."""
    from poold.ledger.reaper import reclaim_event
    from poold.wire.agent import LeaseOp

    assert reclaim_event("devdax") is LeaseEvent.RECLAIM_DIRTY
    assert reclaim_event("numa") is LeaseEvent.RECLAIM
    seed(ledger, devices=[device(kind="devdax", local_name="dax_region0")])
    out = grant(ledger, 4 * MiB)
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=out.id, op="release_dirty")], "agent:h1")
    with ledger.write() as s:
        reply = heartbeat.heartbeat(s, hosts.get_by_name(s, "h1"), Heartbeat())
    (order,) = reply.scrub
    assert (order.lease_id, order.offset_bytes, order.length_bytes) == (out.id, 0, 4 * MiB)
    # Still taken: a second grant cannot land on the dirty range.
    again = grant(ledger, 4 * MiB)
    assert again.offset_bytes != 0
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=out.id, op="scrubbed")], "agent:h1")
    assert lease_views.show(ledger, out.id).state == "reclaimed"
