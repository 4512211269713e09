"""What does the pool look like right now, for a metrics scrape? And which events committed?

`pool_view` reads every device, tenant and host gauge poold's /metrics exports in one
read transaction, at scrape time. The figures are the ledger's, not this process's
memory, so any number of poold on one PostgreSQL report the same truth (a dashboard
takes `max by (device)` across them).

`count_committed_events` is the other half: lease transitions are counted by the
process that wrote them, when their transaction commits (`transitions.record` leaves
each event's kind on the connection; a rollback forgets them), so a retried or
failed transaction is never counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, event, select

from poold import extents
from poold.extents import Extent
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger import central_room, delegation_renewal
from poold.ledger.accounting import MEMORY_HELD
from poold.ledger.db import Ledger
from poold.ledger.devices import reserved
from poold.ledger.models import (
    AuditRun,
    Budget,
    Device,
    Host,
    Lease,
    Quarantine,
    Reservation,
    Tenant,
)
from poold.ledger.transitions import PENDING_EVENTS
from poold.ledger.types import utcnow


@dataclass(frozen=True, slots=True)
class DeviceGauges:
    """One device's figures: where its bytes are, and what state it is in."""

    uid: str
    kind: str
    media: str
    state: str
    health: str
    capacity_bytes: int
    leased_bytes: int
    reserved_bytes: int
    quarantined_bytes: int
    free_bytes: int
    largest_free_bytes: int
    live_leases: int
    # Delegated capacity: bytes reserved for hosts, and the part no lease in them uses.
    delegated_bytes: int = 0
    delegated_unleased_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TenantGauges:
    """One tenant's quota against its live leases and their last accounting reports."""

    name: str
    quota_bytes: int
    quota_leases: int
    leased_bytes: int
    live_leases: int
    used_bytes: int
    exclusive_bytes: int
    replica_bytes: int
    # Its quota delegated to hosts' agents (summed over its per-host budgets).
    budget_bytes: int = 0
    budget_leases: int = 0
    # Its quota kept out of budgets for central grants (poold/ledger/central_room.py).
    central_room_bytes: int = 0


@dataclass(frozen=True, slots=True)
class HostGauges:
    """One host: its status, when it last heartbeated, what it holds."""

    name: str
    status: str
    last_heartbeat_at: datetime | None
    leased_bytes: int
    live_leases: int
    delegated_bytes: int = 0  # bytes reserved for the host (its agent grants inside)


@dataclass(frozen=True, slots=True)
class PoolView:
    """Everything a scrape exports from the ledger, read in one transaction at `read_at`."""

    read_at: datetime
    devices: list[DeviceGauges]
    tenants: list[TenantGauges]
    hosts: list[HostGauges]
    live_leases_by_state: dict[str, int]
    last_audit_at: datetime | None = None
    last_audit_exit_code: int | None = None


_LIVE = select(
    Lease.device_id,
    Lease.tenant_id,
    Lease.host_id,
    Lease.state,
    Lease.offset_bytes,
    Lease.length_bytes,
    Lease.reported_at,
    Lease.used_bytes,
    Lease.exclusive_bytes,
    Lease.replica_bytes,
).where(Lease.state.in_(LIVE_STATE_VALUES))


def pool_view(ledger: Ledger) -> PoolView:
    """The devices, tenants, hosts and live leases as gauges, from one read transaction.

    Cost is one pass over the live leases (the free and largest-free figures need
    their extents); ended leases are not read.
    """
    with ledger.read() as session:
        device_rows = list(
            session.execute(
                select(
                    Device.id,
                    Device.uid,
                    Device.kind,
                    Device.media,
                    Device.state,
                    Device.health,
                    Device.capacity_bytes,
                    Device.alignment_bytes,
                    Device.reserved_extents,
                ).order_by(Device.uid)
            )
        )
        tenant_rows = list(
            session.execute(
                select(
                    Tenant.id,
                    Tenant.name,
                    Tenant.quota_bytes,
                    Tenant.quota_leases,
                    Tenant.central_room_bytes,
                    Tenant.central_room_until,
                ).order_by(Tenant.name)
            )
        )
        host_rows = list(
            session.execute(
                select(Host.id, Host.name, Host.status, Host.last_heartbeat_at).order_by(Host.name)
            )
        )
        live = list(session.execute(_LIVE))
        quarantined = list(
            session.execute(
                select(Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes)
            )
        )
        reservations = list(
            session.execute(
                select(
                    Reservation.id,
                    Reservation.host_id,
                    Reservation.device_id,
                    Reservation.offset_bytes,
                    Reservation.length_bytes,
                )
            )
        )
        budgets = list(session.execute(select(Budget.tenant_id, Budget.bytes, Budget.leases)))
        unleased = (
            delegation_renewal.unleased_by_reservation(session.connection()) if reservations else {}
        )
        audit = session.execute(
            select(AuditRun.finished_at, AuditRun.exit_code)
            .where(AuditRun.finished_at.is_not(None))
            .order_by(AuditRun.id.desc())
            .limit(1)
        ).one_or_none()
        read_at = utcnow()

    used: dict[int, list[Extent]] = defaultdict(list)
    device_leased: dict[int, int] = defaultdict(int)
    device_count: dict[int, int] = defaultdict(int)
    host_leased: dict[int, int] = defaultdict(int)
    host_count: dict[int, int] = defaultdict(int)
    tenant_sums: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    by_state: dict[str, int] = dict.fromkeys(LIVE_STATE_VALUES, 0)
    for device_id, tenant_id, host_id, state, offset, length, reported_at, u, ex, rep in live:
        used[device_id].append(Extent(offset, length))
        device_leased[device_id] += length
        device_count[device_id] += 1
        host_leased[host_id] += length
        host_count[host_id] += 1
        by_state[state] = by_state.get(state, 0) + 1
        sums = tenant_sums[tenant_id]
        sums[0] += length
        sums[1] += 1
        # As accounting counts them: only a holder that still has the memory reports usage.
        if state in MEMORY_HELD and reported_at is not None:
            sums[2] += u
            sums[3] += ex
            sums[4] += rep
    quarantine: dict[int, list[Extent]] = defaultdict(list)
    for device_id, offset, length in quarantined:
        quarantine[device_id].append(Extent(offset, length))

    delegated: dict[int, list[Extent]] = defaultdict(list)
    dev_unleased: dict[int, int] = defaultdict(int)
    host_delegated: dict[int, int] = defaultdict(int)
    for rid, host_id, device_id, offset, length in reservations:
        delegated[device_id].append(Extent(offset, length))
        dev_unleased[device_id] += unleased.get(rid, 0)
        host_delegated[host_id] += length
    tenant_budget: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for tenant_id, b_bytes, b_leases in budgets:
        tenant_budget[tenant_id][0] += b_bytes
        tenant_budget[tenant_id][1] += b_leases

    devices = []
    for dev_id, uid, kind, media, state, health, capacity, alignment, stored in device_rows:
        held = reserved(stored)
        taken = [*used[dev_id], *quarantine[dev_id], *held, *delegated[dev_id]]
        devices.append(
            DeviceGauges(
                uid=uid,
                kind=kind,
                media=media,
                state=state,
                health=health,
                capacity_bytes=capacity,
                leased_bytes=device_leased[dev_id],
                reserved_bytes=_covered(capacity, held),
                quarantined_bytes=_covered(capacity, quarantine[dev_id]),
                free_bytes=extents.free_bytes(capacity, taken),
                largest_free_bytes=extents.largest_free(capacity, alignment, taken),
                live_leases=device_count[dev_id],
                delegated_bytes=_covered(capacity, delegated[dev_id]),
                delegated_unleased_bytes=dev_unleased[dev_id],
            )
        )
    tenants = []
    for row in tenant_rows:
        tenant_id, name, quota_bytes, quota_leases = row[:4]
        leased, count, used_bytes, exclusive, replica = tenant_sums.get(tenant_id, [0] * 5)
        tenants.append(
            TenantGauges(
                name=name,
                quota_bytes=quota_bytes,
                quota_leases=quota_leases,
                leased_bytes=leased,
                live_leases=count,
                used_bytes=used_bytes,
                exclusive_bytes=exclusive,
                replica_bytes=replica,
                budget_bytes=tenant_budget[tenant_id][0],
                budget_leases=tenant_budget[tenant_id][1],
                central_room_bytes=central_room.kept(row, read_at)[0],
            )
        )
    hosts = [
        HostGauges(
            name=name,
            status=status,
            last_heartbeat_at=heard,
            leased_bytes=host_leased[host_id],
            live_leases=host_count[host_id],
            delegated_bytes=host_delegated[host_id],
        )
        for host_id, name, status, heard in host_rows
    ]
    return PoolView(
        read_at=read_at,
        devices=devices,
        tenants=tenants,
        hosts=hosts,
        live_leases_by_state=by_state,
        last_audit_at=audit[0] if audit is not None else None,
        last_audit_exit_code=audit[1] if audit is not None else None,
    )


def _covered(capacity: int, ranges: list[Extent]) -> int:
    return sum(e.length for e in extents.normalise_used(capacity, ranges))


def count_committed_events(ledger: Ledger, committed: Callable[[list[str]], None]) -> None:
    """Call `committed` with the event kinds of every transaction of `ledger` that commits.

    `transitions.record` appends each event's kind to the list this puts on every
    connection's info; BEGIN and ROLLBACK empty it, COMMIT hands it over. The commit
    event fires just before the database's COMMIT: a COMMIT that then fails (the
    connection lost at that very moment) is counted, a rare over-count the ledger's
    own events table does not share.
    """
    engine = ledger.engine

    def pending(conn: Connection) -> list[str]:
        found: list[str] | None = conn.info.get(PENDING_EVENTS)
        if found is None:
            found = conn.info[PENDING_EVENTS] = []
        return found

    def forget(conn: Connection) -> None:
        if conn.invalidated:
            # The connection died under the transaction (the database went away): its
            # info is unreachable until the rollback, and a new one starts empty.
            return
        pending(conn).clear()

    def on_commit(conn: Connection) -> None:
        kinds = pending(conn)
        if kinds:
            done = list(kinds)
            kinds.clear()
            committed(done)

    event.listen(engine, "engine_connect", forget)
    event.listen(engine, "begin", forget)
    event.listen(engine, "rollback", forget)
    event.listen(engine, "commit", on_commit)
