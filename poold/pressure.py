"""When is a device short of free memory, and whom does poold ask to give some back?

Pure: the ledger (poold/ledger/heartbeat.py, in each heartbeat) gathers what it knows and
gets back shrink requests; nothing here reads a database or a clock.

A device is under pressure when its free bytes fall under a low watermark (a
fraction of its capacity), or a waiting lease request needs more than is free
(bytes reserved for a host, DESIGN.md "Delegated capacity", are not free). The
shortfall is asked back cheapest first:

0. reservations no lease lies in (reserved but unleased: no one loses anything), the
   biggest first; one already asked back counts as coming, and is not asked again.
   A reservation with a lease inside is not asked (its host may be granting in it);
1. leased bytes no store uses (a reported lease's ``length - used``, in whole
   units of the device alignment, since leases shrink by those): giving them back
   loses nothing;
2. replicas (DESIGN.md "Exclusive-copy accounting"): the tenants holding the
   most replica bytes first, each of their leases for at most its replica bytes;
3. exclusive bytes, only once every replica byte on the device has been asked for.

A reservation is asked back by recalling it (its agent gives it back); a request is
given back by shrinking the lease (or releasing it); poold revokes a
lease that has not covered its request by the deadline. Leases that never reported
are not asked: poold knows nothing of them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

DEFAULT_WATERMARK = 0.05
# How long a tenant has to give memory back (revocation after it is not done yet).
DEFAULT_DEADLINE_S = 30.0


@dataclass(frozen=True)
class DeviceFree:
    device_id: int
    capacity_bytes: int
    free_bytes: int  # neither leased (live) nor quarantined
    # A lease request waiting for room on this device (admission wait_s): asked
    # back on top of the watermark, so pressure makes room for it.
    wanted_bytes: int = 0
    # Leases shrink in whole units of this: slack smaller than it cannot be given back.
    alignment_bytes: int = 1


@dataclass(frozen=True)
class LeaseUse:
    lease_id: str
    tenant_id: int
    device_id: int
    length_bytes: int
    reported: bool
    used_bytes: int = 0
    exclusive_bytes: int = 0
    replica_bytes: int = 0


@dataclass(frozen=True)
class ReservationUse:
    """A reservation on a device, as pressure sees it (only whole empty ones are asked)."""

    reservation_id: str
    device_id: int
    length_bytes: int
    empty: bool  # no live lease lies in it (as the ledger knows)
    recalled: bool = False  # asked back already: its bytes are on their way back


@dataclass(frozen=True)
class Plan:
    """What pressure asks: reservations back first, then leases to shrink."""

    recalls: list[str]  # reservation ids newly asked back
    shrinks: list[ShrinkRequest]


@dataclass(frozen=True)
class ShrinkRequest:
    lease_id: str
    device_id: int
    target_bytes: int  # bytes to give back
    replica_bytes: int  # of which replica bytes (the rest: unused slack, then exclusive)
    deadline_at: datetime


def watermark_bytes(capacity_bytes: int, watermark: float) -> int:
    return math.ceil(capacity_bytes * watermark)


def shortfall(device: DeviceFree, watermark: float) -> int:
    """Bytes the device lacks to be at its watermark (0: not under pressure)."""
    wanted = watermark_bytes(device.capacity_bytes, watermark) + device.wanted_bytes
    return max(0, wanted - device.free_bytes)


def plan_device(
    device: DeviceFree,
    leases: Iterable[LeaseUse],
    watermark: float,
    deadline_at: datetime,
) -> list[ShrinkRequest]:
    """Shrink requests for one device, replica-first, covering its shortfall if they can."""
    return plan_device_with(device, leases, (), watermark, deadline_at).shrinks


def plan_device_with(
    device: DeviceFree,
    leases: Iterable[LeaseUse],
    reservations: Iterable[ReservationUse],
    watermark: float,
    deadline_at: datetime,
) -> Plan:
    """Recalls, then shrink requests, for one device, covering its shortfall if they can."""
    on_device = [
        lease for lease in leases if lease.device_id == device.device_id and lease.reported
    ]
    need = shortfall(device, watermark)
    if need <= 0:
        return Plan([], [])
    # Reserved but unleased first: those already asked back are coming, the biggest first.
    recalls: list[str] = []
    empty = [r for r in reservations if r.device_id == device.device_id and r.empty]
    for r in sorted(empty, key=lambda r: (not r.recalled, -r.length_bytes, r.reservation_id)):
        if need <= 0:
            break
        if not r.recalled:
            recalls.append(r.reservation_id)
        need -= r.length_bytes
    if need <= 0:
        return Plan(recalls, [])
    # Unused leased bytes first: the biggest slack first.
    asked_unused: dict[str, int] = {}
    for lease in sorted(on_device, key=lambda x: (x.used_bytes - x.length_bytes, x.lease_id)):
        if need <= 0:
            break
        slack = max(0, lease.length_bytes - lease.used_bytes)
        take = min(slack - slack % max(1, device.alignment_bytes), need)
        if take > 0:
            asked_unused[lease.lease_id] = take
            need -= take
    tenant_replicas: dict[int, int] = defaultdict(int)
    for lease in on_device:
        tenant_replicas[lease.tenant_id] += max(0, lease.replica_bytes)
    asked_replica: dict[str, int] = {}
    asked_exclusive: dict[str, int] = {}
    # Replicas first: the tenant with most replica bytes, its biggest lease first.
    by_replicas = sorted(
        (lease for lease in on_device if lease.replica_bytes > 0),
        key=lambda x: (-tenant_replicas[x.tenant_id], x.tenant_id, -x.replica_bytes, x.lease_id),
    )
    for lease in by_replicas:
        if need <= 0:
            break
        take = min(lease.replica_bytes, need)
        asked_replica[lease.lease_id] = take
        need -= take
    # Every replica byte is asked for and it is not enough: exclusive bytes, biggest first.
    by_exclusive = sorted(
        (lease for lease in on_device if lease.exclusive_bytes > 0),
        key=lambda x: (-x.exclusive_bytes, x.lease_id),
    )
    for lease in by_exclusive:
        if need <= 0:
            break
        take = min(lease.exclusive_bytes, need)
        asked_exclusive[lease.lease_id] = take
        need -= take
    out: list[ShrinkRequest] = []
    for lease in on_device:
        unused = asked_unused.get(lease.lease_id, 0)
        replica = asked_replica.get(lease.lease_id, 0)
        exclusive = asked_exclusive.get(lease.lease_id, 0)
        if unused + replica + exclusive > 0:
            out.append(
                ShrinkRequest(
                    lease_id=lease.lease_id,
                    device_id=device.device_id,
                    target_bytes=unused + replica + exclusive,
                    replica_bytes=replica,
                    deadline_at=deadline_at,
                )
            )
    out.sort(key=lambda r: (-r.replica_bytes, -r.target_bytes, r.lease_id))
    return Plan(recalls, out)


def plan(
    devices: Iterable[DeviceFree],
    leases: Iterable[LeaseUse],
    *,
    watermark: float = DEFAULT_WATERMARK,
    now: datetime,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> list[ShrinkRequest]:
    """Shrink requests for every device under its watermark (0 turns pressure off)."""
    return plan_all(
        devices, leases, (), watermark=watermark, now=now, deadline_s=deadline_s
    ).shrinks


def plan_all(
    devices: Iterable[DeviceFree],
    leases: Iterable[LeaseUse],
    reservations: Iterable[ReservationUse],
    *,
    watermark: float = DEFAULT_WATERMARK,
    now: datetime,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Plan:
    """Recalls and shrink requests for every device under its watermark (0: off)."""
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}")
    devices = list(devices)
    if watermark == 0 and not any(d.wanted_bytes for d in devices):
        return Plan([], [])
    deadline_at = now + timedelta(seconds=deadline_s)
    by_device: dict[int, list[LeaseUse]] = defaultdict(list)
    for lease in leases:
        by_device[lease.device_id].append(lease)
    held: dict[int, list[ReservationUse]] = defaultdict(list)
    for r in reservations:
        held[r.device_id].append(r)
    recalls: list[str] = []
    shrinks: list[ShrinkRequest] = []
    for device in devices:
        one = plan_device_with(
            device, by_device[device.device_id], held[device.device_id], watermark, deadline_at
        )
        recalls.extend(one.recalls)
        shrinks.extend(one.shrinks)
    return Plan(recalls, shrinks)
