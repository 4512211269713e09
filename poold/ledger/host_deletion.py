"""How does a host leave the pool for good? `delete_host`: a host without live leases
(or, with `force`, once they are ended) goes, with its credential, its paths and the
devices only it reached.

`poolctl hosts delete --force` does not come here first: it drains the host, revokes
its leases due now so the agent tears them down and tells their tenants, and waits for
that or for the agent to go (cli/host_removal.py); `force` here then ends only what no
agent is left to confirm.

Its own module (it was part of admin_ops.py): deleting ends leases no agent will
confirm, quarantines ranges nobody zeroed and removes devices, all in one transaction,
which none of the lease or drain operations (poold/ledger/admin_ops.py, draining.py) do.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import Connection, func, insert, select
from sqlalchemy.orm import Session

from poold.errors import HostBusy
from poold.lease_states import LIVE_STATE_VALUES, LeaseEvent, LeaseState, next_state
from poold.ledger import hosts, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Host, Lease, Quarantine
from poold.ledger.reaper import reclaim_event
from poold.ledger.types import utcnow
from poold.wire.admin import HostDeleted

log = logging.getLogger(__name__)


def delete_host(ledger: Ledger, name: str, actor: str, *, force: bool = False) -> HostDeleted:
    """Delete a host: refused (`host_busy`) while it holds live leases, unless `force`.

    One transaction. It first bumps the host's generation, so a grant racing it
    either committed before (and is seen here as a live lease) or loses its swap.
    With `force` every live lease of the host is ended at once, with an event per
    move: the host is going away and no agent will confirm or report anything, so the
    memory of a memfd lease goes with the host (granted → aborted; active/expired →
    revoked → reclaimed; orphaned/revoking → reclaimed; released_mapped /
    revoked_mapped → unmapped).
    A devdax range nobody zeroed (scrubbing) is quarantined (`scrub_failed`): the
    bytes may hold the tenant's data, and no agent of this host is left to zero them.
    Then each device only this host reaches leaves placement (`hosts.remove` takes its
    paths): deleted when no lease ever used it, else `missing` (as for a device no
    agent reports; it is online again if a host's agent reports it again). The
    credential stops matching in the same commit (`hosts.remove`).
    """

    def attempt() -> HostDeleted:
        with ledger.write() as s:
            conn = s.connection()
            host = hosts.get_by_name(s, name)
            transitions.swap_or_rerun(conn, Host, host.id, host.generation)
            live = _live_leases(s, host.id)
            if live and not force:
                raise HostBusy(
                    f"host {name!r} still holds {live} live lease(s): end them first "
                    "(`poolctl leases end`, `hosts drain --now`) or delete with --force",
                    host=name,
                    live_leases=live,
                )
            now = utcnow()
            ended, quarantined = (
                _end_host_leases(conn, host.id, name, actor, now) if live else ([], [])
            )
            missing, removed = _devices_of_deleted_host(s, host.id, name, actor, now)
            kept = hosts.remove(
                s,
                host,
                actor,
                {
                    "forced": force,
                    "ended_leases": len(ended),
                    "devices_missing": missing,
                    "devices_removed": removed,
                },
            )
            return HostDeleted(
                name=name,
                ended_leases=ended,
                quarantined_leases=quarantined,
                devices_missing=missing,
                devices_removed=removed,
                history_kept=kept,
            )

    out = transitions.retrying(attempt, what=f"the deletion of host {name!r}")
    log.info(
        "host %s deleted by %s: %d lease(s) ended, devices missing %s, removed %s",
        name,
        actor,
        len(out.ended_leases),
        out.devices_missing,
        out.devices_removed,
    )
    return out


# The moves that end a lease of a host that is going away, from each live state (the
# last one to `scrubbing` for a devdax range is followed by a quarantine).
def _host_gone_events(state: LeaseState, kind: str) -> list[LeaseEvent]:
    reclaim = reclaim_event(kind)
    return {
        LeaseState.GRANTED: [LeaseEvent.ABORT],
        LeaseState.ACTIVE: [LeaseEvent.REVOKE, reclaim],
        LeaseState.EXPIRED: [LeaseEvent.REVOKE, reclaim],
        LeaseState.ORPHANED: [reclaim],
        LeaseState.REVOKING: [reclaim],
        LeaseState.SCRUBBING: [],
        # A memfd still mapped on the host: its pages go with the host.
        LeaseState.RELEASED_MAPPED: [LeaseEvent.UNMAPPED],
        LeaseState.REVOKED_MAPPED: [LeaseEvent.UNMAPPED],
    }[state]


def _end_host_leases(
    conn: Connection, host_id: int, name: str, actor: str, now: datetime
) -> tuple[list[str], list[str]]:
    """End every live lease of the host in this transaction; (ended ids, quarantined ids)."""
    rows = conn.execute(
        select(
            Lease.id,
            Lease.state,
            Lease.tenant_id,
            Lease.host_id,
            Lease.device_id,
            Lease.offset_bytes,
            Lease.length_bytes,
            Device.kind,
        )
        .join(Device, Device.id == Lease.device_id)
        .where(Lease.host_id == host_id, Lease.state.in_(LIVE_STATE_VALUES))
        .order_by(Lease.id)  # lock order (transitions.py)
        .with_for_update(of=Lease)
    ).all()
    reason = f"host {name} deleted"
    ended: list[str] = []
    quarantined: list[str] = []
    for row in rows:
        state = LeaseState(row.state)
        for event in _host_gone_events(state, row.kind):
            values = {"expires_at": now} if event is LeaseEvent.REVOKE else None
            if not transitions.move_if(
                conn,
                row.id,
                state,
                event,
                actor=actor,
                reason=reason,
                now=now,
                values=values,
                lease=row,
            ):
                raise transitions.LostRace("leases")
            state = next_state(state, event)
        if state is LeaseState.SCRUBBING:
            # No agent of this host will zero the range: never hand it out again.
            if not transitions.move_if(
                conn,
                row.id,
                state,
                LeaseEvent.SCRUB_FAILED,
                actor=actor,
                reason=f"{reason}: no agent left to zero the range",
                now=now,
                lease=row,
            ):
                raise transitions.LostRace("leases")
            conn.execute(
                insert(Quarantine).values(
                    device_id=row.device_id,
                    offset_bytes=row.offset_bytes,
                    length_bytes=row.length_bytes,
                    created_at=now,
                    reason=f"lease {row.id} of deleted host {name} was never zeroed",
                )
            )
            quarantined.append(row.id)
        ended.append(row.id)
    return ended, quarantined


def _devices_of_deleted_host(
    session: Session, host_id: int, name: str, actor: str, now: datetime
) -> tuple[list[str], list[str]]:
    """Devices only this host reaches leave placement: (uids now missing, uids deleted)."""
    mine = list(
        session.scalars(
            select(Device)
            .join(DevicePath, DevicePath.device_id == Device.id)
            .where(DevicePath.host_id == host_id)
            .order_by(Device.id)
        )
    )
    missing: list[str] = []
    removed: list[str] = []
    for dev in mine:
        others = session.scalar(
            select(DevicePath.id)
            .where(
                DevicePath.device_id == dev.id,
                DevicePath.host_id != host_id,
                DevicePath.present.is_(True),
            )
            .limit(1)
        )
        if others is not None:
            continue  # another host still reaches it: only this host's path goes
        used = session.scalar(select(Lease.id).where(Lease.device_id == dev.id).limit(1))
        if used is None:
            hosts.delete_cascading(session, "devices", dev.id)  # paths, quarantine...
            session.delete(dev)
            removed.append(dev.uid)
            kind = "device.remove"
        else:
            if dev.state == "online":
                dev.state = "missing"
            dev.updated_at = now
            missing.append(dev.uid)
            kind = "device.missing"
        transitions.record(
            session,
            transitions.event_row(
                at=now,
                actor=actor,
                kind=kind,
                device_id=dev.id,
                host_id=host_id,
                reason=f"host {name} deleted",
                detail={"uid": dev.uid},
            ),
        )
    session.flush()
    return missing, removed


def _live_leases(session: Session, host_id: int) -> int:
    return int(
        session.scalar(
            select(func.count(Lease.id)).where(
                Lease.host_id == host_id, Lease.state.in_(LIVE_STATE_VALUES)
            )
        )
        or 0
    )
