"""Does the live ledger hold to DESIGN.md's invariants, and what is left to reclaim?

`run_audit` reads every device, tenant, quarantined range and lease once, and
for each lease its grant event and its last state-changing event (one
aggregate query), then checks in plain Python (`check`, no I/O):

* invariant 1: live leases on a device do not overlap, lie inside the device,
  respect its alignment and stay off quarantined ranges;
* invariant 2: a tenant's live bytes ≤ quota_bytes, live leases ≤ quota_leases;
* invariant 3: every lease has a grant event, and its state is the `to_state`
  of its last state-changing event.

Violations need a human (exit 2). It also lists what the lifecycle left
behind: expired and orphaned leases (reclaimable after the grace), grants never
activated (stale), revoking leases past their deadline; with `reclaim=True`
it moves those (conditionally, as the reaper does) and says what it did.
Active leases past their expiry are listed as pending: whether their agent
still holds renewals is the reaper's call (its outage rule), not the audit's.

What agents report (the lease ids they hold memory for, sent with every
heartbeat) is compared with the ledger: a live lease the agent holds nothing for
is *stale* (reclaimable: it is orphaned, the reaper reclaims it after grace);
memory an agent holds for a lease the ledger ended is *leaked* (poold already
revokes it in the next heartbeat reply; the audit lists it).

Exit codes: 0 clean; 1 something was reclaimed (or, without `reclaim`, is
reclaimable); 2 an invariant is violated.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, insert, select

from poold.api.schemas import AgentFindings, AuditItem, AuditReport
from poold.lease_states import LIVE_STATES, LeaseEvent, LeaseState
from poold.ledger import leases as lease_ops
from poold.ledger.db import Ledger
from poold.ledger.models import AuditRun, Device, Event, Host, Lease, Quarantine, Tenant
from poold.ledger.reaper import ReaperPolicy, orphaned_since, reclaim_event
from poold.ledger.types import utcnow

ACTOR = "poold:audit"
LIVE = frozenset(s.value for s in LIVE_STATES)
# At most this many items of each list are kept in the audit_runs row (counts are exact).
STORED_ITEMS = 1000

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class DeviceRow:
    id: int
    uid: str
    capacity_bytes: int
    alignment_bytes: int


@dataclass(frozen=True)
class TenantRow:
    id: int
    name: str
    quota_bytes: int
    quota_leases: int


@dataclass(frozen=True)
class LeaseRow:
    id: str
    tenant_id: int
    host_id: int
    device_id: int
    offset_bytes: int
    length_bytes: int
    state: str
    granted_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class Snapshot:
    """Everything `check` reads: plain values, so the checks run without a database."""

    devices: dict[int, DeviceRow]
    tenants: dict[int, TenantRow]
    host_names: dict[int, str]
    quarantine: dict[int, list[tuple[int, int]]]  # device id → [(offset, length)]
    leases: list[LeaseRow]
    # lease id → (has a grant event, to_state of its last state-changing event)
    journal: dict[str, tuple[bool, str | None]]
    orphaned_at: dict[str, datetime]


@dataclass
class Findings:
    violations: list[AuditItem] = field(default_factory=list)
    reclaimable: list[AuditItem] = field(default_factory=list)
    pending: list[AuditItem] = field(default_factory=list)


def check(snap: Snapshot, policy: ReaperPolicy, now: datetime) -> Findings:
    """The invariants and the lifecycle lists over one snapshot (pure)."""
    out = Findings()
    dev_uid = {d.id: d.uid for d in snap.devices.values()}
    tenant_name = {t.id: t.name for t in snap.tenants.values()}

    def item(kind: str, lease: LeaseRow | None, message: str, **kw: Any) -> AuditItem:
        if lease is not None:
            kw.setdefault("lease_id", lease.id)
            kw.setdefault("device_id", lease.device_id)
            kw.setdefault("device_uid", dev_uid.get(lease.device_id))
            kw.setdefault("tenant", tenant_name.get(lease.tenant_id))
            kw.setdefault("host", snap.host_names.get(lease.host_id))
            kw.setdefault("state", lease.state)
        return AuditItem(kind=kind, message=message, **kw)

    by_device: dict[int, list[LeaseRow]] = defaultdict(list)
    tenant_bytes: dict[int, int] = defaultdict(int)
    tenant_count: dict[int, int] = defaultdict(int)
    grace = timedelta(seconds=policy.expiry_grace_s)
    activation = timedelta(seconds=policy.activation_deadline_s)
    for lease in snap.leases:
        has_grant, last_state = snap.journal.get(lease.id, (False, None))
        if not has_grant:
            out.violations.append(item("no_grant_event", lease, "lease has no grant event"))
        if last_state != lease.state:
            out.violations.append(
                item(
                    "state_not_journalled",
                    lease,
                    f"lease is {lease.state} but its last event says {last_state}",
                )
            )
        if lease.state not in LIVE:
            continue
        by_device[lease.device_id].append(lease)
        tenant_bytes[lease.tenant_id] += lease.length_bytes
        tenant_count[lease.tenant_id] += 1
        if lease.state == LeaseState.EXPIRED.value:
            due = lease.expires_at + grace
            (out.reclaimable if due <= now else out.pending).append(
                item("expired", lease, f"expired at {lease.expires_at.isoformat()}")
            )
        elif lease.state == LeaseState.ORPHANED.value:
            since = snap.orphaned_at.get(lease.id, lease.expires_at)
            (out.reclaimable if since + grace <= now else out.pending).append(
                item("orphaned", lease, f"orphaned since {since.isoformat()}")
            )
        elif lease.state == LeaseState.GRANTED.value and lease.granted_at + activation <= now:
            out.reclaimable.append(
                item(
                    "stale_grant",
                    lease,
                    f"granted at {lease.granted_at.isoformat()}, never activated",
                )
            )
        elif lease.state == LeaseState.REVOKING.value and lease.expires_at <= now:
            out.reclaimable.append(
                item(
                    "revoking_past_deadline",
                    lease,
                    f"revocation deadline {lease.expires_at.isoformat()} passed",
                )
            )
        elif lease.state == LeaseState.ACTIVE.value and lease.expires_at <= now:
            out.pending.append(
                item("lapsed", lease, "past its expiry; the reaper expires it (outage rule)")
            )
        elif lease.state == LeaseState.SCRUBBING.value:
            out.pending.append(item("scrubbing", lease, "waiting for the agent's scrub"))

    for device_id, live in by_device.items():
        dev = snap.devices[device_id]
        live.sort(key=lambda x: x.offset_bytes)
        quarantined = sorted(snap.quarantine.get(device_id, ()))
        previous: LeaseRow | None = None
        for lease in live:
            end = lease.offset_bytes + lease.length_bytes
            if previous is not None and lease.offset_bytes < (
                previous.offset_bytes + previous.length_bytes
            ):
                out.violations.append(
                    item("overlap", lease, f"overlaps lease {previous.id} on {dev.uid}")
                )
            if previous is None or end > previous.offset_bytes + previous.length_bytes:
                previous = lease
            if end > dev.capacity_bytes:
                out.violations.append(
                    item(
                        "out_of_bounds",
                        lease,
                        f"ends at {end}, device capacity is {dev.capacity_bytes}",
                    )
                )
            if lease.offset_bytes % dev.alignment_bytes or lease.length_bytes % dev.alignment_bytes:
                out.violations.append(
                    item("misaligned", lease, f"not aligned to {dev.alignment_bytes} bytes")
                )
            for q_offset, q_length in quarantined:
                if q_offset >= end:
                    break
                if q_offset + q_length > lease.offset_bytes:
                    out.violations.append(
                        item(
                            "quarantined",
                            lease,
                            f"overlaps quarantined range {q_offset}+{q_length}",
                        )
                    )
                    break

    for tenant in snap.tenants.values():
        used, count = tenant_bytes.get(tenant.id, 0), tenant_count.get(tenant.id, 0)
        if used > tenant.quota_bytes:
            out.violations.append(
                item(
                    "over_quota_bytes",
                    None,
                    f"holds {used} live bytes, quota is {tenant.quota_bytes}",
                    tenant=tenant.name,
                )
            )
        if count > tenant.quota_leases:
            out.violations.append(
                item(
                    "over_quota_leases",
                    None,
                    f"holds {count} live leases, quota is {tenant.quota_leases}",
                    tenant=tenant.name,
                )
            )
    return out


def load(ledger: Ledger, progress: Progress | None = None) -> Snapshot:
    """Read everything `check` needs, in one read transaction (Core, no ORM objects)."""
    with ledger.read() as s:
        conn = s.connection()
        devices = {
            r.id: DeviceRow(r.id, r.uid, r.capacity_bytes, r.alignment_bytes)
            for r in conn.execute(
                select(Device.id, Device.uid, Device.capacity_bytes, Device.alignment_bytes)
            )
        }
        tenants = {
            r.id: TenantRow(r.id, r.name, r.quota_bytes, r.quota_leases)
            for r in conn.execute(
                select(Tenant.id, Tenant.name, Tenant.quota_bytes, Tenant.quota_leases)
            )
        }
        host_names = {i: name for i, name in conn.execute(select(Host.id, Host.name))}
        quarantine: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for device_id, offset, length in conn.execute(
            select(Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes)
        ):
            quarantine[device_id].append((offset, length))
        total = int(conn.execute(select(func.count(Lease.id))).scalar() or 0)
        if progress:
            progress("leases", 0, total)
        rows: list[LeaseRow] = []
        result = conn.execution_options(yield_per=20_000).execute(
            select(
                Lease.id,
                Lease.tenant_id,
                Lease.host_id,
                Lease.device_id,
                Lease.offset_bytes,
                Lease.length_bytes,
                Lease.state,
                Lease.granted_at,
                Lease.expires_at,
            )
        )
        for chunk in result.partitions():
            rows.extend(LeaseRow(*r) for r in chunk)
            if progress:
                progress("leases", len(rows), total)
        if progress:
            progress("events", 0, 1)
        journal = _journal(conn)
        if progress:
            progress("events", 1, 1)
        orphaned_at = {lease_id: at for lease_id, _kind, at in orphaned_since(conn)}
    return Snapshot(devices, tenants, host_names, dict(quarantine), rows, journal, orphaned_at)


def _journal(conn: Any) -> dict[str, tuple[bool, str | None]]:
    """Per lease: whether a grant event exists, and its last state-changing event's to_state."""
    per_lease = (
        select(
            Event.lease_id,
            func.max(case((Event.kind == "lease.grant", 1), else_=0)).label("has_grant"),
            func.max(case((Event.to_state.is_not(None), Event.id), else_=None)).label("last_id"),
        )
        .where(Event.lease_id.is_not(None))
        .group_by(Event.lease_id)
        .subquery()
    )
    last = Event.__table__.alias("last_event")
    stmt = select(per_lease.c.lease_id, per_lease.c.has_grant, last.c.to_state).outerjoin(
        last, last.c.id == per_lease.c.last_id
    )
    return {
        lease_id: (bool(has_grant), to_state)
        for lease_id, has_grant, to_state in conn.execute(stmt)
    }


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
            event = reclaim_event(kinds.get(it.device_id or -1, ""))
            if expected is LeaseState.EXPIRED:
                where = (Lease.expires_at <= now - grace,)
            elif expected is LeaseState.REVOKING:
                where = (Lease.expires_at <= now,)
        with ledger.write() as s:
            ok = lease_ops.move_if(
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
    if agents is not None and (agents.stale or agents.leaked):
        return 1
    return 1 if reclaimed or findings.reclaimable else 0


# An agent's report is trusted for this long, and a lease granted less than
# STALE_MARGIN_S before the report may simply not have reached the agent's list yet.
AGENT_REPORT_FRESH_S = 60.0
STALE_MARGIN_S = 5.0


def check_agents(
    leases: Iterable[LeaseRow],
    reports: dict[int, tuple[list[str], datetime]],
    host_names: dict[int, str],
    now: datetime,
) -> AgentFindings:
    """Compare the ledger with what each agent says it holds (pure)."""
    fresh = {
        host_id: (set(ids), at)
        for host_id, (ids, at) in reports.items()
        if (now - at).total_seconds() <= AGENT_REPORT_FRESH_S
    }
    if not fresh:
        return AgentFindings(note="no agent reported its leases recently")
    stale: list[AuditItem] = []
    live_by_host: dict[int, set[str]] = defaultdict(set)
    for lease in leases:
        if lease.state not in LIVE:
            continue
        live_by_host[lease.host_id].add(lease.id)
        report = fresh.get(lease.host_id)
        if report is None or lease.id in report[0]:
            continue
        _ids, at = report
        # Only leases whose memory must exist, granted well before the report.
        if (
            lease.state in ("active", "revoking")
            and (at - lease.granted_at).total_seconds() > STALE_MARGIN_S
        ):
            stale.append(
                AuditItem(
                    kind="stale",
                    lease_id=lease.id,
                    device_id=lease.device_id,
                    host=host_names.get(lease.host_id),
                    state=lease.state,
                    message="live in the ledger, but its host's agent holds no memory for it",
                )
            )
    leaked = [
        AuditItem(
            kind="leaked",
            lease_id=lease_id,
            host=host_names.get(host_id),
            message="the agent holds memory for a lease the ledger does not have live "
            "(poold revokes it in the next heartbeat reply)",
        )
        for host_id, (ids, _at) in fresh.items()
        for lease_id in sorted(ids - live_by_host[host_id])
    ]
    return AgentFindings(
        available=True,
        leaked=leaked,
        stale=stale,
        note=f"{len(fresh)} agent(s) reported within {AGENT_REPORT_FRESH_S:g}s",
    )


def load_agent_reports(ledger: Ledger) -> dict[int, tuple[list[str], datetime]]:
    with ledger.read() as s:
        return {
            host_id: (list(ids or []), at)
            for host_id, ids, at in s.execute(
                select(Host.id, Host.agent_leases, Host.agent_leases_at).where(
                    Host.agent_leases_at.is_not(None)
                )
            )
        }


def reclaim_stale(ledger: Ledger, stale: list[AuditItem], now: datetime) -> int:
    """Orphan stale active leases: no memory is behind them; the reaper reclaims after grace."""
    done = 0
    for it in stale:
        if it.lease_id is None or it.state != "active":
            continue
        with ledger.write() as s:
            moved = lease_ops.move_if(
                s.connection(),
                it.lease_id,
                LeaseState.ACTIVE,
                LeaseEvent.ORPHAN,
                actor=ACTOR,
                reason="its host's agent holds no memory for it",
                now=now,
            )
        it.action = "orphaned" if moved else "lost_race"
        done += int(moved)
    return done


def run_audit(
    ledger: Ledger,
    policy: ReaperPolicy,
    *,
    reclaim_safe: bool = False,
    progress: Progress | None = None,
    now: datetime | None = None,
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
    agents = check_agents(snap.leases, load_agent_reports(ledger), snap.host_names, now)
    if reclaim_safe and agents.stale:
        reclaimed += reclaim_stale(ledger, agents.stale, now)
    code = exit_code(findings, reclaimed, agents)
    finished = utcnow()
    report = AuditReport(
        started_at=started,
        finished_at=finished,
        audit_s=time.perf_counter() - t0,
        reclaim=reclaim_safe,
        exit_code=code,
        leases=len(snap.leases),
        live_leases=sum(1 for x in snap.leases if x.state in LIVE),
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
