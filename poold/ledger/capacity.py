"""How much is there, how much is leased, how much is free: per host and per device.

Free is what no live lease, quarantined range, reserved extent (a dax device poold did
not place, as the agent reports it) or reservation (delegated to a host) occupies. The
bytes of a reservation no lease in it uses are "delegated": neither leased nor free.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select

from poold import extents
from poold.errors import UnknownDevice
from poold.extents import Extent
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger import delegation_renewal
from poold.ledger.db import Ledger
from poold.ledger.devices import admin_annotation, reserved
from poold.ledger.hosts import DELETED
from poold.ledger.models import Device, DevicePath, Host, Lease, Quarantine, Reservation
from poold.wire.admin import DelegatedExtent, DeviceStatus, HostStatus, PoolStatus


def pool_status(ledger: Ledger) -> PoolStatus:
    with ledger.read() as session:
        devices = list(session.scalars(select(Device).order_by(Device.id)))
        hosts = list(
            session.scalars(select(Host).where(Host.status != DELETED).order_by(Host.name))
        )
        host_names = {h.id: h.name for h in hosts}
        paths: dict[int, list[DevicePath]] = defaultdict(list)
        for path in session.scalars(select(DevicePath).where(DevicePath.present.is_(True))):
            paths[path.device_id].append(path)
        used: dict[int, list[Extent]] = defaultdict(list)
        leased: dict[int, int] = defaultdict(int)
        live: dict[int, int] = defaultdict(int)
        host_leased: dict[int, int] = defaultdict(int)
        host_live: dict[int, int] = defaultdict(int)
        for device_id, host_id, offset, length in session.execute(
            select(Lease.device_id, Lease.host_id, Lease.offset_bytes, Lease.length_bytes).where(
                Lease.state.in_(LIVE_STATE_VALUES)
            )
        ):
            used[device_id].append(Extent(offset, length))
            leased[device_id] += length
            live[device_id] += 1
            host_leased[host_id] += length
            host_live[host_id] += 1
        quarantined: dict[int, list[Extent]] = defaultdict(list)
        for device_id, offset, length in session.execute(
            select(Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes)
        ):
            used[device_id].append(Extent(offset, length))
            quarantined[device_id].append(Extent(offset, length))
        unleased = delegation_renewal.unleased_by_reservation(session.connection())
        delegated: dict[int, list[DelegatedExtent]] = defaultdict(list)
        host_delegated: dict[int, int] = defaultdict(int)
        for r in session.execute(
            select(
                Reservation.id,
                Reservation.host_id,
                Reservation.device_id,
                Reservation.offset_bytes,
                Reservation.length_bytes,
                Reservation.state,
                Reservation.expires_at,
            ).order_by(Reservation.device_id, Reservation.offset_bytes)
        ):
            used[r.device_id].append(Extent(r.offset_bytes, r.length_bytes))
            delegated[r.device_id].append(
                DelegatedExtent(
                    id=r.id,
                    host=host_names.get(r.host_id, str(r.host_id)),
                    offset_bytes=r.offset_bytes,
                    length_bytes=r.length_bytes,
                    unleased_bytes=unleased.get(r.id, 0),
                    state=r.state,
                    expires_at=r.expires_at,
                )
            )
            host_delegated[r.host_id] += unleased.get(r.id, 0)

    device_rows = []
    host_capacity: dict[int, int] = defaultdict(int)
    host_free: dict[int, int] = defaultdict(int)
    for dev in devices:
        held = reserved(dev.reserved_extents)
        used[dev.id].extend(held)
        free = extents.free_bytes(dev.capacity_bytes, used[dev.id])
        # Sorted by host name so "the" NUMA node and tier shown are stable.
        dev_paths = sorted(paths[dev.id], key=lambda p: host_names[p.host_id])
        for p in dev_paths:
            host_capacity[p.host_id] += dev.capacity_bytes
            host_free[p.host_id] += free
        device_rows.append(
            DeviceStatus(
                id=dev.id,
                uid=dev.uid,
                kind=dev.kind,
                media=dev.media,
                recycled=dev.recycled,
                state=dev.state,
                health=dev.health,
                hosts=sorted(host_names[p.host_id] for p in dev_paths),
                local_names=sorted({p.local_name for p in dev_paths if p.local_name}),
                numa_node=dev_paths[0].numa_node if dev_paths else None,
                capacity_bytes=dev.capacity_bytes,
                leased_bytes=leased[dev.id],
                free_bytes=free,
                largest_free_bytes=extents.largest_free(
                    dev.capacity_bytes, dev.alignment_bytes, used[dev.id]
                ),
                live_leases=live[dev.id],
                alignment_bytes=dev.alignment_bytes,
                provenance=dev.provenance,
                cost_per_gib_month=dev.cost_per_gib_month,
                memory_tier=dev_paths[0].memory_tier if dev_paths else None,
                memdev_serials=list(dev.memdev_serials or []),
                health_reasons=list(dev.health_reasons or []),
                admin_annotations=admin_annotation(dev),
                reserved_extents=[(e.offset, e.length) for e in held],
                reserved_bytes=sum(
                    e.length for e in extents.normalise_used(dev.capacity_bytes, held)
                ),
                quarantined_extents=[(e.offset, e.length) for e in sorted(quarantined[dev.id])],
                quarantined_bytes=sum(
                    e.length
                    for e in extents.normalise_used(dev.capacity_bytes, quarantined[dev.id])
                ),
                delegations=delegated[dev.id],
                delegated_bytes=sum(x.unleased_bytes for x in delegated[dev.id]),
            )
        )
    host_rows = [
        HostStatus(
            name=h.name,
            status=h.status,
            last_heartbeat_at=h.last_heartbeat_at,
            capacity_bytes=host_capacity[h.id],
            leased_bytes=host_leased[h.id],
            free_bytes=host_free[h.id],
            live_leases=host_live[h.id],
            delegated_bytes=host_delegated[h.id],
        )
        for h in hosts
    ]
    return PoolStatus(
        hosts=host_rows,
        devices=device_rows,
        capacity_bytes=sum(d.capacity_bytes for d in device_rows),
        leased_bytes=sum(d.leased_bytes for d in device_rows),
        free_bytes=sum(d.free_bytes for d in device_rows),
        delegated_bytes=sum(d.delegated_bytes for d in device_rows),
    )


def device_status(ledger: Ledger, uid: str) -> DeviceStatus:
    """One device's row of :func:`pool_status`."""
    for row in pool_status(ledger).devices:
        if row.uid == uid:
            return row
    raise UnknownDevice(f"no device with uid {uid!r}", uid=uid)
