"""How does an administrator take memory back? Revoking leases and draining devices and hosts.

* `revoke_lease`: active/orphaned/expired → revoking. The agent learns it from
  its next heartbeat reply (`revocations`), tears the memory down and confirms
  (`confirm_revoked` → reclaimed); if it does not confirm by the deadline, the
  reaper reclaims the lease anyway.
* Draining a target, a device or a host, is one mechanism (`_drain`, `_undrain`):
  the target goes `draining`, so no new lease is placed on it; its live leases
  are revoked at the drain's deadline (by the reaper) or at once (`now`). The
  deadline is kept in the `device.drain` / `host.drain` event, the journal of
  the drain; undraining cancels it. A device drain always has a deadline; a host
  drain may have none, and then its leases run to their end.
* A drain and an undrain bump the target's generation (a device's or a host's)
  with a compare-and-swap, as a grant does: a grant that read the target before
  the drain committed then fails its own swap and reads `draining` (STYLE.md
  pattern 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

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
            moved, after = transitions.retrying(
                functools.partial(_confirm_one, ledger, host_name, lease_id, actor, now),
                what=f"confirmation of {lease_id}",
            )
            if not moved:
                raise GenerationConflict(f"lease {lease_id} changed state meanwhile")
            results.append(LeaseOpResult(lease_id=lease_id, state=after.value))
        except PoolError as err:
            results.append(LeaseOpResult(lease_id=lease_id, code=err.code, message=err.message))
    return results


def _confirm_one(
    ledger: Ledger, host_name: str, lease_id: str, actor: str, now: datetime
) -> tuple[bool, LeaseState]:
    """One confirmation in its own transaction: whether it moved the lease, and to what."""
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
            raise NotOwner(f"lease {lease_id} is not held on host {host_name!r}", lease_id=lease_id)
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
    return moved, after


# --- draining ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    """A drain target as one transaction read it."""

    id: int
    state: str
    generation: int


@dataclass(frozen=True)
class _Kind:
    """What differs between draining a device and draining a host; the rest is `_drain`."""

    noun: str  # "device" / "host": the events are `<noun>.drain` / `<noun>.undrain`
    name_key: str  # the detail key naming the target in a refusal
    in_service: str  # the state an undrain goes back to
    never_drained: tuple[str, ...]  # states a drain refuses
    find: Callable[[Session, str], _Found]
    # Set the target's state (and bump its generation, if it has one) where it still
    # is as `found`: False when another writer changed it since.
    set_state: Callable[[Connection, _Found, str, datetime], bool]
    event_target: str  # the events column naming the target
    lease_target: InstrumentedAttribute[int]  # the leases column naming it
    # poolctl shows "N live lease(s)" after an undrain of a host, never of a device.
    undrain_counts_leases: bool


def _find_device(session: Session, uid: str) -> _Found:
    dev = devices.get_by_uid(session, uid)
    return _Found(dev.id, dev.state, dev.generation)


def _set_device_state(conn: Connection, found: _Found, state: str, now: datetime) -> bool:
    # The state change rides on the generation swap: it is applied only if no grant
    # (or other drain) moved the device since it was read.
    return transitions.compare_and_bump(
        conn, Device, found.id, found.generation, state=state, updated_at=now
    )


def _find_host(session: Session, name: str) -> _Found:
    host = hosts.get_by_name(session, name)
    return _Found(host.id, host.status, host.generation)


def _set_host_status(conn: Connection, found: _Found, status: str, _now: datetime) -> bool:
    # As for a device: every grant on the host swaps its generation, so a grant
    # that read it `up` before this committed loses its swap and reads `draining`.
    return transitions.compare_and_bump(conn, Host, found.id, found.generation, status=status)


_DEVICE = _Kind(
    noun="device",
    name_key="uid",
    in_service="online",
    never_drained=("retired",),
    find=_find_device,
    set_state=_set_device_state,
    event_target="device_id",
    lease_target=Lease.device_id,
    undrain_counts_leases=False,
)
_HOST = _Kind(
    noun="host",
    name_key="host",
    in_service="up",
    never_drained=(),
    find=_find_host,
    set_state=_set_host_status,
    event_target="host_id",
    lease_target=Lease.host_id,
    undrain_counts_leases=True,
)


def _live_leases(session: Session, kind: _Kind, target_id: int) -> int:
    return int(
        session.scalar(
            select(func.count(Lease.id)).where(
                kind.lease_target == target_id, Lease.state.in_(LIVE_STATE_VALUES)
            )
        )
        or 0
    )


def _change(
    ledger: Ledger,
    kind: _Kind,
    name: str,
    actor: str,
    *,
    refused: Callable[[str], str | None],
    after: str,
    now: datetime,
    event: dict[str, Any],
) -> tuple[int, int]:
    """Move a target to `after`, journalled, again from a fresh read if it loses a race.

    `refused(state)`: why the target cannot move from `state` (bad_request), or None.
    Returns the target's id and its live leases.
    """

    def attempt() -> tuple[int, int]:
        with ledger.write() as s:
            found = kind.find(s, name)
            why = refused(found.state)
            if why is not None:
                raise BadRequest(
                    f"{kind.noun} {name!r} is {found.state}{why}", **{kind.name_key: name}
                )
            if not kind.set_state(s.connection(), found, after, now):
                raise transitions.LostRace
            target: dict[str, Any] = {kind.event_target: found.id}
            transitions.record(
                s,
                transitions.event_row(
                    actor=actor, from_state=found.state, to_state=after, **target, **event
                ),
            )
            return found.id, _live_leases(s, kind, found.id)

    return transitions.retrying(attempt, what=f"{event['kind']} of {name!r}")


def _drain(
    ledger: Ledger,
    kind: _Kind,
    name: str,
    actor: str,
    *,
    deadline_s: float | None,
    now_: bool,
    revoke_deadline_s: float,
) -> DrainResult:
    """Stop placing on a target; its live leases are revoked at the deadline, or at once.

    No deadline (`deadline_s` None and not `now_`): they run to their end.
    """
    now = utcnow()
    deadline = None
    if now_ or deadline_s is not None:
        deadline = now if now_ else now + timedelta(seconds=deadline_s or 0.0)
    if deadline is None:
        reason = "drain: leases run to their end"
    else:
        reason = "drain now" if now_ else f"drain within {deadline_s:g}s"
    target_id, live = _change(
        ledger,
        kind,
        name,
        actor,
        refused=lambda state: "; nothing to drain" if state in kind.never_drained else None,
        after="draining",
        now=now,
        event={
            "kind": f"{kind.noun}.drain",
            "reason": reason,
            # The reaper reads the latest drain's deadline (reaper.drain_deadlines).
            "detail": {"deadline_at": deadline.isoformat()} if deadline is not None else {},
        },
    )
    revoked: list[str] = []
    if deadline is not None and deadline <= now:
        revoked = revoke_matching(
            ledger,
            [kind.lease_target == target_id],
            reason=f"{kind.noun} {name} drained",
            actor=actor,
            now=now,
            deadline_s=revoke_deadline_s,
        )
    return DrainResult(
        target=name, state="draining", deadline_at=deadline, live_leases=live, revoked=revoked
    )


def _undrain(ledger: Ledger, kind: _Kind, name: str, actor: str) -> DrainResult:
    """Put a draining target back in service (leases already revoked stay revoked)."""
    _target_id, live = _change(
        ledger,
        kind,
        name,
        actor,
        refused=lambda state: ", not draining" if state != "draining" else None,
        after=kind.in_service,
        now=utcnow(),
        event={"kind": f"{kind.noun}.undrain"},
    )
    return DrainResult(
        target=name, state=kind.in_service, live_leases=live if kind.undrain_counts_leases else 0
    )


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
    return _drain(
        ledger,
        _DEVICE,
        uid,
        actor,
        deadline_s=deadline_s,
        now_=now_,
        revoke_deadline_s=revoke_deadline_s,
    )


def undrain_device(ledger: Ledger, uid: str, actor: str) -> DrainResult:
    """Put a draining device back online (leases already revoked stay revoked)."""
    return _undrain(ledger, _DEVICE, uid, actor)


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
    with `now_` at once; without either they run to their end. Back in service, the
    host is `up`; the reaper marks it down again if its agent is silent.
    """
    if not draining:
        return _undrain(ledger, _HOST, name, actor)
    return _drain(
        ledger,
        _HOST,
        name,
        actor,
        deadline_s=deadline_s,
        now_=now_,
        revoke_deadline_s=revoke_deadline_s,
    )
