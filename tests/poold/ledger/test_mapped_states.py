"""Ended memfd leases still mapped stay counted: released_mapped / revoked_mapped in the
ledger (ops, heartbeat, reaper, quota, migration 0009), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from poold.errors import QuotaExceeded
from poold.lease_states import LIVE_STATE_VALUES, LeaseEvent, LeaseState
from poold.ledger import heartbeat, lease_views, leases, migrate, op_batches, transitions
from poold.ledger.db import Ledger, make_engine
from poold.ledger.models import Device, Event, Host, Lease, Tenant
from poold.ledger.reaper import Reaper, ReaperPolicy, reclaim_event_seen
from poold.ledger.types import utcnow
from poold.wire.agent import AgentLease, GrantRequest, Heartbeat, LeaseHolder, LeaseOp
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed
from tests.poold.ledger.test_migration_0002 import NOW, empty_url

__all__ = ["empty_url"]  # the fixture, re-used from the 0002 test

POLICY = ReaperPolicy(expiry_grace_s=30, revoke_deadline_s=20, host_silent_after_s=10)


def grant(ledger: Ledger, size: int = 16 * MiB) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=size, uid=UID, pid=42, ttl_s=60, activate=True),
        "agent:h1",
    )


def op(ledger: Ledger, lease_id: str, name: str) -> str | None:
    (result,) = op_batches.apply_ops(
        ledger, "h1", [LeaseOp.model_validate({"lease_id": lease_id, "op": name})], "agent:h1"
    )
    return result.code or result.state


def state(ledger: Ledger, lease_id: str) -> str:
    return lease_views.show(ledger, lease_id).state


def kinds(ledger: Ledger, lease_id: str) -> list[str]:
    with ledger.read() as s:
        return list(
            s.scalars(select(Event.kind).where(Event.lease_id == lease_id).order_by(Event.id))
        )


def used(ledger: Ledger) -> int:
    """The tenant's live lease bytes, as the quota check counts them."""
    with ledger.read() as s:
        total = s.scalar(
            select(func.coalesce(func.sum(Lease.length_bytes), 0)).where(
                Lease.state.in_(LIVE_STATE_VALUES)
            )
        )
    return int(total or 0)


def beat(ledger: Ledger, *entries: AgentLease) -> list[str]:
    """A detailed heartbeat reporting `entries`; the ids poold revokes in its reply."""
    reply = heartbeat.receive_heartbeat(
        ledger, "h1", Heartbeat(held_leases=list(entries)), "agent:h1"
    )
    return [r.lease_id for r in reply.revocations]


def mapped(lease_id: str, *pids: int) -> AgentLease:
    return AgentLease(
        lease_id=lease_id,
        state="mapped",
        holders=[LeaseHolder(pid=p) for p in pids],
        mapped_since=utcnow(),
    )


# --- the N-times-quota attack, in the ledger ---------------------------------------


def test_released_but_mapped_counts_against_quota_and_device(ledger: Ledger) -> None:
    seed(ledger, devices=[device(capacity_bytes=64 * MiB)], quota_bytes=16 * MiB)
    first = grant(ledger)
    assert op(ledger, first.id, "release_mapped") == "released_mapped"
    assert used(ledger) == 16 * MiB
    with pytest.raises(QuotaExceeded) as refused:
        grant(ledger)
    assert first.id in refused.value.message and "released_mapped" in refused.value.message
    assert refused.value.detail["mapped_leases"] == [
        {"lease_id": first.id, "state": "released_mapped", "length_bytes": 16 * MiB}
    ]
    assert refused.value.detail["mapped_bytes"] == 16 * MiB
    # Its range is still taken on the device: placement goes elsewhere.
    with ledger.write() as s:
        s.execute(update(Tenant).values(quota_bytes=64 * MiB))
    other = grant(ledger)
    assert other.offset_bytes != first.offset_bytes
    # The agent saw the last mapping go: released, its bytes free.
    assert op(ledger, first.id, "unmapped") == "released"
    assert kinds(ledger, first.id)[-2:] == ["lease.release_mapped", "lease.unmapped"]
    assert used(ledger) == 16 * MiB  # only `other`
    assert op(ledger, first.id, "unmapped") == "invalid_transition"  # replay: nothing


def test_release_mapped_after_the_ttl_is_the_reclaim_of_an_expired_lease(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    with ledger.write() as s:
        s.execute(update(Lease).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert op(ledger, lease.id, "release_mapped") == "revoked_mapped"
    assert kinds(ledger, lease.id)[-2:] == ["lease.expire", "lease.reclaim_mapped"]


def test_revoked_then_mapped_then_unmapped(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    with ledger.write() as s:
        transitions.move_if(
            s.connection(),
            lease.id,
            LeaseState.ACTIVE,
            LeaseEvent.REVOKE,
            actor="admin",
            reason="drain",
            now=utcnow(),
        )
    assert op(ledger, lease.id, "reclaim_mapped") == "revoked_mapped"
    assert op(ledger, lease.id, "reclaim_mapped") == "revoked_mapped"  # again: no change
    assert kinds(ledger, lease.id).count("lease.reclaim_mapped") == 1
    assert op(ledger, lease.id, "unmapped") == "reclaimed"
    assert used(ledger) == 0


# --- the heartbeat: what the agent reports settles them ---------------------------------


def test_heartbeat_frees_what_the_agent_no_longer_reports(ledger: Ledger) -> None:
    seed(ledger)
    kept, gone = grant(ledger), grant(ledger)
    for lease in (kept, gone):
        assert op(ledger, lease.id, "release_mapped") == "released_mapped"
    with ledger.read() as s:
        generation = s.scalar(select(Device.generation)) or 0
    assert beat(ledger, mapped(kept.id, 4242)) == []
    assert state(ledger, kept.id) == "released_mapped"
    assert state(ledger, gone.id) == "released"
    with ledger.read() as s:
        assert s.scalar(select(Device.generation)) == generation  # freeing moves none
        actor = s.scalar(
            select(Event.actor).where(Event.lease_id == gone.id, Event.kind == "lease.unmapped")
        )
    assert actor == "agent:h1"
    # An agent that sends only ids (no detailed report) settles nothing.
    heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(held=[]), "agent:h1")
    assert state(ledger, kept.id) == "released_mapped"


def test_ended_while_held_is_revoked_so_the_agent_watches_it(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    with ledger.write() as s:
        s.execute(update(Lease).values(state="revoked_mapped"))
    assert beat(ledger, AgentLease(lease_id=lease.id, state="held")) == [lease.id]
    assert state(ledger, lease.id) == "revoked_mapped"


# --- the reaper: a memfd lease is reclaimed only on the agent's word ---------------------


def _expired_past_grace(ledger: Ledger, lease: LeaseOut) -> None:
    past = utcnow() - timedelta(seconds=60)
    with ledger.write() as s:
        s.execute(
            update(Lease).where(Lease.id == lease.id).values(state="expired", expires_at=past)
        )


def test_reaper_keeps_counting_an_expired_memfd_lease_its_agent_still_holds(
    ledger: Ledger,
) -> None:
    seed(ledger)
    held, dropped = grant(ledger), grant(ledger)
    beat(ledger, AgentLease(lease_id=held.id, state="held"))
    for lease in (held, dropped):
        _expired_past_grace(ledger, lease)
    result = Reaper(ledger, POLICY, started_at=utcnow() - timedelta(hours=1)).run_once()
    assert sorted(result.reclaimed) == sorted([held.id, dropped.id])
    assert state(ledger, held.id) == "revoked_mapped"
    assert state(ledger, dropped.id) == "reclaimed"
    assert kinds(ledger, held.id)[-1] == "lease.reclaim_mapped"
    # The next heartbeat revokes it (the agent then watches its memfd)...
    assert beat(ledger, AgentLease(lease_id=held.id, state="held")) == [held.id]
    # ... and once the agent reports it no more, it is reclaimed.
    beat(ledger)
    assert state(ledger, held.id) == "reclaimed"


def test_orphan_whose_memfd_another_process_maps_is_not_freed(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    assert op(ledger, lease.id, "orphan") == "orphaned"
    beat(ledger, mapped(lease.id, 777))
    later = utcnow() + timedelta(seconds=31)
    Reaper(ledger, POLICY, started_at=utcnow() - timedelta(hours=1)).run_once(now=later)
    assert state(ledger, lease.id) == "revoked_mapped"
    assert used(ledger) == 16 * MiB


def test_reclaim_event_seen_rules() -> None:
    now = utcnow()
    before, after = now - timedelta(seconds=5), now + timedelta(seconds=5)
    report = {"leases": [{"lease_id": "a"}, {"lease_id": "s", "state": "scrubbing"}]}
    rcl, mapped_ = LeaseEvent.RECLAIM, LeaseEvent.RECLAIM_MAPPED
    assert reclaim_event_seen("devdax", "a", now, report, after) is LeaseEvent.RECLAIM_DIRTY
    assert reclaim_event_seen("numa", "a", now, None, None) is rcl  # never reported
    assert reclaim_event_seen("numa", "a", now, ["a"], after) is rcl  # an older agent's ids
    assert reclaim_event_seen("numa", "a", now, report, after) is mapped_  # listed
    assert reclaim_event_seen("emulated", "b", now, report, after) is rcl  # not listed
    assert reclaim_event_seen("emulated", "b", now, report, before) is mapped_  # stale report
    assert reclaim_event_seen("numa", "s", now, report, after) is rcl
    assert reclaim_event_seen("numa", "a", now, {"leases": [{"x": 1}]}, after) is mapped_


# --- migration 0009 ---------------------------------------------------------------------

ROWS = [
    "INSERT INTO hosts (id, name, status, credential_hash, created_at) "
    "VALUES (1, 'h1', 'up', 'x', :now)",
    "INSERT INTO devices (id, uid, kind, media, recycled, capacity_bytes, alignment_bytes, "
    "health, state, generation, created_at, updated_at) "
    "VALUES (1, 'd1', 'numa', 'ddr4', true, 1073741824, 2097152, 'ok', 'online', 0, :now, :now)",
    "INSERT INTO tenants (id, name, quota_bytes, quota_leases, allowed_media, allowed_uids, "
    "allowed_gids, allowed_hosts, generation, created_at) "
    "VALUES (1, 't1', 1073741824, 8, '[]', '[]', '[]', '[]', 0, :now)",
]


def _lease(lease_id: str, state_: str, offset: int) -> str:
    return (
        "INSERT INTO leases (id, tenant_id, host_id, device_id, offset_bytes, length_bytes, "
        "requested_bytes, state, ttl_s, epoch, granted_at, expires_at, labels, exclusive_bytes, "
        f"replica_bytes) VALUES ('{lease_id}', 1, 1, 1, {offset}, 2097152, 2097152, "
        f"'{state_}', 60, 1, :now, :now, '{{}}', 0, 0)"
    )


def test_0009_up_and_down_with_mapped_leases(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0007")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for statement in ROWS:
                conn.execute(text(statement), {"now": NOW})
        migrate.upgrade(empty_url, "0009")
        with engine.begin() as conn:
            conn.execute(text(_lease("rm", "released_mapped", 0)), {"now": NOW})
            conn.execute(text(_lease("vm", "revoked_mapped", 2097152)), {"now": NOW})
        if engine.dialect.name == "postgresql":
            # A mapped lease's range is live for the exclusion constraint.
            with pytest.raises(Exception, match="ex_leases_no_overlap"), engine.begin() as conn:
                conn.execute(text(_lease("over", "active", 0)), {"now": NOW})
        migrate.downgrade(empty_url, "0007")
        with engine.connect() as conn:
            rows: dict[str, str] = {
                str(k): str(v)
                for k, v in conn.execute(text("SELECT id, state FROM leases ORDER BY id"))
            }
            ended = conn.execute(text("SELECT ended_at FROM leases WHERE id = 'rm'")).scalar()
        assert rows == {"rm": "released", "vm": "revoking"}
        assert ended is not None
        migrate.upgrade(empty_url, "0009")
    finally:
        engine.dispose()


def test_models_name_host_columns_the_reaper_reads() -> None:
    # reclaim_events joins hosts for the agent's report: the columns it reads exist.
    assert {"agent_leases", "agent_leases_at"} <= set(Host.__table__.columns.keys())
