"""How does an administrator take memory back? Revoking leases and draining devices and hosts.

* `revoke_lease`: active/orphaned/expired → revoking. The agent learns it from
  its next heartbeat reply (`revocations`), tears the memory down and confirms
  (`confirm_revoked` → reclaimed); if it does not confirm by the deadline, the
  reaper reclaims the lease anyway.
* `drain_device`: the device goes `draining`, so placement skips it; its live
  leases are revoked at the deadline (by the reaper) or at once (`now`).
  The deadline is kept in the `device.drain` event, the journal of the drain.
* `drain_host`: the host goes `draining`; grants on it are refused. Its leases
  live on until they end, unless the drain has a deadline: then the reaper
  revokes them when it passes (or `drain_host` at once, with `now`). As for a
  device, the deadline is kept in the `host.drain` event; `undrain` cancels it.
* A device's drain and undrain bump its generation with a compare-and-swap, as a
  grant does: a grant that read the device before the drain committed then
  fails its own swap and reads `draining` (STYLE.md pattern 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import func, select, update

from poold.errors import (
    BadRequest,
    GenerationConflict,
    InvalidTransition,
    NotOwner,
    PoolError,
    UnknownLease,
)
from poold.lease_states import LIVE_STATE_VALUES, LeaseEvent, LeaseState, next_state
from poold.ledger import devices, hosts, lease_views, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Host, Lease
from poold.ledger.reaper import reclaim_event, revoke_in, revoke_matching
from poold.ledger.types import utcnow
from poold.wire.admin import DrainResult
from poold.wire.agent import LeaseOpResult
from poold.wire.common import LeaseOut


def revoke_lease(
    ledger: Ledger, lease_id: str, reason: str, actor: str, *, deadline_s: float
) -> LeaseOut:
    """Revoke one lease; the agent has `deadline_s` to give the memory back."""
    for _attempt in range(3):
        with ledger.read() as s:
            state = s.scalar(select(Lease.state).where(Lease.id == lease_id))
        if state is None:
            raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
        before = LeaseState(state)
        next_state(before, LeaseEvent.REVOKE)  # invalid_transition for any other state
        if revoke_in(
            ledger,
            lease_id,
            before,
            actor=actor,
            reason=reason,
            now=utcnow(),
            deadline_s=deadline_s,
        ):
            return lease_views.show(ledger, lease_id)
        # Lost a race (the holder released, the reaper expired it): look again.
    raise GenerationConflict(f"lease {lease_id} kept changing state; retry", lease_id=lease_id)


def confirm_revoked(
    ledger: Ledger, host_name: str, lease_ids: Sequence[str], actor: str
) -> list[LeaseOpResult]:
    """The agent tore these revoked leases down: revoking → reclaimed, each on its own."""
    results: list[LeaseOpResult] = []
    now = utcnow()
    for lease_id in lease_ids:
        try:
            with ledger.write() as s:
                conn = s.connection()
                row = conn.execute(
                    select(Lease.state, Lease.host_id, Device.kind, Host.name)
                    .join(Device, Device.id == Lease.device_id)
                    .join(Host, Host.id == Lease.host_id)
                    .where(Lease.id == lease_id)
                ).one_or_none()
                if row is None:
                    raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
                if row.name != host_name:
                    raise NotOwner(
                        f"lease {lease_id} is not held on host {host_name!r}", lease_id=lease_id
                    )
                if row.state != LeaseState.REVOKING.value:
                    raise InvalidTransition(
                        f"lease {lease_id} is {row.state}, not revoking", state=row.state
                    )
                event = reclaim_event(row.kind)
                after = next_state(LeaseState.REVOKING, event)
                moved = transitions.move_if(
                    conn,
                    lease_id,
                    LeaseState.REVOKING,
                    event,
                    actor=actor,
                    reason="revocation confirmed by the agent",
                    now=now,
                )
            if not moved:
                raise GenerationConflict(f"lease {lease_id} changed state meanwhile")
            results.append(LeaseOpResult(lease_id=lease_id, state=after.value))
        except PoolError as err:
            results.append(LeaseOpResult(lease_id=lease_id, code=err.code, message=err.message))
    return results


def drain_device(
    ledger: Ledger,
    uid: str,
    actor: str,
    *,
    deadline_s: float,
    now_: bool,
    revoke_deadline_s: float,
) -> DrainResult:
    """Stop placing on a device; revoke its live leases at the deadline, or at once."""
    now = utcnow()
    deadline = now if now_ else now + timedelta(seconds=deadline_s)

    def attempt() -> tuple[int, int]:
        with ledger.write() as s:
            dev = devices.get_by_uid(s, uid)
            if dev.state in ("retired",):
                raise BadRequest(f"device {uid!r} is {dev.state}; nothing to drain", uid=uid)
            before = dev.state
            # A grant that read the device as online before this commit swaps the
            # generation it read; this swap makes that grant fail, read again and
            # see `draining`. The state change rides on the swap, so it is applied
            # only if nothing moved the device since it was read.
            if not transitions.compare_and_bump(
                s.connection(), Device, dev.id, dev.generation, state="draining", updated_at=now
            ):
                raise transitions.LostRace
            transitions.record(
                s,
                transitions.event_row(
                    actor=actor,
                    kind="device.drain",
                    device_id=dev.id,
                    from_state=before,
                    to_state="draining",
                    reason="drain now" if now_ else f"drain within {deadline_s:g}s",
                    detail={"deadline_at": deadline.isoformat()},
                ),
            )
            live = int(
                s.scalar(
                    select(func.count(Lease.id)).where(
                        Lease.device_id == dev.id, Lease.state.in_(LIVE_STATE_VALUES)
                    )
                )
                or 0
            )
            return dev.id, live

    device_id, live = transitions.retrying(attempt, what=f"the drain of device {uid!r}")
    revoked: list[str] = []
    if deadline <= now:
        revoked = revoke_matching(
            ledger,
            [Lease.device_id == device_id],
            reason=f"device {uid} drained",
            actor=actor,
            now=now,
            deadline_s=revoke_deadline_s,
        )
    return DrainResult(
        target=uid, state="draining", deadline_at=deadline, live_leases=live, revoked=revoked
    )


def undrain_device(ledger: Ledger, uid: str, actor: str) -> DrainResult:
    """Put a draining device back online (leases already revoked stay revoked)."""

    def attempt() -> None:
        with ledger.write() as s:
            dev = devices.get_by_uid(s, uid)
            if dev.state != "draining":
                raise BadRequest(f"device {uid!r} is {dev.state}, not draining", uid=uid)
            if not transitions.compare_and_bump(
                s.connection(), Device, dev.id, dev.generation, state="online", updated_at=utcnow()
            ):
                raise transitions.LostRace
            transitions.record(
                s,
                transitions.event_row(
                    actor=actor,
                    kind="device.undrain",
                    device_id=dev.id,
                    from_state="draining",
                    to_state="online",
                ),
            )

    transitions.retrying(attempt, what=f"the undrain of device {uid!r}")
    return DrainResult(target=uid, state="online")


def drain_host(
    ledger: Ledger,
    name: str,
    actor: str,
    *,
    draining: bool = True,
    deadline_s: float | None = None,
    now_: bool = False,
    revoke_deadline_s: float = 30.0,
) -> DrainResult:
    """Mark a host draining (no new grants), or back to service with `draining=False`.

    With `deadline_s` its live leases are revoked when it passes (by the reaper),
    with `now_` at once; without either they run to their end.
    """
    now = utcnow()
    deadline = None
    if draining and (now_ or deadline_s is not None):
        deadline = now if now_ else now + timedelta(seconds=deadline_s or 0.0)
    with ledger.write() as s:
        host = hosts.get_by_name(s, name)
        before = host.status
        if draining:
            after = "draining"
        elif before != "draining":
            raise BadRequest(f"host {name!r} is {before}, not draining", host=name)
        else:
            # Back to `up`; the reaper marks it down again if its agent is silent.
            after = "up"
        host_id = host.id
        s.execute(update(Host).where(Host.id == host_id).values(status=after))
        reason: str | None = None
        if draining and deadline is None:
            reason = "drain: leases run to their end"
        elif draining:
            reason = "drain now" if now_ else f"drain within {deadline_s:g}s"
        transitions.record(
            s,
            transitions.event_row(
                actor=actor,
                kind="host.drain" if draining else "host.undrain",
                host_id=host_id,
                from_state=before,
                to_state=after,
                reason=reason,
                # The reaper reads the latest `host.drain` deadline (reaper.host_drain_deadlines).
                detail={"deadline_at": deadline.isoformat()} if deadline is not None else {},
            ),
        )
        live = int(
            s.scalar(
                select(func.count(Lease.id)).where(
                    Lease.host_id == host_id, Lease.state.in_(LIVE_STATE_VALUES)
                )
            )
            or 0
        )
    revoked: list[str] = []
    if deadline is not None and deadline <= now:
        revoked = revoke_matching(
            ledger,
            [Lease.host_id == host_id],
            reason=f"host {name} drained",
            actor=actor,
            now=now,
            deadline_s=revoke_deadline_s,
        )
    return DrainResult(
        target=name, state=after, deadline_at=deadline, live_leases=live, revoked=revoked
    )
