"""Does the ledger hold to DESIGN.md's invariants, and what has the lifecycle left behind?

`load` reads every device, tenant, quarantined range and lease once, and for each
lease its grant event and its last state-changing event (one aggregate query);
`check` then runs in plain Python (no I/O):

* invariant 1: live leases on a device do not overlap, lie inside the device,
  respect its alignment and stay off quarantined and reserved ranges;
* invariant 2: a tenant's live bytes ≤ quota_bytes, live leases ≤ quota_leases;
* invariant 3: every lease has a grant event, and its state is the `to_state`
  of its last state-changing event;
* delegated capacity: every lease granted in a reservation lies inside it and the
  reservation is its host's; reservations overlap neither each other nor leases
  outside them, quarantined or reserved ranges; a tenant's central leases plus, per
  host, the larger of its budget and local leases there stay within its quota.
  Reservations of a host that is down with no lease inside are reclaimable (returned).

Violations need a human. It also lists what the lifecycle left behind: expired
and orphaned leases (reclaimable after the grace), grants never activated
(stale), revoking leases past their deadline. Active leases past their expiry
are listed as pending: whether their agent still holds renewals is the reaper's
call (its outage rule), not the audit's. What is done about them is
poold/ledger/audit.py.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, or_, select

from poold.lease_states import LIVE_STATES, MAPPED_STATE_VALUES, LeaseState
from poold.ledger import transitions
from poold.ledger.agent_reports import SCRUB_REISSUE
from poold.ledger.db import Ledger
from poold.ledger.models import (
    Budget,
    Device,
    Event,
    Host,
    Lease,
    Quarantine,
    Reservation,
    Tenant,
)
from poold.ledger.reaper import ReaperPolicy, orphaned_since
from poold.wire.admin import AuditItem

# Who the audit is in the journal, for every change it makes (audit.py, audit_agents.py).
ACTOR = "poold:audit"

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
    reservation_id: str | None = None  # None: granted centrally
    ended_at: datetime | None = None  # when it stopped being live (None: it is live)


@dataclass(frozen=True)
class ReservationRow:
    id: str
    host_id: int
    device_id: int
    offset_bytes: int
    length_bytes: int
    state: str


@dataclass(frozen=True)
class BudgetRow:
    tenant_id: int
    host_id: int
    bytes: int
    leases: int


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
    reservations: list[ReservationRow] = field(default_factory=list)
    budgets: list[BudgetRow] = field(default_factory=list)
    host_status: dict[int, str] = field(default_factory=dict)


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
    # (tenant, host) -> [bytes, leases] of local leases (granted inside a reservation)
    local_use: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
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
        if lease.reservation_id is None:
            tenant_bytes[lease.tenant_id] += lease.length_bytes
            tenant_count[lease.tenant_id] += 1
        else:
            use = local_use[(lease.tenant_id, lease.host_id)]
            use[0] += lease.length_bytes
            use[1] += 1
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
        elif lease.state in MAPPED_STATE_VALUES:
            # Memory follows the pages: nothing to reclaim until no process maps it (the
            # agent's report names the pids: audit_agents' leaked_mapping).
            ended = snap.state_since.get(lease.id)
            when = f" since {ended.isoformat(timespec='seconds')}" if ended is not None else ""
            out.pending.append(
                item(
                    "ended_mapped",
                    lease,
                    f"ended{when}, but its memfd is still mapped or held: its bytes stay "
                    "counted until no process has it",
                )
            )

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

    _check_delegation(snap, by_device, out, item)
    # Budgets are used quota whether spent or not; a host's local leases past its budget
    # (clawed back after they were granted) count as what they are.
    budget_of = {(b.tenant_id, b.host_id): (b.bytes, b.leases) for b in snap.budgets}
    for key in set(budget_of) | set(local_use):
        budget, local = budget_of.get(key, (0, 0)), local_use.get(key, [0, 0])
        tenant_bytes[key[0]] += max(budget[0], local[0])
        tenant_count[key[0]] += max(budget[1], local[1])
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


def _check_delegation(
    snap: Snapshot,
    by_device: dict[int, list[LeaseRow]],
    out: Findings,
    item: Callable[..., AuditItem],
) -> None:
    """Local leases inside their host's reservation; reservations on their own."""
    reservations = {r.id: r for r in snap.reservations}
    for live in by_device.values():
        for lease in live:
            if lease.reservation_id is None:
                continue
            res = reservations.get(lease.reservation_id)
            if res is None:
                out.violations.append(
                    item(
                        "reservation_missing",
                        lease,
                        f"granted in reservation {lease.reservation_id}, which is gone",
                        reservation_id=lease.reservation_id,
                    )
                )
            elif res.host_id != lease.host_id or res.device_id != lease.device_id:
                out.violations.append(
                    item(
                        "reservation_not_its_host",
                        lease,
                        f"granted in reservation {res.id} of host "
                        f"{snap.host_names.get(res.host_id)}",
                        reservation_id=res.id,
                    )
                )
            elif not (
                res.offset_bytes <= lease.offset_bytes
                and lease.offset_bytes + lease.length_bytes <= res.offset_bytes + res.length_bytes
            ):
                out.violations.append(
                    item(
                        "outside_reservation",
                        lease,
                        f"does not lie inside reservation {res.id} "
                        f"[{res.offset_bytes}, {res.offset_bytes + res.length_bytes})",
                        reservation_id=res.id,
                    )
                )
    by_dev: dict[int, list[ReservationRow]] = defaultdict(list)
    for res in snap.reservations:
        by_dev[res.device_id].append(res)
    busy = {
        lease.reservation_id
        for live in by_device.values()
        for lease in live
        if lease.reservation_id
    }
    for device_id, held in by_dev.items():
        dev = snap.devices.get(device_id)
        uid = dev.uid if dev is not None else str(device_id)
        held.sort(key=lambda r: r.offset_bytes)

        def res_item(kind: str, res: ReservationRow, message: str, uid: str = uid) -> AuditItem:
            return item(
                kind,
                None,
                message,
                device_id=res.device_id,
                device_uid=uid,
                host=snap.host_names.get(res.host_id),
                state=res.state,
                reservation_id=res.id,
            )

        for a, b in itertools.pairwise(held):
            if b.offset_bytes < a.offset_bytes + a.length_bytes:
                out.violations.append(
                    res_item("reservation_overlap", b, f"overlaps reservation {a.id} on {uid}")
                )
        others: list[tuple[str, int, int]] = [
            (f"lease {x.id}", x.offset_bytes, x.length_bytes)
            for x in by_device.get(device_id, [])
            if x.reservation_id is None
        ]
        others += [
            (f"quarantined range {o}+{n}", o, n) for o, n in snap.quarantine.get(device_id, ())
        ]
        if dev is not None:
            others += [(f"reserved range {o}+{n}", o, n) for o, n in dev.reserved_extents]
        for res in held:
            end = res.offset_bytes + res.length_bytes
            for what, offset, length in others:
                if offset < end and res.offset_bytes < offset + length:
                    out.violations.append(
                        res_item("reservation_overlap", res, f"overlaps {what} on {uid}")
                    )
                    break
            if dev is not None and end > dev.capacity_bytes:
                out.violations.append(
                    res_item("reservation_out_of_bounds", res, f"ends past {uid}'s capacity")
                )
            if snap.host_status.get(res.host_id) == "down" and res.id not in busy:
                out.reclaimable.append(
                    res_item(
                        "reservation_of_down_host",
                        res,
                        f"host {snap.host_names.get(res.host_id)} is down and no lease lies "
                        "in it: return it",
                    )
                )


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
        host_names: dict[int, str] = {}
        host_status: dict[int, str] = {}
        for i, name, status in conn.execute(select(Host.id, Host.name, Host.status)):
            host_names[i], host_status[i] = name, status
        reservations = [
            ReservationRow(*r)
            for r in conn.execute(
                select(
                    Reservation.id,
                    Reservation.host_id,
                    Reservation.device_id,
                    Reservation.offset_bytes,
                    Reservation.length_bytes,
                    Reservation.state,
                )
            )
        ]
        budgets = [
            BudgetRow(*r)
            for r in conn.execute(
                select(Budget.tenant_id, Budget.host_id, Budget.bytes, Budget.leases)
            )
        ]
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
                Lease.reservation_id,
                Lease.ended_at,
            )
        )
        for chunk in result.partitions():
            # Unpacking a row is a third faster than slicing it (100k rows per audit).
            rows.extend(LeaseRow(*r) for r in chunk)
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
        devices,
        tenants,
        host_names,
        dict(quarantine),
        rows,
        journal,
        orphaned_at,
        state_since,
        reservations,
        budgets,
        host_status,
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
