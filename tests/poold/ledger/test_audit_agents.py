"""The audit against agents' richer reports, on SQLite and PostgreSQL.

Agents report per lease its holders (pid + start time), sub-device and local state
(scrubs running included), plus leftover sub-devices. The audit lists leftovers of
ended leases (and has them deleted with --reclaim), unfinished scrubs (re-issued
with --reclaim, or needing a human when the agent is down) and holder mismatches.
Older agents' bare lists of ids, and rows stored in that format, still work.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import select, update

from poold.ledger import (
    agent_reports,
    audit,
    audit_agents,
    heartbeat,
    hosts,
    lease_views,
    leases,
    op_batches,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Host
from poold.ledger.reaper import ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.agent import (
    AgentLease,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    LeaseHolder,
    LeaseOp,
    LeftoverSubDevice,
    ScrubProgress,
)
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed

POLICY = ReaperPolicy(expiry_grace_s=30, activation_deadline_s=30, revoke_deadline_s=20)
PID = 4242
STARTED = 1_700_000_000.25


def grant(ledger: Ledger, pid: int = PID) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=4 * MiB, uid=UID, pid=pid, ttl_s=3600, activate=True),
        "agent:test",
    )


def held(lease_id: str, pid: int = PID, sub_device: str | None = "dax0.2") -> AgentLease:
    return AgentLease(
        lease_id=lease_id,
        holders=[LeaseHolder(pid=pid, start_time=STARTED)],
        sub_device=sub_device,
    )


def beat_reply(ledger: Ledger, hb: Heartbeat, at: datetime | None = None) -> HeartbeatReply:
    """One heartbeat; `at` moves the host's clock (heard and reported then)."""
    with ledger.write() as s:
        host = hosts.get_by_name(s, "h1")
        reply = heartbeat.heartbeat(s, host, hb)
        if at is not None:
            host.agent_leases_at = at
            host.last_heartbeat_at = at
    return reply


def beat(ledger: Ledger, hb: Heartbeat, at: datetime | None = None) -> list[str]:
    """One heartbeat (see `beat_reply`); the lease ids its reply revokes."""
    return [r.lease_id for r in beat_reply(ledger, hb, at).revocations]


def devdax(ledger: Ledger) -> None:
    seed(ledger, devices=[device(kind="devdax", local_name="dax_region0")])


def test_new_report_is_stored_whole_and_old_ids_still_work(ledger: Ledger) -> None:
    seed(ledger)
    a, b = grant(ledger), grant(ledger)
    later = utcnow() + timedelta(seconds=10)
    beat(ledger, Heartbeat(held_leases=[held(a.id)]), later)
    with ledger.read() as s:
        stored = s.scalar(select(Host.agent_leases))
    assert isinstance(stored, dict)
    assert stored["leases"] == [
        {"lease_id": a.id, "holders": [{"pid": PID, "start_time": STARTED}], "sub_device": "dax0.2"}
    ]
    report = audit.run_audit(ledger, POLICY, now=later)
    assert [i.lease_id for i in report.agents.stale] == [b.id]
    assert report.agents.holder_mismatches == [] and report.agents.unfinished_scrubs == []

    # An older agent sends ids; an older row holds a list: both read as before.
    beat(ledger, Heartbeat(held=[a.id, b.id]), later)
    with ledger.read() as s:
        assert s.scalar(select(Host.agent_leases)) == [a.id, b.id]
    report = audit.run_audit(ledger, POLICY, now=later)
    assert report.agents.available and report.agents.stale == [] and report.exit_code == 0
    parsed = agent_reports.parse_stored([a.id])
    assert parsed is not None
    found, leftovers, detailed = parsed
    assert list(found) == [a.id] and leftovers == [] and not detailed
    # A row this version cannot read is no report at all (not "holds nothing").
    assert agent_reports.parse_stored({"leases": [{"lease_id": 7}]}) is None
    with ledger.write() as s:
        s.execute(update(Host).values(agent_leases={"leases": [{"lease_id": 7}]}))
    report = audit.run_audit(ledger, POLICY, now=later)
    assert not report.agents.available and report.agents.stale == []


def test_holder_mismatch_is_reported(ledger: Ledger) -> None:
    seed(ledger)
    same, other = grant(ledger), grant(ledger)
    later = utcnow() + timedelta(seconds=10)
    beat(ledger, Heartbeat(held_leases=[held(same.id), held(other.id, pid=999)]), later)
    report = audit.run_audit(ledger, POLICY, now=later)
    [item] = report.agents.holder_mismatches
    assert (item.kind, item.lease_id, item.sub_device) == ("holder_mismatch", other.id, "dax0.2")
    assert f"pid {PID}" in item.message and "pid 999 started 2023-11-14" in item.message
    assert report.exit_code == 1
    # Nothing to reclaim: the audit reports it and leaves both leases alone.
    report = audit.run_audit(ledger, POLICY, reclaim_safe=True, now=later)
    assert report.agents.holder_mismatches[0].action is None
    assert lease_views.show(ledger, other.id).state == "active"


def test_leftover_sub_devices_are_leaked_and_deleted_on_reclaim(ledger: Ledger) -> None:
    devdax(ledger)
    kept, ended, live = grant(ledger), grant(ledger), grant(ledger)
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=ended.id, op="release")], "agent:h1")
    unknown = str(uuid.uuid4())
    leftovers = [
        LeftoverSubDevice(sub_device="dax0.3", region_id=0, size_bytes=4 * MiB, lease_id=ended.id),
        LeftoverSubDevice(sub_device="dax0.4", region_id=0, size_bytes=2 * MiB, lease_id=unknown),
        LeftoverSubDevice(sub_device="dax0.5", region_id=0, size_bytes=4 * MiB, lease_id=live.id),
    ]
    hb = Heartbeat(held_leases=[held(kept.id)], leftovers=leftovers)
    later = utcnow() + timedelta(seconds=10)
    # Reported, but not yet ordered deleted: nothing is revoked for them.
    assert beat(ledger, hb, later) == []

    report = audit.run_audit(ledger, POLICY, now=later)
    by_lease = {i.lease_id: i for i in report.agents.leaked}
    assert set(by_lease) == {ended.id, unknown}
    assert by_lease[ended.id].kind == "leftover_sub_device"
    assert by_lease[ended.id].sub_device == "dax0.3"
    assert "has ended (released)" in by_lease[ended.id].message
    assert "does not know" in by_lease[unknown].message
    [mismatch] = report.agents.holder_mismatches
    assert (mismatch.kind, mismatch.lease_id) == ("leftover_of_live_lease", live.id)
    assert report.exit_code == 1

    fixed = audit.run_audit(ledger, POLICY, reclaim_safe=True, now=later)
    assert {i.lease_id: i.action for i in fixed.agents.leaked} == {
        ended.id: "delete_ordered",
        unknown: "delete_ordered",
    }
    assert fixed.agents.holder_mismatches[0].action is None  # a live lease's: a human's call
    with ledger.read() as s:
        ordered = s.execute(
            select(Event.lease_id, Event.actor, Event.detail).where(
                Event.kind == agent_reports.LEFTOVER_DELETE
            )
        ).all()
    assert sorted((x.lease_id, x.actor, x.detail["sub_device"]) for x in ordered) == sorted(
        [(ended.id, audit.ACTOR, "dax0.3"), (unknown, audit.ACTOR, "dax0.4")]
    )
    # The next heartbeat that still reports them asks the agent to delete them
    # (through the revocation path), never the live lease's.
    assert sorted(beat(ledger, hb, later)) == sorted([ended.id, unknown])
    # Once deleted, the agent reports them no more, and the audit is clean of them.
    beat(ledger, Heartbeat(held_leases=[held(kept.id), held(live.id)]), later)
    report = audit.run_audit(ledger, POLICY, now=later)
    assert report.agents.leaked == [] and report.agents.holder_mismatches == []


def scrubbing_lease(ledger: Ledger) -> tuple[LeaseOut, datetime]:
    """A devdax lease released dirty (now scrubbing), and when it became so."""
    devdax(ledger)
    lease = grant(ledger)
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=lease.id, op="release_dirty")], "agent:h1")
    with ledger.read() as s:
        since = s.scalar(
            select(Event.at).where(Event.lease_id == lease.id).order_by(Event.id.desc())
        )
    assert since is not None and lease_views.show(ledger, lease.id).state == "scrubbing"
    return lease, since


def test_unfinished_scrub_is_reissued_with_reclaim(ledger: Ledger) -> None:
    lease, since = scrubbing_lease(ledger)
    late = since + timedelta(seconds=audit.SCRUB_STUCK_AFTER_S + 30)
    # The agent reports its scrub running: however long, it is not unfinished.
    running = AgentLease(
        lease_id=lease.id, state="scrubbing", scrub=ScrubProgress(started_at=since)
    )
    beat(ledger, Heartbeat(held_leases=[running]), late)
    report = audit.run_audit(ledger, POLICY, now=late)
    assert report.agents.unfinished_scrubs == [] and report.exit_code == 0
    assert [i.kind for i in report.pending] == ["scrubbing"]
    # Not long enough in `scrubbing` yet: not unfinished either.
    early = since + timedelta(seconds=30)
    beat(ledger, Heartbeat(held_leases=[]), early)
    assert audit.run_audit(ledger, POLICY, now=early).agents.unfinished_scrubs == []

    # The agent reports no scrub running (its verdict was lost): unfinished.
    beat(ledger, Heartbeat(held_leases=[]), late)
    report = audit.run_audit(ledger, POLICY, now=late)
    [item] = report.agents.unfinished_scrubs
    assert (item.kind, item.lease_id, item.action) == ("unfinished_scrub", lease.id, None)
    assert report.exit_code == 1
    # Until then the heartbeat's order carries no re-issue.
    [order] = beat_reply(ledger, Heartbeat(held_leases=[]), late).scrub
    assert order.reissued_at is None

    fixed = audit.run_audit(ledger, POLICY, reclaim_safe=True, now=late)
    assert fixed.agents.unfinished_scrubs[0].action == "scrub_reissued"
    [order] = beat_reply(ledger, Heartbeat(held_leases=[]), late).scrub
    assert order.lease_id == lease.id and order.reissued_at is not None
    with ledger.read() as s:
        reissue = s.scalars(select(Event).where(Event.kind == agent_reports.SCRUB_REISSUE)).one()
    assert (reissue.lease_id, reissue.actor) == (lease.id, audit.ACTOR)
    assert order.reissued_at == reissue.at
    # The re-issue restarts the clock: the next audit gives the agent time to act.
    beat(ledger, Heartbeat(held_leases=[]), reissue.at + timedelta(seconds=10))
    after = reissue.at + timedelta(seconds=20)
    assert audit.run_audit(ledger, POLICY, now=after).agents.unfinished_scrubs == []
    # The agent's verdict ends it.
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=lease.id, op="scrubbed")], "agent:h1")
    assert lease_views.show(ledger, lease.id).state == "reclaimed"


def test_unfinished_scrub_of_a_down_agent_needs_a_human(ledger: Ledger) -> None:
    lease, since = scrubbing_lease(ledger)
    beat(ledger, Heartbeat(held_leases=[]), since)
    late = since + timedelta(
        seconds=audit.SCRUB_STUCK_AFTER_S + audit_agents.AGENT_REPORT_FRESH_S + 1
    )
    report = audit.run_audit(ledger, POLICY, reclaim_safe=True, now=late)
    [item] = report.agents.unfinished_scrubs
    assert item.lease_id == lease.id and item.action == audit.NEEDS_HUMAN
    assert "agent is down" in item.message
    assert report.exit_code == 2
    with ledger.read() as s:  # nothing was re-issued to an agent that cannot hear it
        assert s.scalar(select(Event.id).where(Event.kind == agent_reports.SCRUB_REISSUE)) is None


def test_unfinished_scrub_cannot_be_told_from_an_old_agents_ids(ledger: Ledger) -> None:
    lease, since = scrubbing_lease(ledger)
    late = since + timedelta(seconds=audit.SCRUB_STUCK_AFTER_S + 30)
    beat(ledger, Heartbeat(held=[]), late)
    report = audit.run_audit(ledger, POLICY, now=late)
    assert report.agents.unfinished_scrubs == [] and report.exit_code == 0
    assert lease_views.show(ledger, lease.id).state == "scrubbing"
