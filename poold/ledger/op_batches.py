"""How is a batch of an agent's queued lease ops applied to the ledger?

An agent queues what happens to its leases (releases, scrubs, shrinks, and the commits of
leases it granted inside its delegation) and sends them in batches, or riding on a
grant (poold/ledger/leases.py). One batch is one transaction; each op is a conditional
transition of its own lease and may be refused on its own, so replaying an outbox is
safe. A local grant's commit is poold/ledger/local_commit.py's, dispatched from here.

Idempotency (poold/ledger/agent_requests.py): a batch that carries a request id stores
its answer in its transaction, and a retry of that id from the same host gets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError

from poold.errors import GenerationConflict, InvalidSize, LeaseNotActive, PoolError, UnknownLease
from poold.lease_states import LIVE_STATES, LeaseEvent, LeaseState, next_state
from poold.ledger import (
    agent_requests,
    held_lease,
    hosts,
    local_commit,
    transitions,
    write_behind,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Lease, Quarantine
from poold.ledger.transitions import event_row
from poold.ledger.types import utcnow
from poold.wire.agent import LeaseOp, LeaseOpResult

_INSERT_QUARANTINE = insert(Quarantine)
_OP_EVENTS = {
    "release": LeaseEvent.RELEASE,
    "release_dirty": LeaseEvent.RELEASE_DIRTY,
    "abort": LeaseEvent.ABORT,
    "scrubbed": LeaseEvent.SCRUBBED,
    "scrub_failed": LeaseEvent.SCRUB_FAILED,
    "orphan": LeaseEvent.ORPHAN,
    "release_mapped": LeaseEvent.RELEASE_MAPPED,
    "reclaim_mapped": LeaseEvent.RECLAIM_MAPPED,
    "unmapped": LeaseEvent.UNMAPPED,
}


def lost_race_row(exc: IntegrityError) -> str:
    """What `transitions.LostRace` counts a `lost_to_a_concurrent_writer` rerun under:
    ``request_id`` for a request answered before (a retry, or the same retry run by two
    poolds at once: agent_requests.unless_answered), else ``constraint``."""
    return "request_id" if agent_requests.is_duplicate(exc) else "constraint"


def lost_to_a_concurrent_writer(exc: IntegrityError) -> bool:
    """A constraint a concurrent writer's commit made this transaction meet: the rerun
    reads what it committed (a lost race, not an error).

    - the exclusion constraint (PostgreSQL): a racing grant or batch placed over these
      bytes, or a batch's first attempt left a local grant's overlap check to it
      (`local_commit.BatchReads.overlap_by_constraint`); the rerun refuses that grant;
    - the lease's key: a concurrent batch committed this same local grant (resent
      through another poold) after this one found it unrecorded; the rerun answers it
      as a replay;
    - the request id's: a concurrent run of the same request committed first; the
      rerun answers what it stored.
    """
    words = str(exc.orig)
    return (
        "ex_leases_no_overlap" in words or "pk_leases" in words or agent_requests.is_duplicate(exc)
    )


def apply_ops(
    ledger: Ledger,
    host_name: str,
    ops: Sequence[LeaseOp],
    actor: str,
    *,
    request_id: str | None = None,
) -> list[LeaseOpResult]:
    """Apply an agent's queued transitions in one transaction; each may fail on its own.

    A refused op (the lease expired meanwhile, an admin already released it)
    is reported back and changes nothing, so replaying an outbox is safe. With a
    `request_id`, a retry of the batch gets the first answer instead.
    Core statements only: releases ride on every grant of the hot path.

    The ops are applied in lease id order (stable: several ops of one lease keep
    theirs), so that two batches, or a batch and the reaper, lock shared leases
    in one order; each op reads and writes only its own lease, so the order of
    ops on different leases does not change what they do, except for local grants,
    which read the tenant's local use and the device's live leases: the leases this
    batch grants go after all the others, and in the order the agent queued their ops,
    so a release queued before a grant frees its bytes and budget first, whether of a
    lease granted before this batch or in it (in id order, a grant could meet the
    overlap or budget of a lease released in the same batch; the agent may spend a
    released lease's budget at once, agent/local_leases.py). The rows those ops lock
    are locked up front, in id order (`local_commit.BatchReads.for_batch`), so this
    order is not a lock order. Results come back in the order of `ops`.
    """
    if not ops:
        return []
    granted = {op.lease_id for op in ops if op.op == "local_grant"}
    # Stable: the granted group keeps the queue's order (its key ties), the rest id order.
    order = sorted(
        range(len(ops)),
        key=lambda i: (
            ops[i].lease_id in granted,
            "" if ops[i].lease_id in granted else ops[i].lease_id,
        ),
    )
    attempts = 0

    def attempt() -> list[LeaseOpResult]:
        nonlocal attempts
        attempts += 1
        try:
            with ledger.write_conn() as conn:
                host_id = hosts.host_id(ledger, conn, host_name)
                if request_id is None:
                    return _apply_batch(
                        conn, host_id, host_name, ops, order, actor, first_attempt=attempts == 1
                    )
                # A replayed batch's ops are refused or answered as replays, and its
                # remembered answer meets the first one's unique key.
                with agent_requests.unless_answered(
                    conn, host_id, request_id, agent_requests.OPS, rerun=attempts > 1
                ):
                    results = _apply_batch(
                        conn, host_id, host_name, ops, order, actor, first_attempt=attempts == 1
                    )
                agent_requests.remember(
                    conn,
                    host_id,
                    request_id,
                    agent_requests.OPS,
                    [r.model_dump(mode="json") for r in results],
                )
                return results
        except agent_requests.Answered as answered:
            return _stored(answered.stored)
        except IntegrityError as exc:
            if not lost_to_a_concurrent_writer(exc):
                raise
            raise transitions.LostRace(lost_race_row(exc)) from exc  # the rerun answers

    return transitions.retrying(attempt, what="op batch")


def _stored(stored: Any) -> list[LeaseOpResult]:
    return [LeaseOpResult.model_validate(x) for x in stored]


def _apply_batch(
    conn: Connection,
    host_id: int,
    host_name: str,
    ops: Sequence[LeaseOp],
    order: Sequence[int],
    actor: str,
    *,
    first_attempt: bool = False,
) -> list[LeaseOpResult]:
    now = utcnow()
    reads = local_commit.BatchReads.for_batch(conn, ops, host_name, first_attempt=first_attempt)
    results: list[LeaseOpResult | None] = [None] * len(ops)
    # Its lease inserts and plain moves written at its end, in a statement each
    # (poold/ledger/write_behind.py: the first attempt on PostgreSQL), before its events.
    with (
        transitions.events_at_end(conn),
        write_behind.holding(conn, hold=reads.overlap_by_constraint),
    ):
        for i in order:
            op = ops[i]
            try:
                results[i] = _apply_op(conn, host_id, host_name, op, now, actor, reads)
            except PoolError as err:
                results[i] = LeaseOpResult(lease_id=op.lease_id, code=err.code, message=err.message)
    # The tenants it granted to swapped at once: rows local_commit.BatchReads locked
    # first, in the ledger's one order. The devices it freed bytes on keep their
    # generations (poold/ledger/transitions.py).
    reads.swap_tenants(conn)
    return [r for r in results if r is not None]


def _apply_op(
    conn: Connection,
    host_id: int,
    host_name: str,
    op: LeaseOp,
    now: datetime,
    actor: str,
    reads: local_commit.BatchReads,
) -> LeaseOpResult:
    """One op of a batch; a PoolError is that op's refusal (raised before it writes)."""
    if op.grant is not None:
        return local_commit.commit(conn, host_id, host_name, op.grant, now, actor, reads)
    lease = reads.inserted.get(op.lease_id) or reads.held.pop(op.lease_id, None)
    if lease is None:
        write_behind.flush(conn)  # read (again) as the batch left it
        lease = held_lease.read(conn, op.lease_id)
    if lease is None:
        raise UnknownLease(f"no lease {op.lease_id!r}", lease_id=op.lease_id)
    held_lease.owned_by_host(lease, host_id, host_name)
    if op.op == "shrink":
        write_behind.flush(conn)  # it reads and writes the row itself
        old_length = lease.length_bytes
        _shrink(conn, op, lease, now, actor)
        assert op.length_bytes is not None  # LeaseOp's validator
        reads.local_use_fell(lease, old_length - op.length_bytes, 0)
        # Kept in step: a later op of the batch on this lease (its release) frees what it
        # holds now, not what it held (a lease granted in the batch is not read again).
        lease.length_bytes = op.length_bytes
        return LeaseOpResult(lease_id=op.lease_id, state=lease.state)
    event = _OP_EVENTS[op.op]
    event = held_lease.release_event(conn, lease, event, now, by_its_agent=True)
    before = LeaseState(lease.state)
    after = next_state(before, event)
    held_lease.move(conn, lease, event, actor, now, op.reason)
    if before in LIVE_STATES and after not in LIVE_STATES:
        reads.local_use_fell(lease, lease.length_bytes, 1)
    if event is LeaseEvent.SCRUB_FAILED:
        # Bytes that may still hold a tenant's data are never handed out again.
        conn.execute(
            _INSERT_QUARANTINE,
            {
                "device_id": lease.device_id,
                "offset_bytes": lease.offset_bytes,
                "length_bytes": lease.length_bytes,
                "created_at": now,
                "reason": f"scrub failed after lease {op.lease_id}: {op.reason}",
            },
        )
    return LeaseOpResult(lease_id=op.lease_id, state=after.value)


_DEVICE_ALIGNMENT = select(Device.alignment_bytes).where(Device.id == bindparam("device_id"))
_SHRINK_STATE = select(Lease.shrink_wanted_bytes, Lease.shrink_deadline_at).where(
    Lease.id == bindparam("lease_id")
)
_SET_LENGTH = (
    update(Lease)
    .where(Lease.id == bindparam("lease_id"), Lease.length_bytes == bindparam("old_length"))
    .values(
        length_bytes=bindparam("new_length"),
        shrink_wanted_bytes=bindparam("wanted"),
        shrink_deadline_at=bindparam("deadline"),
    )
)
# Only a lease whose holder still has the memory can give part of it back.
_SHRINKABLE_STATES = frozenset({LeaseState.GRANTED.value, LeaseState.ACTIVE.value})


def _shrink(
    conn: Connection, op: LeaseOp, lease: held_lease.Held, now: datetime, actor: str
) -> None:
    """The holder gave back the tail of its lease: shorter extent, same state and offset.

    What poold asked for under pressure (shrink_wanted_bytes) is reduced by what was
    given; once covered, the request and its deadline are gone (no revocation).
    """
    new_length = op.length_bytes
    assert new_length is not None  # LeaseOp's validator
    state = LeaseState(lease.state)
    if state.value not in _SHRINKABLE_STATES:
        raise LeaseNotActive(
            f"lease {op.lease_id} is {state.value}; cannot shrink it",
            lease_id=op.lease_id,
            state=state.value,
        )
    if new_length >= lease.length_bytes:
        raise InvalidSize(
            f"lease {op.lease_id} is {lease.length_bytes} bytes; a shrink must make it "
            f"smaller, got {new_length}",
            lease_id=op.lease_id,
            length_bytes=new_length,
        )
    alignment = conn.execute(_DEVICE_ALIGNMENT, {"device_id": lease.device_id}).scalar_one()
    if alignment and new_length % alignment:
        raise InvalidSize(
            f"a shrunk lease must stay a multiple of its device alignment {alignment}, "
            f"got {new_length}",
            lease_id=op.lease_id,
            length_bytes=new_length,
            alignment_bytes=alignment,
        )
    given = lease.length_bytes - new_length
    wanted, deadline = conn.execute(_SHRINK_STATE, {"lease_id": op.lease_id}).one()
    left = None if wanted is None or wanted <= given else wanted - given
    changed = conn.execute(
        _SET_LENGTH,
        {
            "lease_id": op.lease_id,
            "old_length": lease.length_bytes,
            "new_length": new_length,
            "wanted": left,
            "deadline": None if left is None else deadline,
        },
    ).rowcount
    if changed != 1:  # another shrink of the same lease won (the length is the condition)
        raise GenerationConflict(f"lease {op.lease_id} changed meanwhile", lease_id=op.lease_id)
    transitions.record(
        conn,
        event_row(
            at=now,
            actor=actor,
            kind="lease.shrink",
            lease_id=op.lease_id,
            tenant_id=lease.tenant_id,
            host_id=lease.host_id,
            device_id=lease.device_id,
            from_state=state.value,
            to_state=state.value,
            reason=op.reason or f"gave back {given} bytes",
            detail={"from_bytes": lease.length_bytes, "to_bytes": new_length},
        ),
    )
