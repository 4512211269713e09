"""How does an administrator take memory back? Revoking and ending leases, draining devices
and hosts, deleting hosts.

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
  pattern 1). A repeated drain without a deadline, and an undrain of a target not
  draining, write nothing and say so (`changed` False).
* `end_lease`: an administrator ends one lease at once, whatever its live state,
  without handing out bytes an agent may still map (its docstring says how).
* `delete_host`: a host without live leases (or, with `force`, once they are ended)
  goes, with its credential, its paths and the devices only it reached.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session

from poold.errors import (
    BadRequest,
    DeadlineTooShort,
    GenerationConflict,
    HostBusy,
    InvalidTransition,
    NotOwner,
    PoolError,
    UnknownLease,
)
from poold.lease_states import (
    LIVE_STATE_VALUES,
    TERMINAL_STATES,
    LeaseEvent,
    LeaseState,
    next_state,
)
from poold.ledger import delegation_renewal, devices, hosts, lease_views, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Event, Host, Lease, Quarantine
from poold.ledger.reaper import reclaim_event, reclaim_events, revoke_in, revoke_matching
from poold.ledger.types import utcnow
from poold.wire.admin import DrainResult, HostDeleted, LeaseEndAction, LeaseEnded
from poold.wire.agent import LeaseOpResult
from poold.wire.common import LeaseOut

log = logging.getLogger(__name__)


# The shortest revocation notice poold promises to deliver: the agent hears of it by
# its wait for news (poold/ledger/news.py) within a round trip, heartbeats, and pushes
# it to the tenant's session; 2 s covers that with room for a loaded host.
MIN_NOTICE_S = 2.0


def check_notice(deadline_s: float) -> None:
    """Refuse a revocation deadline poold cannot deliver in time (0: now, allowed)."""
    if 0 < deadline_s < MIN_NOTICE_S:
        raise DeadlineTooShort(
            f"a revocation deadline of {deadline_s:g}s is shorter than poold can tell the "
            f"tenant in ({MIN_NOTICE_S:g}s); give at least that, or 0 to take it now",
            min_deadline_s=MIN_NOTICE_S,
        )


def revoke_lease(
    ledger: Ledger, lease_id: str, reason: str, actor: str, *, deadline_s: float
) -> LeaseOut:
    """Revoke one lease; the agent has `deadline_s` to give the memory back."""
    check_notice(deadline_s)
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


@dataclass(frozen=True)
class _Changed:
    """What `_change` found and did: the target, its live leases, its state now."""

    target_id: int
    live: int
    state: str
    changed: bool


def _latest_drain_deadline(session: Session, kind: _Kind, target_id: int) -> str | None:
    """The deadline (ISO text) of the target's latest drain event, None when it had none."""
    detail = session.scalar(
        select(Event.detail)
        .where(
            Event.kind == f"{kind.noun}.drain",
            getattr(Event, kind.event_target) == target_id,
        )
        .order_by(Event.id.desc())
        .limit(1)
    )
    found = (detail or {}).get("deadline_at")
    return str(found) if found is not None else None


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
    unchanged: Callable[[Session, _Found], bool] = lambda _s, _f: False,
) -> _Changed:
    """Move a target to `after`, journalled, again from a fresh read if it loses a race.

    `refused(state)`: why the target cannot move from `state` (bad_request), or None.
    `unchanged(session, found)`: the target already is as asked; then nothing is
    written (no event, no generation bump) and the result says `changed` False, so
    a repeated drain or undrain succeeds without journalling a second one.
    """

    def attempt() -> _Changed:
        with ledger.write() as s:
            found = kind.find(s, name)
            if unchanged(s, found):
                return _Changed(found.id, _live_leases(s, kind, found.id), found.state, False)
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
            if after == "draining":  # its reservations no lease lies in go back now
                delegation_renewal.return_unleased(s.connection(), actor, event["kind"], **target)
            return _Changed(found.id, _live_leases(s, kind, found.id), after, True)

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

    def unchanged(session: Session, found: _Found) -> bool:
        # Draining already, without a deadline, asked again without one: nothing to do.
        # A drain with a deadline always writes: it sets (or moves) the deadline.
        return (
            deadline is None
            and found.state == "draining"
            and _latest_drain_deadline(session, kind, found.id) is None
        )

    done = _change(
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
        unchanged=unchanged,
    )
    revoked: list[str] = []
    if deadline is not None and deadline <= now:
        revoked = revoke_matching(
            ledger,
            [kind.lease_target == done.target_id],
            reason=f"{kind.noun} {name} drained",
            actor=actor,
            now=now,
            deadline_s=revoke_deadline_s,
        )
    return DrainResult(
        target=name,
        state="draining",
        deadline_at=deadline,
        live_leases=done.live,
        revoked=revoked,
        changed=done.changed or bool(revoked),
    )


def _undrain(ledger: Ledger, kind: _Kind, name: str, actor: str) -> DrainResult:
    """Put a draining target back in service (leases already revoked stay revoked).

    A target that is not draining is left as it is: success, `changed` False, its
    state as it is (a host `up` or `down`, a device `online`, `missing`...).
    """
    done = _change(
        ledger,
        kind,
        name,
        actor,
        refused=lambda _state: None,
        after=kind.in_service,
        now=utcnow(),
        event={"kind": f"{kind.noun}.undrain"},
        unchanged=lambda _s, found: found.state != "draining",
    )
    return DrainResult(
        target=name,
        state=done.state,
        live_leases=done.live if kind.undrain_counts_leases else 0,
        changed=done.changed,
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


# --- ending a lease at once -------------------------------------------------------------

# How `end_lease` ends a lease in each live state (see its docstring).
_END_ACTION: dict[LeaseState, LeaseEndAction] = {
    LeaseState.GRANTED: "aborted",
    LeaseState.ACTIVE: "revoked",
    LeaseState.EXPIRED: "revoked",
    LeaseState.REVOKING: "revoked",
    LeaseState.ORPHANED: "reclaimed",
}


# Live states an administrator cannot end at once, and why.
_NOT_ENDED_NOW: dict[LeaseState, str] = {
    LeaseState.SCRUBBING: "its range is being zeroed and ends when the agent reports it "
    "scrubbed (`poolctl audit --reclaim` re-issues a stuck scrub)",
    LeaseState.RELEASED_MAPPED: "it ended, but a live holder still maps its memory; it "
    "ends when its agent reports it unmapped",
    LeaseState.REVOKED_MAPPED: "it was revoked, but a live holder still maps its memory; "
    "it ends when its agent reports it unmapped",
}


def end_lease(ledger: Ledger, lease_id: str, actor: str, reason: str) -> LeaseEnded:
    """End a lease at once, whatever its live state, without handing out mapped bytes.

    * orphaned (no holder left): reclaimed now, as the reaper would after the grace
      (`reclaim_events`: a devdax range goes to scrubbing; a memfd its agent last
      reported still mapped goes to `revoked_mapped`, counted until it is unmapped);
    * active, expired (a holder may still map it): revoked with a deadline of now,
      and a revoking lease's deadline is pulled in to now. Its agent learns it in
      its next heartbeat reply (`revocations`), tears the memory down and confirms
      (→ reclaimed); a memfd its live holder still maps stays revoking, its bytes
      used, while the agent reports it (`revoked_held`). Should the agent never
      answer, the reaper reclaims it as any revocation past its deadline, and then
      only as far as the agent's last report allows (`reclaim_events`);
    * granted (never handed to a holder): aborted, as the reaper does a stale grant;
    * scrubbing, released_mapped, revoked_mapped: refused (`invalid_transition`): the
      bytes are being zeroed, or a live holder still maps them (they end when the
      agent reports them unmapped);
    * already ended: nothing to do (`changed` False).
    """
    for _attempt in range(3):
        now = utcnow()
        with ledger.read() as s:
            row = s.execute(
                select(Lease.state, Device.kind)
                .join(Device, Device.id == Lease.device_id)
                .where(Lease.id == lease_id)
            ).one_or_none()
        if row is None:
            raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
        before = LeaseState(row.state)
        if before in TERMINAL_STATES:
            return LeaseEnded(
                lease=lease_views.show(ledger, lease_id), action="none", changed=False
            )
        why = _NOT_ENDED_NOW.get(before)
        if why is not None:
            raise InvalidTransition(
                f"lease {lease_id} is {before.value}: {why}", state=before.value, lease_id=lease_id
            )
        action = _END_ACTION[before]
        moved = transitions.retrying(
            functools.partial(_end_once, ledger, lease_id, before, row.kind, actor, reason, now),
            what=f"the end of {lease_id}",
        )
        if moved is not None:
            out = lease_views.show(ledger, lease_id)
            log.info(
                "lease %s ended by %s: %s -> %s (%s)",
                lease_id,
                actor,
                before.value,
                out.state,
                reason,
            )
            return LeaseEnded(lease=out, action=action, changed=moved)
        # Lost a race (the holder released, the reaper moved it): look again.
    raise GenerationConflict(f"lease {lease_id} kept changing state; retry", lease_id=lease_id)


def _end_once(
    ledger: Ledger,
    lease_id: str,
    before: LeaseState,
    kind: str,
    actor: str,
    reason: str,
    now: datetime,
) -> bool | None:
    """One try of `end_lease` from `before`: True moved, False nothing left to do, None lost."""
    with ledger.write() as s:
        conn = s.connection()
        if before is LeaseState.REVOKING:
            # Already revoked: its deadline (expires_at) comes in to now, journalled.
            result = conn.execute(
                update(Lease)
                .where(
                    Lease.id == lease_id,
                    Lease.state == before.value,
                    Lease.expires_at > now,
                )
                .values(expires_at=now)
            )
            if result.rowcount != 1:
                state = conn.execute(select(Lease.state).where(Lease.id == lease_id)).scalar()
                return False if state == before.value else None  # due already / moved
            ids = conn.execute(
                select(Lease.tenant_id, Lease.host_id, Lease.device_id).where(Lease.id == lease_id)
            ).one()
            transitions.record(
                conn,
                transitions.event_row(
                    at=now,
                    actor=actor,
                    kind="lease.end",
                    lease_id=lease_id,
                    tenant_id=ids.tenant_id,
                    host_id=ids.host_id,
                    device_id=ids.device_id,
                    from_state=before.value,
                    to_state=before.value,
                    reason=reason,
                    detail={"deadline_at": now.isoformat()},
                ),
            )
            return True
        if before is LeaseState.GRANTED:
            event, values, detail = LeaseEvent.ABORT, None, None
        elif before is LeaseState.ORPHANED:
            event = reclaim_events(conn, [(lease_id, kind)])[lease_id]
            values, detail = None, None
        else:  # active, expired: revoked with a deadline of now
            event = LeaseEvent.REVOKE
            values, detail = {"expires_at": now}, {"deadline_at": now.isoformat()}
        moved = transitions.move_if(
            conn,
            lease_id,
            before,
            event,
            actor=actor,
            reason=reason,
            now=now,
            values=values,
            detail=detail,
        )
        return True if moved else None


# --- deleting a host --------------------------------------------------------------------


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
            if not transitions.compare_and_bump(conn, Host, host.id, host.generation):
                raise transitions.LostRace
            live = _live_leases(s, _HOST, host.id)
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
    freed: set[int] = set()
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
                freed=freed,
            ):
                raise transitions.LostRace
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
                freed=freed,
            ):
                raise transitions.LostRace
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
    for device_id in sorted(freed):  # devices after leases (lock order)
        transitions.bump(conn, Device, device_id)
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
