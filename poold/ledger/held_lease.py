"""One existing lease as a transaction holds it: read (`read`) or row-locked in lock
order (`lock`), checked to be the asking host's (`owned_by_host`), moved from the state
it was read in (`move`) and expired first when its ttl has passed (`expire_if_due`).

Its own module because every entry point on an existing lease (poold/ledger/leases.py:
activate, renew, shrink, end, an agent's ops) stands on these and none of them is one
of those questions. A move is `transitions.move_if` conditional on the state read, so
a writer that changed the lease in between makes it a refusal, never a silent overwrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, bindparam, select

from poold.errors import GenerationConflict, NotOwner, UnknownLease
from poold.lease_states import LeaseEvent, LeaseState, next_state
from poold.ledger import transitions
from poold.ledger.db import Prepared, PreparedIn
from poold.ledger.models import Lease

# What an op on an existing lease reads of it.
_HELD_COLUMNS = (
    Lease.id,
    Lease.state,
    Lease.host_id,
    Lease.tenant_id,
    Lease.device_id,
    Lease.expires_at,
    Lease.ttl_s,
    Lease.offset_bytes,
    Lease.length_bytes,
    Lease.reservation_id,
)
_LEASE_FOR_OP = Prepared(select(*_HELD_COLUMNS).where(Lease.id == bindparam("lease_id")))
_LEASES = PreparedIn(lambda member: select(*_HELD_COLUMNS).where(member(Lease.id, "lease_ids")))
# ORDER BY id: PostgreSQL locks the rows in the order it returns them (lock order).
_LEASES_FOR_UPDATE = PreparedIn(
    lambda member: (
        select(*_HELD_COLUMNS)
        .where(member(Lease.id, "lease_ids"))
        .order_by(Lease.id)
        .with_for_update()
    )
)


@dataclass
class Held:
    """An existing lease as this transaction read it, kept in step with what it writes."""

    id: str
    state: str
    host_id: int
    tenant_id: int
    device_id: int
    expires_at: datetime
    ttl_s: int
    offset_bytes: int
    length_bytes: int
    reservation_id: str | None = None  # None: granted centrally
    renewed: bool = False


def read(conn: Connection, lease_id: str) -> Held | None:
    """One lease as an op of a batch reads it, unlocked: the op's write is conditional on it."""
    row = _LEASE_FOR_OP.one_or_none(conn, {"lease_id": lease_id})
    return None if row is None else Held(*row)


def _by_id(conn: Connection, stmt: PreparedIn, lease_ids: Sequence[str]) -> dict[str, Held]:
    out: dict[str, Held] = {}
    for chunk in transitions.chunks(transitions.lock_order(lease_ids)):
        for row in stmt.rows(conn, {"lease_ids": list(chunk)}):
            out[row.id] = Held(*row)
    return out


def read_many(conn: Connection, lease_ids: Sequence[str]) -> dict[str, Held]:
    """Leases by id as `read` reads each, in one statement per chunk (unlocked)."""
    return _by_id(conn, _LEASES, lease_ids)


def lock(conn: Connection, lease_ids: Sequence[str]) -> dict[str, Held]:
    """Leases by id, row-locked until the transaction ends (a heartbeat renews many at once)."""
    return _by_id(conn, _LEASES_FOR_UPDATE, lease_ids)


def lock_one(conn: Connection, lease_id: str) -> Held:
    """One lease, row-locked, or `unknown_lease`."""
    lease = lock(conn, [lease_id]).get(lease_id)
    if lease is None:
        raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
    return lease


def owned_by_host(lease: Held, host_id: int, host_name: str) -> None:
    """Refuse an agent asking about a lease held on another host (`not_owner`)."""
    if lease.host_id != host_id:
        # Same wording as an unknown id would leak existence; the code differs
        # on purpose so an operator can tell a misrouted agent from a typo.
        raise NotOwner(f"lease {lease.id} is not held on host {host_name!r}", lease_id=lease.id)


def move(
    conn: Connection,
    lease: Held,
    event: LeaseEvent,
    actor: str,
    now: datetime,
    reason: str | None = None,
    *,
    where: Sequence[Any] = (),
    values: dict[str, Any] | None = None,
) -> None:
    """`transitions.move_if` from the state this transaction read; a lost race is refused."""
    before = LeaseState(lease.state)
    moved = transitions.move_if(
        conn,
        lease.id,
        before,
        event,
        actor=actor,
        reason=reason,
        now=now,
        where=where,
        values=values,
        lease=lease,
    )
    if not moved:
        raise GenerationConflict(f"lease {lease.id} changed state meanwhile", lease_id=lease.id)
    lease.state = next_state(before, event).value


def expire_if_due(conn: Connection, lease: Held, now: datetime) -> None:
    """Lazy expiry: a held lease past its expiry is expired before anything else happens."""
    if lease.state == LeaseState.ACTIVE.value and lease.expires_at <= now:
        move(
            conn,
            lease,
            LeaseEvent.EXPIRE,
            "poold",
            now,
            "ttl passed without renewal",
            # A renewal that committed since this transaction read the lease wins.
            where=(Lease.expires_at <= now,),
        )


# A holder's release, met by a lease poold already ended for it: the reclaim it stands for.
_RELEASE_AS_RECLAIM: Final = {
    LeaseEvent.RELEASE: LeaseEvent.RECLAIM,
    LeaseEvent.RELEASE_DIRTY: LeaseEvent.RECLAIM_DIRTY,
    LeaseEvent.RELEASE_MAPPED: LeaseEvent.RECLAIM_MAPPED,
}
_ENDED_FOR_ITS_HOLDER: Final = frozenset(
    s.value for s in (LeaseState.EXPIRED, LeaseState.ORPHANED, LeaseState.REVOKING)
)


def release_event(
    conn: Connection, lease: Held, event: LeaseEvent, now: datetime, *, by_its_agent: bool
) -> LeaseEvent:
    """What a release does to the lease as it is now (other events: unchanged).

    Past its ttl the holder no longer owns it: the lease expires first (kept,
    journalled). If its host's agent sent it and poold ended the lease for its holder
    (expired, orphaned, revoking) while it was on its way, the agent has freed the
    memory all the same, so the release is the reclaim poold would otherwise wait for.
    Refused, the range stayed live until the reaper's reclaim while the agent, which had
    freed it, granted it again locally: that grant was then refused as an overlap and
    its tenant lost it. An admin's release of such a lease is refused.
    """
    if event not in _RELEASE_AS_RECLAIM:
        return event
    expire_if_due(conn, lease, now)
    if by_its_agent and lease.state in _ENDED_FOR_ITS_HOLDER:
        return _RELEASE_AS_RECLAIM[event]
    return event
