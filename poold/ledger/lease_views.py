"""What does a lease look like from outside? One lease, or a filtered list, as `LeaseOut`.

`lease_out` is the only place a `LeaseOut` is built: from a row of `_LEASE_OUT`
here, and from the values a grant has in hand (poold/ledger/leases.py), which
uses the same column names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, select

from poold.errors import UnknownLease
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Host, Lease, Tenant
from poold.wire.common import LeaseOut

# One row per lease: what LeaseOut shows, named as its fields.
_LEASE_OUT = (
    select(
        Lease.id,
        Tenant.name.label("tenant"),
        Host.name.label("host"),
        Device.uid.label("device_uid"),
        Device.kind.label("device_kind"),
        Device.media,
        Lease.offset_bytes,
        Lease.length_bytes,
        Lease.requested_bytes,
        Device.alignment_bytes,
        Lease.state,
        Lease.epoch,
        Lease.ttl_s,
        Lease.granted_at,
        Lease.activated_at,
        Lease.expires_at,
        Lease.ended_at,
        # No path: the device is not (or no longer) reached from the lease's host.
        DevicePath.numa_node,
        DevicePath.local_name,
        Lease.holder_uid,
        Lease.holder_pid,
        Lease.labels,
        Lease.exclusive_bytes,
        Lease.replica_bytes,
        Lease.reservation_id,
    )
    .join(Tenant, Tenant.id == Lease.tenant_id)
    .join(Host, Host.id == Lease.host_id)
    .join(Device, Device.id == Lease.device_id)
    .outerjoin(
        DevicePath,
        (DevicePath.device_id == Lease.device_id) & (DevicePath.host_id == Lease.host_id),
    )
)


def lease_out(row: Mapping[Any, Any]) -> LeaseOut:
    """The wire view of one lease, from a mapping with `_LEASE_OUT`'s column names."""
    return LeaseOut(
        id=row["id"],
        tenant=row["tenant"],
        host=row["host"],
        device_uid=row["device_uid"],
        device_kind=row["device_kind"],
        media=row["media"],
        offset_bytes=row["offset_bytes"],
        length_bytes=row["length_bytes"],
        requested_bytes=row["requested_bytes"],
        alignment_bytes=row["alignment_bytes"],
        state=row["state"],
        epoch=row["epoch"],
        ttl_s=row["ttl_s"],
        granted_at=row["granted_at"],
        activated_at=row["activated_at"],
        expires_at=row["expires_at"],
        ended_at=row["ended_at"],
        numa_node=row["numa_node"],
        local_name=row["local_name"] or "",
        holder_uid=row["holder_uid"],
        holder_pid=row["holder_pid"],
        labels=dict(row["labels"]),
        exclusive_bytes=row["exclusive_bytes"],
        replica_bytes=row["replica_bytes"],
        reservation_id=row.get("reservation_id"),
    )


def show_in(conn: Connection, lease_id: str) -> LeaseOut:
    """One lease as its caller's transaction sees it (a write path's reply)."""
    row = conn.execute(_LEASE_OUT.where(Lease.id == lease_id)).one_or_none()
    if row is None:
        raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
    return lease_out(row._mapping)


def show(ledger: Ledger, lease_id: str) -> LeaseOut:
    """One lease by id, or `unknown_lease`."""
    with ledger.read() as session:
        return show_in(session.connection(), lease_id)


def list_leases(
    ledger: Ledger,
    *,
    tenant: str | None = None,
    host: str | None = None,
    states: Sequence[str] | None = None,
    live_only: bool = False,
    limit: int = 1000,
) -> list[LeaseOut]:
    """Leases matching every filter given, newest grant first."""
    stmt = _LEASE_OUT
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    if host is not None:
        stmt = stmt.where(Host.name == host)
    if live_only:
        stmt = stmt.where(Lease.state.in_(LIVE_STATE_VALUES))
    if states:
        stmt = stmt.where(Lease.state.in_(list(states)))
    stmt = stmt.order_by(Lease.granted_at.desc()).limit(limit)
    with ledger.read() as session:
        return [lease_out(row._mapping) for row in session.connection().execute(stmt)]
