"""What does one audit run find, what does it reclaim, and how does it exit?

`run_audit` checks the ledger's invariants and lists what the lifecycle left
behind (poold/ledger/audit_ledger.py), compares the ledger with what agents
report holding (poold/ledger/audit_agents.py), optionally reclaims, and records
one `audit_runs` row. With `reclaim_safe=True` it moves what is reclaimable
(conditionally, as the reaper does), orphans stale leases, and orders leftover
sub-devices deleted and unfinished scrubs re-issued; it says what it did.

Exit codes: 0 clean; 1 something was reclaimed (or, without `reclaim`, is
reclaimable, or an agent disagrees with the ledger); 2 an invariant is violated,
or a scrub is stuck on a host whose agent is down.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import insert, select

from poold.lease_states import LIVE_STATES, LeaseEvent, LeaseState
from poold.ledger import delegation_renewal, transitions
from poold.ledger.audit_agents import (
    NEEDS_HUMAN,
    SCRUB_STUCK_AFTER_S,
    check_agents,
    load_agent_reports,
    order_leftover_deletes,
    reclaim_stale,
    reissue_scrubs,
)
from poold.ledger.audit_ledger import ACTOR, Findings, Progress, check, load
from poold.ledger.db import Ledger
from poold.ledger.models import AuditRun, Device, Lease
from poold.ledger.reaper import ReaperPolicy, reclaim_event, reclaim_events
from poold.ledger.types import utcnow
from poold.wire.admin import AgentFindings, AuditItem, AuditReport

# At most this many items of each list are kept in the audit_runs row (counts are exact).
STORED_ITEMS = 1000


# kind → (state the lease must still be in, event that ends it)
_RECLAIM: dict[str, LeaseState] = {
    "expired": LeaseState.EXPIRED,
    "orphaned": LeaseState.ORPHANED,
    "stale_grant": LeaseState.GRANTED,
    "revoking_past_deadline": LeaseState.REVOKING,
}


def reclaim(
    ledger: Ledger,
    items: Iterable[AuditItem],
    kinds: dict[int, str],
    policy: ReaperPolicy,
    now: datetime,
    progress: Progress | None = None,
) -> int:
    """Move every reclaimable item, each in its own transaction; returns how many moved."""
    todo = [i for i in items if i.kind in _RECLAIM and i.lease_id is not None]
    grace = timedelta(seconds=policy.expiry_grace_s)
    activation = timedelta(seconds=policy.activation_deadline_s)
    moved = 0
    for n, it in enumerate(todo, 1):
        assert it.lease_id is not None
        expected = _RECLAIM[it.kind]
        where: tuple[Any, ...] = ()
        if expected is LeaseState.GRANTED:
            event = LeaseEvent.ABORT
            where = (Lease.granted_at <= now - activation,)
        else:
            kind = kinds.get(it.device_id or -1, "")
            event = reclaim_event(kind)
            if event is LeaseEvent.RECLAIM:  # a memfd: free only on its agent's word
                with ledger.read() as s:
                    event = reclaim_events(s.connection(), [(it.lease_id, kind)])[it.lease_id]
            if expected is LeaseState.EXPIRED:
                where = (Lease.expires_at <= now - grace,)
            elif expected is LeaseState.REVOKING:
                where = (Lease.expires_at <= now,)
        with ledger.write() as s:
            ok = transitions.move_if(
                s.connection(),
                it.lease_id,
                expected,
                event,
                actor=ACTOR,
                reason=f"audit: {it.kind}",
                now=now,
                where=where,
            )
        it.action = ("aborted" if event is LeaseEvent.ABORT else "reclaimed") if ok else "lost_race"
        moved += ok
        if progress:
            progress("reclaim", n, len(todo))
    return moved


def exit_code(findings: Findings, reclaimed: int, agents: AgentFindings | None = None) -> int:
    if findings.violations:
        return 2
    if agents is not None:
        if any(i.action == NEEDS_HUMAN for i in agents.unfinished_scrubs):
            return 2
        if agents.stale or agents.leaked or agents.unfinished_scrubs or agents.holder_mismatches:
            return 1
    return 1 if reclaimed or findings.reclaimable else 0


def run_audit(
    ledger: Ledger,
    policy: ReaperPolicy,
    *,
    reclaim_safe: bool = False,
    progress: Progress | None = None,
    now: datetime | None = None,
    scrub_stuck_after_s: float = SCRUB_STUCK_AFTER_S,
) -> AuditReport:
    """Load, check, optionally reclaim, and record one `audit_runs` row."""
    started = utcnow()
    t0 = time.perf_counter()
    now = now or started
    snap = load(ledger, progress)
    if progress:
        progress("check", 0, 1)
    findings = check(snap, policy, now)
    if progress:
        progress("check", 1, 1)
    reclaimed = 0
    if reclaim_safe and findings.reclaimable:
        kinds = _device_kinds(ledger)
        reclaimed = reclaim(ledger, findings.reclaimable, kinds, policy, now, progress)
    agents = check_agents(
        snap.leases,
        load_agent_reports(ledger),
        snap.host_names,
        now,
        state_since=snap.state_since,
        device_uids={d.id: d.uid for d in snap.devices.values()},
        scrub_stuck_after_s=scrub_stuck_after_s,
    )
    if reclaim_safe:
        reclaimed += delegation_renewal.return_for_audit(ledger, findings.reclaimable, ACTOR)
        host_ids = {name: host_id for host_id, name in snap.host_names.items()}
        reclaimed += reclaim_stale(ledger, agents.stale, now)
        reclaimed += order_leftover_deletes(ledger, agents.leaked, host_ids)
        reclaimed += reissue_scrubs(ledger, agents.unfinished_scrubs, scrub_stuck_after_s)
    code = exit_code(findings, reclaimed, agents)
    finished = utcnow()
    report = AuditReport(
        started_at=started,
        finished_at=finished,
        audit_s=time.perf_counter() - t0,
        reclaim=reclaim_safe,
        exit_code=code,
        leases=len(snap.leases),
        live_leases=sum(1 for x in snap.leases if x.state in LIVE_STATES),
        devices=len(snap.devices),
        violations=findings.violations,
        reclaimable=findings.reclaimable,
        pending=findings.pending,
        agents=agents,
        reclaimed=reclaimed,
    )
    stored = report.model_dump(mode="json")
    for key in ("violations", "reclaimable", "pending"):
        stored[f"{key}_count"] = len(stored[key])
        stored[key] = stored[key][:STORED_ITEMS]
    with ledger.write() as s:
        run_id = s.execute(
            insert(AuditRun)
            .values(
                started_at=started,
                finished_at=finished,
                reclaim=reclaim_safe,
                exit_code=code,
                findings=stored,
            )
            .returning(AuditRun.id)
        ).scalar_one()
    report.run_id = int(run_id)
    return report


def _device_kinds(ledger: Ledger) -> dict[int, str]:
    with ledger.read() as s:
        return {i: kind for i, kind in s.execute(select(Device.id, Device.kind))}
