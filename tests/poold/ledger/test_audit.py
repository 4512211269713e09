"""The reclamation audit on real ledgers (SQLite and PostgreSQL), and its pure checks."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import insert, select, update

from poold.api.client import PooldClient
from poold.ledger import audit, lease_views, leases, op_batches, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import AuditRun, Device, Lease, Quarantine, Tenant
from poold.ledger.reaper import ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.admin import AuditItem
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, seed

POLICY = ReaperPolicy(expiry_grace_s=30, activation_deadline_s=30, revoke_deadline_s=20)


def grant(ledger: Ledger, *, activate: bool = True, ttl_s: int = 60) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(
            tenant="t1", size_bytes=4 * MiB, uid=UID, pid=1, ttl_s=ttl_s, activate=activate
        ),
        "agent:test",
    )


def kinds(items: list[AuditItem]) -> list[str]:
    return sorted(i.kind for i in items)


def test_clean_ledger_exits_zero_and_records_a_run(ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger)
    grant(ledger)
    report = audit.run_audit(ledger, POLICY)
    assert report.exit_code == 0 and report.violations == [] and report.reclaimable == []
    assert (report.leases, report.live_leases, report.devices) == (2, 2, 1)
    assert report.agents.available is False  # no agent has reported its leases
    with ledger.read() as s:
        run = s.scalar(select(AuditRun).where(AuditRun.id == report.run_id))
    assert run is not None and run.exit_code == 0 and run.findings["leases"] == 2


def test_lists_and_reclaims_what_leases_left_behind(ledger: Ledger) -> None:
    seed(ledger)
    expired = grant(ledger)
    stale = grant(ledger, activate=False)
    fresh = grant(ledger)
    past = utcnow() - timedelta(minutes=5)
    with ledger.write() as s:
        s.execute(
            update(Lease).where(Lease.id == expired.id).values(state="expired", expires_at=past)
        )
        s.execute(update(Lease).where(Lease.id == stale.id).values(granted_at=past))
    # The state change above bypassed the journal: add the event it would have written.
    with ledger.write() as s:
        transitions.record(
            s,
            transitions.event_row(
                actor="test",
                kind="lease.expire",
                lease_id=expired.id,
                from_state="active",
                to_state="expired",
            ),
        )
    report = audit.run_audit(ledger, POLICY)
    assert kinds(report.reclaimable) == ["expired", "stale_grant"]
    assert report.exit_code == 1 and report.reclaimed == 0  # reclaimable, not yet reclaimed
    report = audit.run_audit(ledger, POLICY, reclaim_safe=True)
    assert report.exit_code == 1 and report.reclaimed == 2
    assert sorted(i.action or "" for i in report.reclaimable) == ["aborted", "reclaimed"]
    with ledger.read() as s:
        states = dict(s.execute(select(Lease.id, Lease.state)).all())  # type: ignore[arg-type]
    assert states == {expired.id: "reclaimed", stale.id: "aborted", fresh.id: "active"}
    assert audit.run_audit(ledger, POLICY, reclaim_safe=True).exit_code == 0


def test_invariant_violations_need_a_human(ledger: Ledger) -> None:
    seed(ledger, quota_leases=100)
    good = grant(ledger)
    with ledger.read() as s:
        dev = s.scalar(select(Device))
        tenant_id = s.scalar(select(Tenant.id))
    assert dev is not None
    now = utcnow()
    rogue = str(uuid.uuid4())
    with ledger.write() as s:
        # A lease written around the ledger's code: past the device's end, misaligned,
        # and with no events at all.
        s.execute(
            insert(Lease).values(
                id=rogue,
                tenant_id=tenant_id,
                host_id=1,
                device_id=dev.id,
                offset_bytes=dev.capacity_bytes - MiB,
                length_bytes=3 * MiB,
                requested_bytes=3 * MiB,
                state="active",
                ttl_s=60,
                epoch=99,
                granted_at=now,
                expires_at=now + timedelta(seconds=60),
                labels={},
                exclusive_bytes=0,
                replica_bytes=0,
            )
        )
        s.add(
            Quarantine(
                device_id=dev.id,
                offset_bytes=good.offset_bytes,
                length_bytes=MiB,
                reason="poison",
                created_at=now,
            )
        )
        s.execute(update(Tenant).values(quota_bytes=MiB))
    report = audit.run_audit(ledger, POLICY, reclaim_safe=True)
    assert report.exit_code == 2
    assert kinds(report.violations) == [
        "misaligned",
        "no_grant_event",
        "out_of_bounds",
        "over_quota_bytes",
        "quarantined",
        "state_not_journalled",
    ]
    by_kind = {i.kind: i for i in report.violations}
    assert by_kind["quarantined"].lease_id == good.id
    assert by_kind["out_of_bounds"].lease_id == rogue


def test_overlap_is_found(ledger: Ledger) -> None:
    if not ledger.is_sqlite:
        pytest.skip("PostgreSQL's exclusion constraint makes overlapping live leases impossible")
    seed(ledger)
    a = grant(ledger)
    with ledger.read() as s:
        row = s.execute(select(Lease).where(Lease.id == a.id)).scalar_one()
        values = {c.name: getattr(row, c.name) for c in Lease.__table__.columns}
    values["id"] = str(uuid.uuid4())
    with ledger.write() as s:
        s.execute(insert(Lease).values(**values))
    report = audit.run_audit(ledger, POLICY)
    assert "overlap" in kinds(report.violations) and report.exit_code == 2


def test_audit_endpoint(admin: PooldClient, ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger)
    report = admin.audit(reclaim=True)
    assert report.exit_code == 0 and report.leases == 1 and report.run_id is not None


def test_agent_reports_reveal_stale_and_leaked_leases(ledger: Ledger) -> None:
    """The ledger against what the agent says it holds: stale is orphaned, leaked revoked."""
    from datetime import timedelta

    from poold.ledger import heartbeat, hosts
    from poold.wire.agent import Heartbeat, LeaseOp

    seed(ledger)
    kept, lost, ended = grant(ledger), grant(ledger), grant(ledger)
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=ended.id, op="release")], "agent:h1")
    later = utcnow() + timedelta(seconds=10)  # the grants are well before the report
    with ledger.write() as s:
        host = hosts.get_by_name(s, "h1")
        reply = heartbeat.heartbeat(s, host, Heartbeat(held=[kept.id, ended.id]))
        host.agent_leases_at = later
    # The agent still holds memory for a lease the ledger ended: revoked at once.
    assert [r.lease_id for r in reply.revocations] == [ended.id]

    report = audit.run_audit(ledger, POLICY, now=later)
    assert report.agents.available
    assert [i.lease_id for i in report.agents.stale] == [lost.id]
    assert [i.lease_id for i in report.agents.leaked] == [ended.id]
    assert report.exit_code == 1

    fixed = audit.run_audit(ledger, POLICY, reclaim_safe=True, now=later)
    assert fixed.agents.stale[0].action == "orphaned"
    assert lease_views.show(ledger, lost.id).state == "orphaned"
    assert lease_views.show(ledger, kept.id).state == "active"


def test_a_lease_ended_just_before_the_report_is_not_leaked_yet(ledger: Ledger) -> None:
    """The agent's list rides on its heartbeat, its release on an op batch: a list made
    before the release may arrive after it. Within STALE_MARGIN_S that is a report in
    flight, not a leak (as a lease granted just before a report is not stale)."""
    from datetime import timedelta

    from poold.ledger import audit_agents, heartbeat, hosts
    from poold.wire.agent import Heartbeat, LeaseOp

    seed(ledger)
    just = grant(ledger)
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=just.id, op="release")], "agent:h1")
    for offset_s, leaked in ((1.0, []), (audit_agents.STALE_MARGIN_S + 5, [just.id])):
        at = utcnow() + timedelta(seconds=offset_s)
        with ledger.write() as s:
            host = hosts.get_by_name(s, "h1")
            heartbeat.heartbeat(s, host, Heartbeat(held=[just.id]))
            host.agent_leases_at = at
        report = audit.run_audit(ledger, POLICY, now=at)
        assert [i.lease_id for i in report.agents.leaked] == leaked, offset_s
