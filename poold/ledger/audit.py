"""Does the live ledger hold to DESIGN.md's invariants, and what is left to reclaim?

`run_audit` reads every device, tenant, quarantined range and lease once, and
for each lease its grant event and its last state-changing event (one
aggregate query), then checks in plain Python (`check`, no I/O):

* invariant 1: live leases on a device do not overlap, lie inside the device,
  respect its alignment and stay off quarantined and reserved ranges;
* invariant 2: a tenant's live bytes ≤ quota_bytes, live leases ≤ quota_leases;
* invariant 3: every lease has a grant event, and its state is the `to_state`
  of its last state-changing event.

Violations need a human (exit 2). It also lists what the lifecycle left
behind: expired and orphaned leases (reclaimable after the grace), grants never
activated (stale), revoking leases past their deadline; with `reclaim=True`
it moves those (conditionally, as the reaper does) and says what it did.
Active leases past their expiry are listed as pending: whether their agent
still holds renewals is the reaper's call (its outage rule), not the audit's.

What agents report with every heartbeat (per lease: its holders as pid + start
time, its dax sub-device, its local state and any scrub running; plus leftover
sub-devices; older agents send only lease ids) is compared with the ledger:

* a live lease the agent holds nothing for is *stale* (reclaimable: it is
  orphaned, the reaper reclaims it after grace);
* memory an agent holds for a lease the ledger ended is *leaked* (poold already
  revokes it in the next heartbeat reply; the audit lists it), and so is a
  leftover sub-device made for a lease the ledger ended or does not know: with
  `reclaim` the audit orders it deleted (a `host.leftover_delete` event; the
  host's next heartbeat reply revokes the lease id, and the agent destroys the
  sub-device);
* a lease `scrubbing` in the ledger for longer than `scrub_stuck_after_s`
  while its agent reports no scrub running is an *unfinished scrub*: with
  `reclaim` the scrub order is re-issued (a `lease.scrub_reissue` event; the
  order in the reply then carries `reissued_at`, and the agent scrubs again);
  if the agent is down nobody can zero the range: it needs a human;
* a ledger holder pid the agent does not report, or a leftover sub-device of
  a live lease, is a *holder mismatch* (listed, for a person to look at).

Everything the audit asks of an agent goes through the ledger (events) and the
heartbeat reply: poold never calls agents.

Exit codes: 0 clean; 1 something was reclaimed (or, without `reclaim`, is
reclaimable, or an agent disagrees with the ledger); 2 an invariant is violated,
or a scrub is stuck on a host whose agent is down.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, func, insert, or_, select

from poold.lease_states import LIVE_STATES, LeaseEvent, LeaseState
from poold.ledger import transitions
from poold.ledger.agent_reports import LEFTOVER_DELETE, SCRUB_REISSUE, parse_stored
from poold.ledger.db import Ledger
from poold.ledger.models import AuditRun, Device, Event, Host, Lease, Quarantine, Tenant
from poold.ledger.reaper import ReaperPolicy, orphaned_since, reclaim_event
from poold.ledger.types import utcnow
from poold.wire.admin import AgentFindings, AuditItem, AuditReport
from poold.wire.agent import AgentLease, LeftoverSubDevice

ACTOR = "poold:audit"
# At most this many items of each list are kept in the audit_runs row (counts are exact).
STORED_ITEMS = 1000
NEEDS_HUMAN = "needs_human"

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass(frozen=True)
class DeviceRow:
    id: int
    uid: str
    capacity_bytes: int
    alignment_bytes: int
    # (offset, length) held by dax devices poold did not place, as the agent reports them.
    reserved_extents: tuple[tuple[int, int], ...] = ()


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
    holder_pid: int | None = None


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
    # scrubbing lease id → when its last state change (or scrub re-issue) happened
    state_since: dict[str, datetime] = field(default_factory=dict)


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
        if lease.state not in LIVE_STATES:
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
            for r_offset, r_length in dev.reserved_extents:
                if r_offset < end and lease.offset_bytes < r_offset + r_length:
                    out.violations.append(
                        item(
                            "reserved",
                            lease,
                            f"overlaps reserved range {r_offset}+{r_length} "
                            "(held by a dax device poold did not place)",
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
            r.id: DeviceRow(
                r.id,
                r.uid,
                r.capacity_bytes,
                r.alignment_bytes,
                tuple((int(o), int(n)) for o, n in r.reserved_extents or ()),
            )
            for r in conn.execute(
                select(
                    Device.id,
                    Device.uid,
                    Device.capacity_bytes,
                    Device.alignment_bytes,
                    Device.reserved_extents,
                )
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
                Lease.holder_pid,
            )
        )
        for chunk in result.partitions():
            # SQLAlchemy types a row of ten columns as "ten or more"; unpacking it is
            # a third faster than slicing it (100k rows per audit).
            rows.extend(LeaseRow(*r) for r in chunk)  # type: ignore[call-arg]
            if progress:
                progress("leases", len(rows), total)
        if progress:
            progress("events", 0, 1)
        journal = _journal(conn)
        state_since = _scrubbing_since(
            conn, [r.id for r in rows if r.state == LeaseState.SCRUBBING.value]
        )
        if progress:
            progress("events", 1, 1)
        orphaned_at = {lease_id: at for lease_id, _kind, at in orphaned_since(conn)}
    return Snapshot(
        devices, tenants, host_names, dict(quarantine), rows, journal, orphaned_at, state_since
    )


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


def _scrubbing_since(conn: Any, lease_ids: list[str]) -> dict[str, datetime]:
    """When each scrubbing lease last changed state, or had its scrub re-issued.

    Only for the (few) scrubbing leases, by lease id (events are indexed by it): a
    column over the whole journal would cost every audit a second on 100k leases.
    """
    since: dict[str, datetime] = {}
    for chunk in transitions.chunks(lease_ids, 500):  # short IN lists
        since.update(
            (lease_id, at)
            for lease_id, at in conn.execute(
                select(Event.lease_id, func.max(Event.at))
                .where(
                    Event.lease_id.in_(chunk),
                    or_(Event.to_state.is_not(None), Event.kind == SCRUB_REISSUE),
                )
                .group_by(Event.lease_id)
            )
            if at is not None
        )
    return since


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


# An agent's report is trusted for this long, and a lease granted less than
# STALE_MARGIN_S before the report may simply not have reached the agent's list yet.
AGENT_REPORT_FRESH_S = 60.0
STALE_MARGIN_S = 5.0
# A lease may sit in `scrubbing` with no scrub running on its agent for this long
# (the order rides on the next heartbeat reply; the verdict on the agent's outbox)
# before the audit calls the scrub unfinished. A running scrub is never unfinished,
# however long it takes: the agent reports it, with its progress.
SCRUB_STUCK_AFTER_S = 120.0


@dataclass(frozen=True)
class AgentReport:
    """What one host's agent last said it holds (hosts.agent_leases), and whether it is up."""

    at: datetime | None  # when the report arrived (None: the agent never sent one)
    leases: dict[str, AgentLease]
    leftovers: list[LeftoverSubDevice]
    # False: an older agent's bare list of ids (no holders, scrubs or leftovers).
    detailed: bool
    status: str = "up"
    last_heartbeat_at: datetime | None = None

    def fresh(self, now: datetime) -> bool:
        return self.at is not None and (now - self.at).total_seconds() <= AGENT_REPORT_FRESH_S

    def agent_up(self, now: datetime) -> bool:
        heard = self.last_heartbeat_at
        return (
            self.status != "down"
            and heard is not None
            and (now - heard).total_seconds() <= AGENT_REPORT_FRESH_S
        )

    def held(self) -> set[str]:
        """The ids the agent holds memory for (a running scrub is not holding)."""
        return {i for i, x in self.leases.items() if x.state != "scrubbing"}


def check_agents(
    leases: Iterable[LeaseRow],
    reports: dict[int, AgentReport],
    host_names: dict[int, str],
    now: datetime,
    *,
    state_since: dict[str, datetime] | None = None,
    device_uids: dict[int, str] | None = None,
    scrub_stuck_after_s: float = SCRUB_STUCK_AFTER_S,
) -> AgentFindings:
    """Compare the ledger with what each agent says it holds (pure)."""
    since = state_since or {}
    uids = device_uids or {}
    fresh = {host_id: r for host_id, r in reports.items() if r.fresh(now)}
    if not fresh:
        # No report to compare: only scrubs can be stuck (their agents are down).
        leases = [x for x in leases if x.state == LeaseState.SCRUBBING.value]
    stale: list[AuditItem] = []
    mismatches: list[AuditItem] = []
    scrubs: list[AuditItem] = []
    live_by_host: dict[int, set[str]] = defaultdict(set)
    state_of: dict[str, str] = {}

    def item(kind: str, lease: LeaseRow, message: str, **kw: Any) -> AuditItem:
        return AuditItem(
            kind=kind,
            lease_id=lease.id,
            device_id=lease.device_id,
            device_uid=uids.get(lease.device_id),
            host=host_names.get(lease.host_id),
            state=lease.state,
            message=message,
            **kw,
        )

    for lease in leases:
        state_of[lease.id] = lease.state
        if lease.state not in LIVE_STATES:
            continue
        live_by_host[lease.host_id].add(lease.id)
        if lease.state == LeaseState.SCRUBBING.value:
            found = _unfinished_scrub(
                lease, reports.get(lease.host_id), since.get(lease.id), now, scrub_stuck_after_s
            )
            if found is not None:
                message, action = found
                scrubs.append(item("unfinished_scrub", lease, message, action=action))
            continue
        report = fresh.get(lease.host_id)
        if report is None:
            continue
        entry = report.leases.get(lease.id)
        if entry is None or entry.state == "scrubbing":
            # Only leases whose memory must exist, granted well before the report.
            assert report.at is not None
            if (
                lease.state in ("active", "revoking")
                and (report.at - lease.granted_at).total_seconds() > STALE_MARGIN_S
            ):
                stale.append(
                    item(
                        "stale",
                        lease,
                        "live in the ledger, but its host's agent holds no memory for it",
                        sub_device=entry.sub_device if entry is not None else None,
                    )
                )
            continue
        pids = {h.pid for h in entry.holders}
        if lease.holder_pid is not None and pids and lease.holder_pid not in pids:
            agent_says = ", ".join(
                f"pid {h.pid}"
                + (f" started {_at(h.start_time)}" if h.start_time is not None else "")
                for h in entry.holders
            )
            mismatches.append(
                item(
                    "holder_mismatch",
                    lease,
                    f"the ledger's holder is pid {lease.holder_pid}; the agent reports "
                    f"{agent_says} ({entry.state})",
                    sub_device=entry.sub_device,
                )
            )
    leaked = [
        AuditItem(
            kind="leaked",
            lease_id=lease_id,
            host=host_names.get(host_id),
            state=state_of.get(lease_id),
            sub_device=report.leases[lease_id].sub_device,
            message="the agent holds memory for a lease the ledger does not have live "
            "(poold revokes it in the next heartbeat reply)",
        )
        for host_id, report in fresh.items()
        for lease_id in sorted(report.held() - live_by_host[host_id])
    ]
    for host_id, report in fresh.items():
        for left in report.leftovers:
            state = state_of.get(left.lease_id)
            what = (
                f"sub-device {left.sub_device} ({left.size_bytes} bytes of dax region "
                f"{left.region_id}) that the agent made for this lease"
            )
            common = {
                "lease_id": left.lease_id,
                "host": host_names.get(host_id),
                "state": state,
                "sub_device": left.sub_device,
            }
            if state is not None and state in LIVE_STATES:
                mismatches.append(
                    AuditItem(
                        kind="leftover_of_live_lease",
                        message=f"{what} remains, but the agent holds no lease for it",
                        **common,
                    )
                )
            else:
                ended = f"has ended ({state})" if state is not None else "does not know"
                leaked.append(
                    AuditItem(
                        kind="leftover_sub_device",
                        message=f"{what} remains; the ledger {ended} the lease "
                        "(--reclaim has the agent delete it)",
                        **common,
                    )
                )
    note = (
        f"{len(fresh)} agent(s) reported within {AGENT_REPORT_FRESH_S:g}s"
        if fresh
        else "no agent reported its leases recently"
    )
    return AgentFindings(
        available=bool(fresh),
        leaked=leaked,
        stale=stale,
        unfinished_scrubs=scrubs,
        holder_mismatches=mismatches,
        note=note,
    )


def _unfinished_scrub(
    lease: LeaseRow,
    report: AgentReport | None,
    since: datetime | None,
    now: datetime,
    stuck_after_s: float,
) -> tuple[str, str | None] | None:
    """(message, action) when a scrubbing lease's scrub looks dropped; None while it may run."""
    if since is None or (now - since).total_seconds() < stuck_after_s:
        return None
    for_s = f"scrubbing since {since.isoformat(timespec='seconds')}"
    if report is None or not report.agent_up(now):
        heard = report.last_heartbeat_at if report is not None else None
        last = heard.isoformat(timespec="seconds") if heard is not None else "never"
        return (
            f"{for_s}, and its host's agent is down (last heartbeat: {last}): "
            "nobody can zero the range",
            NEEDS_HUMAN,
        )
    if not report.fresh(now) or not report.detailed:
        return None  # an agent that does not report its scrubs: cannot tell
    assert report.at is not None
    if (report.at - since).total_seconds() <= STALE_MARGIN_S:
        return None
    entry = report.leases.get(lease.id)
    if entry is not None and entry.state == "scrubbing":
        return None  # running (its progress is in the agent's report)
    return f"{for_s}; its agent reports no scrub running (--reclaim re-issues the order)", None


def _at(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="seconds")


def load_agent_reports(ledger: Ledger) -> dict[int, AgentReport]:
    """Every host's last stored agent report, with its status and last heartbeat."""
    out: dict[int, AgentReport] = {}
    with ledger.read() as s:
        for host_id, status, heard, raw, at in s.execute(
            select(
                Host.id,
                Host.status,
                Host.last_heartbeat_at,
                Host.agent_leases,
                Host.agent_leases_at,
            )
        ):
            parsed = parse_stored(raw) if at is not None else None
            found, leftovers, detailed = parsed or ({}, [], False)
            out[host_id] = AgentReport(
                at if parsed is not None else None, found, leftovers, detailed, status, heard
            )
    return out


def reclaim_stale(ledger: Ledger, stale: list[AuditItem], now: datetime) -> int:
    """Orphan stale active leases: no memory is behind them; the reaper reclaims after grace."""
    done = 0
    for it in stale:
        if it.lease_id is None or it.state != "active":
            continue
        with ledger.write() as s:
            moved = transitions.move_if(
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


def order_leftover_deletes(
    ledger: Ledger, leaked: list[AuditItem], host_ids: dict[str, int]
) -> int:
    """Ask agents to delete leftover sub-devices of ended leases (one event each)."""
    done = 0
    for it in leaked:
        host_id = host_ids.get(it.host or "")
        if it.kind != "leftover_sub_device" or it.lease_id is None or host_id is None:
            continue
        with ledger.write() as s:
            transitions.record(
                s,
                transitions.event_row(
                    actor=ACTOR,
                    kind=LEFTOVER_DELETE,
                    lease_id=it.lease_id,
                    host_id=host_id,
                    reason=f"audit: leftover sub-device {it.sub_device} of an ended lease",
                    detail={"sub_device": it.sub_device},
                ),
            )
        it.action = "delete_ordered"
        done += 1
    return done


def reissue_scrubs(ledger: Ledger, scrubs: list[AuditItem], stuck_after_s: float) -> int:
    """Re-issue the scrub order of unfinished scrubs whose agent is up (one event each)."""
    done = 0
    for it in scrubs:
        if it.lease_id is None or it.action is not None:
            continue  # needs a human: its agent is down
        with ledger.write() as s:
            row = s.execute(
                select(Lease.state, Lease.host_id, Lease.device_id, Lease.tenant_id).where(
                    Lease.id == it.lease_id
                )
            ).one_or_none()
            if row is None or row.state != LeaseState.SCRUBBING.value:
                it.action = "lost_race"  # scrubbed (or failed) since the audit read it
                continue
            transitions.record(
                s,
                transitions.event_row(
                    actor=ACTOR,
                    kind=SCRUB_REISSUE,
                    lease_id=it.lease_id,
                    host_id=row.host_id,
                    device_id=row.device_id,
                    tenant_id=row.tenant_id,
                    reason=f"audit: no scrub running on the agent for over {stuck_after_s:g}s",
                ),
            )
        it.action = "scrub_reissued"
        done += 1
    return done


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
