"""How does an administrator take a lease back? Revoking one (and the agent confirming
it torn down) and ending one at once.

* `revoke_lease`: active/orphaned/expired → revoking. The agent learns it from
  its next heartbeat reply (`revocations`), tears the memory down and confirms
  (`confirm_revoked` → reclaimed); if it does not confirm by the deadline, the
  reaper reclaims the lease anyway.
* `end_lease`: an administrator ends one lease at once, whatever its live state,
  without handing out bytes an agent may still map (its docstring says how).

Taking a whole device or host out of service is poold/ledger/draining.py; deleting a
host, poold/ledger/host_deletion.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select, update

from poold.errors import (
    DeadlineTooShort,
    GenerationConflict,
    InvalidTransition,
    LeaseNotActive,
    NotOwner,
    PoolError,
    UnknownLease,
)
from poold.lease_states import TERMINAL_STATES, LeaseEvent, LeaseState, next_state
from poold.ledger import lease_views, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Host, Lease
from poold.ledger.reaper import reclaim_event, reclaim_events, revoke_in
from poold.ledger.types import utcnow
from poold.wire.admin import LeaseEndAction, LeaseEnded
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
        _check_revocable(lease_id, before)
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


# Live states a revocation does not apply to, and what to do instead (an administrator
# reads this, not the state machine's "no transition from X on revoke"); the states
# `end_lease` refuses are refused here for the same reasons (`_NOT_ENDED_NOW`).
_NOT_REVOKED: dict[LeaseState, str] = {
    LeaseState.GRANTED: "it was never handed to a holder; `poolctl leases end` aborts it",
    LeaseState.REVOKING: "it is being revoked already; `poolctl leases end` brings its "
    "deadline in to now",
}


def _check_revocable(lease_id: str, state: LeaseState) -> None:
    """Refuse, in an administrator's words, a revocation of a lease in `state`.

    An ended lease is `lease_not_active`, as a release of one is; a live lease a
    revocation does not apply to is `invalid_transition`, saying what does.
    """
    if state in TERMINAL_STATES:
        raise LeaseNotActive(
            f"lease {lease_id} has ended ({state.value}); there is nothing to revoke",
            state=state.value,
            lease_id=lease_id,
        )
    why = _NOT_REVOKED.get(state) or _NOT_ENDED_NOW.get(state)
    if why is not None:
        raise InvalidTransition(
            f"lease {lease_id} is {state.value}: {why}", state=state.value, lease_id=lease_id
        )
    next_state(state, LeaseEvent.REVOKE)  # every other live state may be revoked


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
