"""What does one heartbeat change in the ledger, and what does poold tell the agent back?

A heartbeat brings the host's inventory (devices and how the host reaches them),
every renewal the agent holds for its tenants, the holders' accounting reports,
and what the agent holds memory for. Applying it answers with the renewals'
results, what to revoke, what to scrub, and how much memory to give back under
pressure (poold/pressure.py). Everything happens in the heartbeat's one
transaction; an agent's report is stored for the audit as
poold/ledger/agent_reports.py says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ScalarSelect, func, select
from sqlalchemy.orm import Session

from poold import extents, pressure
from poold.errors import BadRequest, LeaseNotActive, NotOwner, PoolError, UnknownLease
from poold.lease_states import LIVE_STATE_VALUES, LeaseState
from poold.ledger import (
    accounting,
    agent_reports,
    delegation,
    delegation_renewal,
    device_hosts,
    devices,
    hosts,
    leases,
    mapped,
    news,
    transitions,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Event, Host, Lease, Quarantine, Reservation
from poold.ledger.types import check_ints_fit, utcnow
from poold.wire.agent import (
    Heartbeat,
    HeartbeatReply,
    InventoryDevice,
    LeaseReport,
    LeftoverSubDevice,
    ReportRefusal,
    Revocation,
    ScrubOrder,
    ShrinkHint,
)

# How far past "now" a revoked lease still mapped by its live holder is held each
# heartbeat: it stays revoking (its bytes used) while the agent keeps reporting it.
REVOKED_HELD_EXTENSION_S = 60.0


def upsert_inventory(
    session: Session, host: Host, inventory: list[InventoryDevice]
) -> list[ReportRefusal]:
    """Make devices and device_paths match what the host's agent sees; the items refused.

    A device that vanished from the host's inventory keeps its row (leases and
    history point at it); its path is marked absent, and a device no host
    reaches any more becomes `missing` so placement skips it. An item for a device
    the host is not bound to (poold/ledger/device_hosts.py) touches nothing: no
    device field, no path; it counts as vanished from this host.
    """
    now = utcnow()
    seen: set[int] = set()
    refused: list[ReportRefusal] = []
    for item in inventory:
        reported = item.model_dump()
        check_ints_fit(Device.__table__, reported)
        check_ints_fit(DevicePath.__table__, reported)
        dev = session.scalar(select(Device).where(Device.uid == item.uid))
        err = device_hosts.refusal(session, host, item.uid, dev)
        if err is not None:
            device_hosts.log_refusal(host.name, item.uid, err.message)
            refused.append(ReportRefusal(device_uid=item.uid, code=err.code, message=err.message))
            continue
        device_hosts.forget_refusal(host.name, item.uid)
        first_sight = dev is None
        if dev is None:
            dev = Device(
                uid=item.uid,
                kind=item.kind,
                state="online",
                generation=0,
                created_at=now,
                capacity_bytes=item.capacity_bytes,
                alignment_bytes=item.alignment_bytes,
            )
            session.add(dev)
        dev.kind = item.kind
        # What the agent says about media/recycled/provenance/cost; an administrator's
        # annotation of the same field still wins (devices.apply_effective).
        dev.reported_annotations = devices.reported(item)
        if dev.admin_annotations is None:
            dev.admin_annotations = {}  # a row not yet flushed has no column default yet
        devices.apply_effective(dev)
        dev.capacity_bytes = item.capacity_bytes
        dev.alignment_bytes = item.alignment_bytes
        dev.health = item.health
        dev.health_reasons = list(item.health_reasons)
        dev.memdev_serials = list(item.memdev_serials)
        devices.set_reserved(session, dev, item)  # never placed on (dax devices poold did not make)
        if dev.state == "missing":
            dev.state = "online"
        dev.updated_at = now
        session.flush()
        if first_sight:
            device_hosts.bind(session, dev.id, host.id, "first_sight")
        seen.add(dev.id)
        path = session.scalar(
            select(DevicePath).where(DevicePath.device_id == dev.id, DevicePath.host_id == host.id)
        )
        if path is None:
            path = DevicePath(device_id=dev.id, host_id=host.id)
            session.add(path)
        path.local_name = item.local_name
        path.numa_node = item.numa_node
        path.read_latency_ns = item.read_latency_ns
        path.write_latency_ns = item.write_latency_ns
        path.read_bandwidth_mbps = item.read_bandwidth_mbps
        path.write_bandwidth_mbps = item.write_bandwidth_mbps
        path.distance = item.distance
        path.memory_tier = item.memory_tier
        path.present = True
        path.seen_at = now
    for path in session.scalars(select(DevicePath).where(DevicePath.host_id == host.id)):
        if path.device_id in seen or not path.present:
            continue
        path.present = False
        others = session.scalar(
            select(DevicePath.id)
            .where(
                DevicePath.device_id == path.device_id,
                DevicePath.present.is_(True),
                DevicePath.host_id != host.id,
            )
            .limit(1)
        )
        if others is None:
            dev = session.get(Device, path.device_id)
            if dev is not None and dev.state == "online":
                dev.state = "missing"
                transitions.record(
                    session,
                    transitions.event_row(
                        actor=f"host:{host.name}",
                        kind="device.missing",
                        device_id=dev.id,
                        host_id=host.id,
                    ),
                )
    return refused


def _leases(session: Session, lease_ids: Sequence[str]) -> dict[str, Lease]:
    """Several leases in one locked query per chunk, as the database has them now.

    populate_existing: the heartbeat's renewals are Core statements, so a lease
    object this session loaded before them would otherwise keep its old state.
    """
    out: dict[str, Lease] = {}
    for chunk in transitions.chunks(transitions.lock_order(lease_ids)):
        stmt = (
            select(Lease)
            .where(Lease.id.in_(chunk))
            .order_by(Lease.id)  # lock order (transitions.py)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
        out.update((lease.id, lease) for lease in session.scalars(stmt))
    return out


def store_reports(
    session: Session, host: Host, reports: list[LeaseReport], now: datetime
) -> list[ReportRefusal]:
    """Store each lease's latest accounting report; refuse (per item) what cannot be true.

    A report is for a lease held on this host whose holder still has the memory
    (accounting.MEMORY_HELD); anything else is refused with the code a lease call
    would get (unknown_lease, not_owner, lease_not_active) and the rest still apply.
    """
    latest = {r.lease_id: r for r in reports}  # the last report of a lease in a batch wins
    ids = sorted(latest)
    found = _leases(session, ids)
    refused: list[ReportRefusal] = []
    for lease_id in ids:
        report = latest[lease_id]
        lease = found.get(lease_id)
        err: PoolError | None = None
        if lease is None:
            err = UnknownLease(f"no lease {lease_id!r}")
        elif lease.host_id != host.id:
            err = NotOwner(f"lease {lease_id} is not held on host {host.name!r}")
        elif lease.state not in accounting.MEMORY_HELD:
            err = LeaseNotActive(f"lease {lease_id} is {lease.state}; its report is not stored")
        else:
            problem = accounting.report_problem(report, lease.length_bytes)
            if problem is not None:
                err = BadRequest(f"report for lease {lease_id}: {problem}")
        if err is not None:
            refused.append(ReportRefusal(lease_id=lease_id, code=err.code, message=err.message))
            continue
        assert lease is not None
        lease.used_bytes = report.used_bytes
        lease.exclusive_bytes = report.exclusive_bytes
        lease.replica_bytes = report.replica_bytes
        lease.exclusive_blocks = report.exclusive_blocks
        lease.replica_blocks = report.replica_blocks
        lease.reported_at = now
    return refused


def shrink_hints(
    session: Session,
    host: Host,
    now: datetime,
    watermark: float,
    deadline_s: float,
    wanted_bytes: int = 0,
) -> list[ShrinkHint]:
    """Pressure on the devices this host reaches: what its leases' tenants should give back.

    The plan (poold/pressure.py) covers every lease and reservation on those devices,
    whichever host holds it, so each host's heartbeat asks its own share of the same
    plan. Reservations with no lease inside are asked back first (`delegation_renewal.recall`,
    in this transaction): their hosts hear it from the delegation in their next reply
    (this one's own included: the reply's delegation is read after this) and give them
    back; other hosts are told to heartbeat now (poold/ledger/news.py).
    """
    if watermark <= 0 and wanted_bytes <= 0:
        _clear_shrink_requests(session, host)
        return []
    reached = list(
        session.scalars(
            select(Device)
            .join(DevicePath, DevicePath.device_id == Device.id)
            .where(DevicePath.host_id == host.id, DevicePath.present.is_(True))
        )
    )
    if not reached:
        _clear_shrink_requests(session, host)
        return []
    ids = [d.id for d in reached]
    live = LIVE_STATE_VALUES
    # Reserved extents (dax devices poold did not place) are neither free nor givable.
    used = {d.id: devices.reserved(d.reserved_extents) for d in reached}
    uses: list[pressure.LeaseUse] = []
    busy: set[str] = set()  # reservations a live lease lies in
    mine: list[Lease] = []  # this host's: its heartbeat asks (and records) their share
    not_yet_asked: dict[str, int] = {}  # other hosts' leases no heartbeat asked yet: host
    for lease in session.scalars(
        select(Lease)
        .where(Lease.device_id.in_(ids), Lease.state.in_(live))
        .execution_options(populate_existing=True)  # as _leases: after Core renewals
    ):
        used[lease.device_id].append(extents.Extent(lease.offset_bytes, lease.length_bytes))
        if lease.reservation_id is not None:
            busy.add(lease.reservation_id)
        if lease.host_id == host.id:
            mine.append(lease)
        elif lease.shrink_deadline_at is None:
            not_yet_asked[lease.id] = lease.host_id
        uses.append(
            pressure.LeaseUse(
                lease_id=lease.id,
                tenant_id=lease.tenant_id,
                device_id=lease.device_id,
                length_bytes=lease.length_bytes,
                # Only a holder that still has the memory can give some back.
                reported=lease.reported_at is not None and lease.state in accounting.MEMORY_HELD,
                used_bytes=lease.used_bytes,
                exclusive_bytes=lease.exclusive_bytes,
                replica_bytes=lease.replica_bytes,
            )
        )
    for device_id, offset, length in session.execute(
        select(Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes).where(
            Quarantine.device_id.in_(ids)
        )
    ):
        used[device_id].append(extents.Extent(offset, length))
    held: list[pressure.ReservationUse] = []
    owner: dict[str, int] = {}
    for rid, rhost, device_id, offset, length, state in session.execute(
        select(
            Reservation.id,
            Reservation.host_id,
            Reservation.device_id,
            Reservation.offset_bytes,
            Reservation.length_bytes,
            Reservation.state,
        ).where(Reservation.device_id.in_(ids))
    ):
        # Reserved bytes are not free: the leases inside are counted already (overlap
        # is harmless to free_bytes, which merges), the rest is reserved but unleased.
        used[device_id].append(extents.Extent(offset, length))
        owner[rid] = rhost
        held.append(
            pressure.ReservationUse(
                reservation_id=rid,
                device_id=device_id,
                length_bytes=length,
                empty=rid not in busy,
                # Asked back already, or returning (it goes once empty): on its way back.
                recalled=state != delegation.HELD,
            )
        )
    free = [
        pressure.DeviceFree(
            d.id,
            devices.usable_capacity_bytes(d),  # the watermark is of what leases can use
            extents.free_bytes(d.capacity_bytes, used[d.id]),
            alignment_bytes=d.alignment_bytes,
        )
        for d in reached
    ]
    if wanted_bytes > 0:
        # A lease waits on this host: make room on the reachable device that can give
        # most (free now, plus what its reporting leases leave unused or hold as replicas).
        def givable(d: pressure.DeviceFree) -> int:
            on = [u for u in uses if u.device_id == d.device_id and u.reported]
            unleased = sum(r.length_bytes for r in held if r.device_id == d.device_id and r.empty)
            return (
                d.free_bytes
                + unleased
                + sum(max(0, u.length_bytes - u.used_bytes) + u.replica_bytes for u in on)
            )

        best = max(free, key=givable)
        free = [dataclasses.replace(d, wanted_bytes=wanted_bytes) if d is best else d for d in free]
    planned = pressure.plan_all(
        free, uses, held, watermark=watermark, now=now, deadline_s=deadline_s
    )
    recalled = delegation_renewal.recall(
        session.connection(), planned.recalls, "poold", "pressure: reserved but unleased"
    )
    asked = {r.lease_id: r for r in planned.shrinks}
    # Other hosts' leases the plan asks for the first time, and the hosts of reservations
    # it asks back: their agents heartbeat now (poold/ledger/news.py).
    news.tell(
        session.connection(),
        {h for i, h in not_yet_asked.items() if i in asked}
        | {owner[r] for r in recalled if owner[r] != host.id},
    )
    hints: list[ShrinkHint] = []
    for lease in mine:
        request = asked.get(lease.id)
        if request is None:
            if lease.shrink_deadline_at is not None:  # pressure gone: nothing to revoke
                lease.shrink_wanted_bytes = None
                lease.shrink_deadline_at = None
            continue
        # The first ask sets the deadline; later heartbeats keep it, so a holder
        # that never gives back is revoked then (reaper), not asked forever.
        if lease.shrink_deadline_at is None:
            lease.shrink_deadline_at = request.deadline_at
        lease.shrink_wanted_bytes = request.target_bytes
        hints.append(
            ShrinkHint(
                lease_id=request.lease_id,
                target_bytes=request.target_bytes,
                replica_bytes=request.replica_bytes,
                deadline_at=lease.shrink_deadline_at,
            )
        )
    return hints


def _clear_shrink_requests(session: Session, host: Host) -> None:
    """Pressure is off for this host: drop its leases' pending requests and deadlines."""
    transitions.update_leases(
        session,
        (Lease.host_id == host.id, Lease.shrink_deadline_at.is_not(None)),
        {"shrink_wanted_bytes": None, "shrink_deadline_at": None},
    )


def held_but_ended(session: Session, host: Host, held: list[str]) -> list[str]:
    """Lease ids the agent holds memory for that the ledger has, but not live here.

    An id the ledger has no row of at all is not ended: it is a lease the agent granted
    alone inside its delegation whose local_grant is still on its way (local grants
    reach poold seconds behind under load; a central lease is in the ledger before its
    agent holds it, and lease rows are never deleted). Its commit decides its fate."""
    live: set[str] = set()
    known: set[str] = set()
    for chunk in transitions.chunks(held):
        for lease_id, host_id, state in session.execute(
            select(Lease.id, Lease.host_id, Lease.state).where(Lease.id.in_(chunk))
        ):
            known.add(lease_id)
            if host_id == host.id and state in LIVE_STATE_VALUES:
                live.add(lease_id)
    return [lease_id for lease_id in held if lease_id in known and lease_id not in live]


def hold_revoked(session: Session, host: Host, lease_ids: list[str], now: datetime) -> None:
    """Keep revoked-but-still-mapped memfd leases from being reclaimed under their holder."""
    until = now + timedelta(seconds=REVOKED_HELD_EXTENSION_S)
    for chunk in transitions.chunks(transitions.lock_order(lease_ids)):
        transitions.update_leases(
            session,
            (
                Lease.id.in_(chunk),
                Lease.host_id == host.id,
                Lease.state == LeaseState.REVOKING.value,
                Lease.expires_at < until,
            ),
            {"expires_at": until},
        )


def leftover_revocations(
    session: Session, host_id: int, leftovers: list[LeftoverSubDevice], now: datetime
) -> list[Revocation]:
    """Revocations for the leftovers `audit --reclaim` ordered deleted on this host.

    Queried only when the agent reports leftovers (none in the steady state).
    """
    ids = sorted({x.lease_id for x in leftovers})
    ordered: set[str] = set()
    for chunk in transitions.chunks(ids):
        ordered.update(
            str(lease_id)
            for lease_id in session.scalars(
                select(Event.lease_id)
                .where(
                    Event.kind == agent_reports.LEFTOVER_DELETE,
                    Event.host_id == host_id,
                    Event.lease_id.in_(chunk),
                )
                .distinct()
            )
        )
    return [
        Revocation(
            lease_id=lease_id,
            reason="leftover sub-device of an ended lease: delete it (audit --reclaim)",
            deadline_at=now,
        )
        for lease_id in ids
        if lease_id in ordered
    ]


def scrub_reissued_at() -> ScalarSelect[Any]:
    """Correlated to `Lease`: when `audit --reclaim` last re-issued that lease's scrub order.

    A column of the heartbeat's scrub-order query (one statement, evaluated only for
    the host's scrubbing leases; events are indexed by lease id).
    """
    return (
        select(func.max(Event.at))
        .where(Event.lease_id == Lease.id, Event.kind == agent_reports.SCRUB_REISSUE)
        .correlate(Lease)
        .scalar_subquery()
    )


def heartbeat(
    session: Session,
    host: Host,
    beat: Heartbeat,
    *,
    pressure_watermark: float = pressure.DEFAULT_WATERMARK,
    shrink_deadline_s: float = pressure.DEFAULT_DEADLINE_S,
    delegation_policy: delegation.DelegationPolicy = delegation.DEFAULT_POLICY,
) -> HeartbeatReply:
    """Apply one heartbeat: inventory, every renewal on the host, and what to revoke."""
    now = utcnow()
    if host.status != "draining":
        host.status = "up"
    host.last_heartbeat_at = now
    host.agent_version = beat.agent_version or host.agent_version
    want_inventory = False
    inventory_errors: list[ReportRefusal] = []
    if beat.inventory is not None:
        inventory_errors = upsert_inventory(session, host, beat.inventory)
        host.inventory_digest = beat.inventory_digest
    elif beat.inventory_digest != host.inventory_digest:
        want_inventory = True
    # Each renewal checks before it writes, so a refusal leaves nothing half-done.
    renewed = leases.renew_all(session.connection(), host.id, host.name, beat.renewals, now)
    # The host's reservations and budgets live on (or go back, off a draining device).
    delegated = delegation.has_any(session.connection(), host.id)
    if delegated:
        delegation_renewal.renew(session.connection(), host.id, host.status, now, delegation_policy)
    # After the renewals: a lease that lazily expired just now still held its memory.
    report_errors = store_reports(session, host, beat.reports, now) if beat.reports else []
    if beat.revoked_held:
        hold_revoked(session, host, beat.revoked_held, now)
    ended: list[str] = []
    held = beat.held_ids()  # an older agent's ids, or the ids of a newer one's report
    if held is not None:
        # A newer agent's report (holders, sub-devices, scrubs, leftovers) is stored
        # whole for the audit; an older agent's ids as before (agent_reports.parse_stored).
        host.agent_leases = agent_reports.stored_report(beat)
        host.agent_leases_at = now
        ended = held_but_ended(session, host, held)
    ended_mapped: list[str] = []
    if beat.held_leases is not None:
        # Ended memfd leases still mapped: freed once the agent reports them no more.
        reported = {x.lease_id: x.state for x in beat.held_leases}
        ended_mapped = mapped.settle_mapped(session.connection(), host.id, host.name, reported, now)
    revoking = session.execute(
        select(Lease.id, Lease.expires_at).where(
            Lease.host_id == host.id, Lease.state == LeaseState.REVOKING.value
        )
    )
    # A revoking lease's expires_at is the revocation deadline (reaper.revoke_in).
    revocations = [
        Revocation(lease_id=lease_id, reason="revoked", deadline_at=expires_at)
        for lease_id, expires_at in revoking
    ]
    # Memory the agent still holds for leases the ledger ended (an admin release,
    # a reclaim while the agent was away): take it back now.
    revocations += [
        Revocation(lease_id=lease_id, reason="the ledger ended this lease", deadline_at=now)
        for lease_id in ended
    ]
    revocations += [
        Revocation(lease_id=lease_id, reason="ended while its memfd is mapped", deadline_at=now)
        for lease_id in ended_mapped
    ]
    if beat.leftovers:
        # Leftover sub-devices `poolctl audit --reclaim` ordered deleted (no query
        # unless the agent reports leftovers).
        revocations += leftover_revocations(session, host.id, beat.leftovers, now)
    scrub = [
        ScrubOrder(
            lease_id=lease_id,
            device_uid=uid,
            offset_bytes=offset,
            length_bytes=length,
            reissued_at=reissued_at,
        )
        for lease_id, uid, offset, length, reissued_at in session.execute(
            select(
                Lease.id,
                Device.uid,
                Lease.offset_bytes,
                Lease.length_bytes,
                scrub_reissued_at(),  # set by `poolctl audit --reclaim`
            )
            .join(Device, Device.id == Lease.device_id)
            .where(Lease.host_id == host.id, Lease.state == LeaseState.SCRUBBING.value)
        )
    ]
    # After the reports: what tenants already gave back is not asked again.
    shrink = shrink_hints(
        session,
        host,
        now,
        pressure_watermark,
        shrink_deadline_s,
        wanted_bytes=beat.admission_wanted_bytes,
    )
    # After pressure: a reservation it asked back is not in the delegation the agent gets.
    held_delegation = (
        delegation.host_delegation(session.connection(), host.id, now) if delegated else None
    )
    return HeartbeatReply(
        server_time=now,
        renewed=renewed,
        revocations=revocations,
        scrub=scrub,
        report_errors=report_errors,
        inventory_errors=inventory_errors,
        want_inventory=want_inventory,
        delegation=held_delegation,
        shrink=shrink,
    )


# --- entry point: owns its transaction (the API opens none) -------------------------


def receive_heartbeat(
    ledger: Ledger,
    host_name: str,
    beat: Heartbeat,
    actor: str,
    *,
    register: bool = False,
    pressure_watermark: float = pressure.DEFAULT_WATERMARK,
    shrink_deadline_s: float = pressure.DEFAULT_DEADLINE_S,
    delegation_policy: delegation.DelegationPolicy = delegation.DEFAULT_POLICY,
) -> HeartbeatReply:
    """One heartbeat (or the agent's first, `register`, journalled) in one transaction.

    Run again from the start if the database aborts it (a deadlock with a batch
    or the reaper): nothing of the aborted attempt committed.
    """

    def attempt() -> HeartbeatReply:
        with ledger.write() as session:
            host = hosts.get_by_name(session, host_name)
            if register:
                transitions.record(
                    session,
                    transitions.event_row(
                        actor=actor,
                        kind="host.register",
                        host_id=host.id,
                        detail={
                            "agent_version": beat.agent_version,
                            "devices": len(beat.inventory or []),
                        },
                    ),
                )
            return heartbeat(
                session,
                host,
                beat,
                pressure_watermark=pressure_watermark,
                shrink_deadline_s=shrink_deadline_s,
                delegation_policy=delegation_policy,
            )

    return transitions.retrying(attempt, what=f"heartbeat of {host_name}")
