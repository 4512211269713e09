"""Granting, activating, renewing, shrinking and ending leases: the ledger's write path.

Allocation uses optimistic concurrency (STYLE.md pattern 1): read the device
and tenant generations, place, insert, then bump each generation only where
it still has the value read. A zero-row update means another writer changed
the device or the tenant in between, so what we read (free extents, quota
use) may be stale: roll back and start over in a fresh transaction.

A host is part of the swap too: its drain bumps `hosts.generation`, so a grant
that read the host `up` just before the drain committed loses and reads it
`draining`. The swaps go host, device, tenant: the heartbeat (which writes the
host row and then, with an inventory, its devices) takes them in the same order.

Every state change is `transitions.move_if`; what a lease looks like from
outside is poold/ledger/lease_views.py. Core statements only: these run for
every lease a tenant takes. Beside this module, each answering its own question:
what a grant reads and writes (granting.py: quota use, placement candidates, the
lease insert), an existing lease as a transaction holds it (held_lease.py), an agent's
batch of queued ops, the commits of leases it granted alone among them (op_batches.py,
local_commit.py), a host's id (hosts.py), and ended leases still mapped (mapped.py).

Each entry point is one transaction run by `transitions.retrying`: a lost race,
a deadlock or a serialisation failure runs it again from a fresh read. Leases
are locked in id order (`transitions.lock_order`) wherever one transaction
touches several.

Idempotency (poold/ledger/agent_requests.py): a grant or an op batch that carries
a request id stores its answer in its own transaction, and a retry of that id
from the same host gets the stored answer. A grant's `pending` ops are applied
first in their own transaction and are not remembered under the grant's id: every
op is a conditional transition from one state, so a replay is refused and changes
nothing, and a grant does not return their results.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, NoReturn

from sqlalchemy import Connection, bindparam, update
from sqlalchemy.exc import IntegrityError

from poold import extents, placement
from poold.errors import (
    LeaseNotActive,
    NoCapacity,
    PoolError,
    QuotaExceeded,
    UnknownLease,
)
from poold.lease_states import LeaseEvent, LeaseState, next_state
from poold.ledger import (
    agent_requests,
    budgets,
    central_room,
    grant_write,
    granting,
    held_lease,
    hosts,
    lease_views,
    op_batches,
    tenants,
    transitions,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Lease
from poold.ledger.transitions import event_row
from poold.ledger.types import check_ints_fit, utcnow
from poold.wire.agent import (
    BudgetSpent,
    GrantReply,
    GrantRequest,
    LeaseOpResult,
    Renewal,
    RenewResult,
)
from poold.wire.common import LeaseOut

# The hot path's statements, built once: constructing a Select costs tens of
# microseconds of Python each time, and a grant runs about ten of them.
_RENEW = (
    update(Lease)
    .where(Lease.id == bindparam("lease_id"))
    .values(ttl_s=bindparam("new_ttl_s"), expires_at=bindparam("new_expires_at"))
)


# --- grant ----------------------------------------------------------------------------


def grant(ledger: Ledger, host_name: str, req: GrantRequest, actor: str) -> GrantReply:
    """Place and record a new lease for the tenant the requesting process may act for;
    the reply says what became of the ops that rode on the request."""
    check_ints_fit(
        Lease.__table__,
        {
            "holder_uid": req.uid,
            "holder_gid": req.gids[0] if req.gids else None,
            "holder_pid": req.pid,
        },
    )
    pending: list[LeaseOpResult] = []
    if req.pending:
        # Not under the grant's request id: see the module docstring.
        pending = op_batches.apply_ops(ledger, host_name, req.pending, actor)
    request_id = req.request_id
    # A refusal that only hosts' unspent budgets caused: (tenant id, size) to keep room for.
    blocked: list[tuple[int, int]] = []

    attempts = 0

    def attempt() -> tuple[LeaseOut, BudgetSpent | None]:
        nonlocal attempts
        attempts += 1
        blocked.clear()
        try:
            with ledger.write_conn() as conn:
                if request_id is None:
                    return _grant_once(ledger, conn, host_name, req, actor, blocked)
                host_id = hosts.host_id(ledger, conn, host_name)
                with agent_requests.unless_answered(
                    conn, host_id, request_id, agent_requests.GRANT, rerun=attempts > 1
                ):
                    return _grant_once(ledger, conn, host_name, req, actor, blocked)
        except agent_requests.Answered as answered:
            return _stored(answered.stored)
        except IntegrityError as exc:
            if not op_batches.lost_to_a_concurrent_writer(exc):
                raise
            raise transitions.LostRace(op_batches.lost_race_row(exc)) from exc

    # Grants for one host race for the same host and device generations: inside
    # one poold they take turns instead, so its worker threads do not make each
    # other lose the swap and redo the transaction. Other poold processes are
    # still fenced by the swap itself.
    try:
        with ledger.host_lock(host_name):
            lease, spent = transitions.retrying(attempt, what="allocation")
    except PoolError as err:
        if isinstance(err, QuotaExceeded) and blocked:
            central_room.note(ledger, *blocked[-1], actor)  # after the refusal's rollback
        if pending:
            # The ops that rode on it were applied in their own transaction: their results
            # go back with the refusal too. Dropped, an agent never heard that a local
            # grant among them was refused, kept its lease uncommitted, and its tenant
            # lost it at the first renewal (`unknown_lease`).
            err.detail["pending"] = [r.model_dump(mode="json") for r in pending]
        raise
    return GrantReply.model_construct(**dict(lease), pending=pending, budget_spent=spent)


def _stored(stored: Any) -> tuple[LeaseOut, BudgetSpent | None]:
    """A grant's stored first answer, what it spent included (absent: stored before
    replies said it)."""
    first = dict(stored)
    said = first.pop("budget_spent", None)
    spent = None if said is None else BudgetSpent.model_validate(said)
    return LeaseOut.model_validate(first), spent


def _grant_once(
    ledger: Ledger,
    conn: Connection,
    host_name: str,
    req: GrantRequest,
    actor: str,
    blocked: list[tuple[int, int]],
) -> tuple[LeaseOut, BudgetSpent]:
    """The lease, and what it took from this host's budget of the tenant. A refusal
    that only hosts' unspent budgets caused adds (tenant id, size) to ``blocked``."""
    # The hot path of every lease: SQLAlchemy Core, a handful of statements,
    # and the reply built from values already in hand (measured: the ORM
    # version spent ~4 ms per grant in Python on the CI machine).
    host_id = hosts.host_id(ledger, conn, host_name)
    devices, named = granting.host_devices_and_tenant(conn, host_id, req.tenant)
    host_generation = _refuse_if_host_draining(conn, host_id, host_name, devices)
    if named is granting.UNREAD:
        tenant = tenants.resolve(conn, req.tenant, req.uid, req.gids, host_name)
    else:
        assert req.tenant is not None  # read with the devices only when named
        tenant = tenants.check_named(named, req.tenant, req.uid, req.gids, host_name)
    # Budgets delegated to hosts are used quota, whether spent there yet or not. Read
    # with what occupies the host's devices: one round trip, though a tenant refused
    # for its quota below does not place.
    use, used = granting.use_and_occupancy(conn, tenant.id, host_id)
    used_bytes, used_leases = use.bytes(), use.leases()
    reported = req.local_use.use_for(tenant.name) if req.local_use else None
    # The least a lease of it can be: its size rounded up to the finest alignment here.
    least = extents.align_up(
        req.size_bytes, max(1, min((int(r.alignment_bytes) for r in devices), default=1))
    )
    fits_a_device = any(least <= r.capacity_bytes for r in devices)  # else: no_capacity
    if (
        fits_a_device
        and budgets.over_quota(tenant, used_bytes, used_leases, least)
        and budgets.spendable(
            use, host_id, tenant.quota_bytes, tenant.quota_leases, least, reported
        )
        is None
    ):
        # Refused wherever it is placed: before the placement, which a tenant pushing
        # against its quota makes in vain on every try.
        _refuse(conn, tenant, use, host_id, least, reported, blocked)
    candidates, paths = granting.candidates(conn, host_id, devices, used)
    choice = placement.place(
        placement.Request(
            size_bytes=req.size_bytes,
            media=req.media,
            allowed_media=frozenset(tenant.allowed_media),
        ),
        candidates,
    )
    if isinstance(choice, placement.Refusal):
        raise NoCapacity(
            f"cannot place {req.size_bytes} bytes on host {host_name!r}: {choice.reason}; "
            f"largest free extent is {choice.largest_free_bytes} bytes",
            largest_free_bytes=choice.largest_free_bytes,
            # Keyed by device uid: what an operator sees in `poolctl devices`.
            free_by_device={paths[k]["uid"]: v for k, v in choice.free_by_device.items()},
        )
    length = choice.extent.length
    spent = (0, 0)
    if host_id in use.budgets and budgets.over_quota(tenant, used_bytes, used_leases, length):
        # The quota is held by this host's own unspent budget: the grant spends it.
        use, spent = budgets.spend_for_central(
            conn,
            tenant.id,
            host_id,
            use,
            tenant.quota_bytes,
            tenant.quota_leases,
            length,
            actor,
            reported=reported,
        )
        used_bytes, used_leases = use.bytes(), use.leases()
    if budgets.over_quota(tenant, used_bytes, used_leases, length):
        _refuse(conn, tenant, use, host_id, length, reported, blocked)
    dev = choice.candidate
    path = paths[dev.device_id]
    now = utcnow()
    lease_id = str(uuid.uuid4())
    state = LeaseState.ACTIVE if req.activate else LeaseState.GRANTED
    values: dict[str, Any] = {
        "id": lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": dev.device_id,
        "offset_bytes": choice.extent.offset,
        "length_bytes": length,
        "requested_bytes": req.size_bytes,
        "state": state.value,
        "ttl_s": req.ttl_s,
        # The device generation only grows, so every reuse of any byte range
        # gets a larger epoch than whatever held it before: a fencing token.
        "epoch": dev.generation + 1,
        "granted_at": now,
        "activated_at": now if req.activate else None,
        "expires_at": now + timedelta(seconds=req.ttl_s),
        "ended_at": None,
        "holder_uid": req.uid,
        "holder_gid": req.gids[0] if req.gids else None,
        "holder_pid": req.pid,
        "labels": dict(req.labels),
        "exclusive_bytes": 0,
        "replica_bytes": 0,
        "reported_at": None,
        "reservation_id": None,  # central
    }
    common: dict[str, Any] = {
        "at": now,
        "actor": actor,
        "lease_id": lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": dev.device_id,
    }
    rows = [
        event_row(
            **common,
            kind="lease.grant",
            to_state="granted",
            detail={
                "offset_bytes": choice.extent.offset,
                "length_bytes": length,
                "epoch": values["epoch"],
                "uid": req.uid,
                "pid": req.pid,
            },
        )
    ]
    if req.activate:
        # The agent made the memory before asking: the activate arrow of the
        # state machine happens in this same transaction, with its own event.
        next_state(LeaseState.GRANTED, LeaseEvent.ACTIVATE)
        rows.append(
            event_row(**common, kind="lease.activate", from_state="granted", to_state="active")
        )
    out = lease_views.lease_out(
        {
            **values,
            "tenant": tenant.name,
            "host": host_name,
            "device_uid": path["uid"],
            "device_kind": dev.kind,
            "media": dev.media,
            "alignment_bytes": dev.alignment_bytes,
            "numa_node": path["numa_node"],
            "local_name": path["local_name"],
        }
    )
    budget_spent = BudgetSpent.model_construct(bytes=spent[0], leases=spent[1])
    answer = None
    if req.request_id is not None:
        response = {**out.model_dump(mode="json"), "budget_spent": budget_spent.model_dump()}
        answer = (host_id, req.request_id, response)
    # The generations swapped before the lease is inserted, host first (grant_write.py).
    grant_write.write(
        conn,
        (host_id, dev.device_id, tenant.id),
        (host_generation, dev.generation, tenant.generation),
        values,
        rows,
        answer,
    )
    central_room.renew(conn, tenant, length, now)  # the tenant's row, locked by its swap
    return out, budget_spent


def _refuse(
    conn: Connection,
    tenant: Any,
    use: budgets.QuotaUse,
    host_id: int,
    length: int,
    reported: tuple[int, int] | None,
    blocked: list[tuple[int, int]],
) -> NoReturn:
    """`quota_exceeded` for a central grant of ``length`` bytes; one that would fit but
    for hosts' unspent budgets goes into ``blocked`` (`grant` keeps room for it)."""
    by_budgets = central_room.blocked_by_budgets(
        use, tenant.quota_bytes, tenant.quota_leases, length, host_id, reported
    )
    if by_budgets and not central_room.covered(tenant, length, utcnow()):
        blocked.append((int(tenant.id), length))
    budgets.refuse_over_quota(
        conn, tenant, use, use.bytes(), use.leases(), length, by_budgets=by_budgets
    )


def _refuse_if_host_draining(
    conn: Connection, host_id: int, host_name: str, devices: list[Any]
) -> int:
    """A draining host (`poolctl hosts drain`) keeps its leases but gets no new ones; the
    host's generation this grant read (it swaps it, so a drain in between is noticed)."""
    status, generation = granting.host_state(conn, host_id, devices)
    if status == "draining":
        raise NoCapacity(
            f"host {host_name!r} is draining: no new leases are placed on it",
            host=host_name,
            host_status="draining",
        )
    return int(generation)


# --- an agent's outbox ------------------------------------------------------------------


# --- one lease at a time: activate, renew, end ------------------------------------------


def activate(ledger: Ledger, host_name: str, lease_id: str, actor: str) -> LeaseOut:
    """The agent made the memory of a granted lease: granted → active, its ttl from now.

    Idempotent: activating an active lease answers it as it is, so the agent may send
    the call again to another poold when a reply is lost.
    """

    def attempt() -> LeaseOut:
        with ledger.write_conn() as conn:
            host_id = hosts.host_id(ledger, conn, host_name)
            lease = held_lease.lock_one(conn, lease_id)
            held_lease.owned_by_host(lease, host_id, host_name)
            if lease.state == LeaseState.ACTIVE.value:
                # A repeat whose first reply was lost (poold died, the agent failed over):
                # the first activation stands, ttl and all.
                return lease_views.show_in(conn, lease_id)
            now = utcnow()
            held_lease.move(
                conn,
                lease,
                LeaseEvent.ACTIVATE,
                actor,
                now,
                values={"activated_at": now, "expires_at": now + timedelta(seconds=lease.ttl_s)},
            )
            return lease_views.show_in(conn, lease_id)

    return transitions.retrying(attempt, what=f"activation of {lease_id}")


def _renew(
    conn: Connection,
    held: dict[str, held_lease.Held],
    host_id: int,
    host_name: str,
    lease_id: str,
    ttl_s: int | None,
    now: datetime,
) -> held_lease.Held:
    """Extend one held lease in `held` (written by `_store_renewals`); checks before it writes."""
    lease = held.get(lease_id)
    if lease is None:
        raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
    held_lease.owned_by_host(lease, host_id, host_name)
    held_lease.expire_if_due(conn, lease, now)
    next_state(LeaseState(lease.state), LeaseEvent.RENEW)  # raises lease_not_active
    if ttl_s is not None:
        lease.ttl_s = ttl_s
    lease.expires_at = now + timedelta(seconds=lease.ttl_s)
    lease.renewed = True
    return lease


def _store_renewals(conn: Connection, held: dict[str, held_lease.Held]) -> None:
    params = [
        {"lease_id": x.id, "new_ttl_s": x.ttl_s, "new_expires_at": x.expires_at}
        for x in held.values()
        if x.renewed
    ]
    if params:
        conn.execute(_RENEW, params)


def renew_all(
    conn: Connection, host_id: int, host_name: str, renewals: Sequence[Renewal], now: datetime
) -> list[RenewResult]:
    """Every renewal a heartbeat carries, each on its own, in the caller's transaction.

    One locked read and one batched write however many renewals: a heartbeat
    carrying N of them costs two statements, not N.
    """
    held = held_lease.lock(conn, [r.lease_id for r in renewals])
    results: list[RenewResult] = []
    for renewal in renewals:
        try:
            lease = _renew(conn, held, host_id, host_name, renewal.lease_id, renewal.ttl_s, now)
        except PoolError as err:
            results.append(
                RenewResult(lease_id=renewal.lease_id, code=err.code, message=err.message)
            )
        else:
            results.append(RenewResult(lease_id=lease.id, expires_at=lease.expires_at))
    _store_renewals(conn, held)
    return results


def renew(ledger: Ledger, host_name: str, lease_id: str, ttl_s: int | None) -> LeaseOut:
    """Extend a held lease by `ttl_s` (or its own ttl) from now."""

    def attempt() -> LeaseOut:
        now = utcnow()
        refused: LeaseNotActive | None = None
        with ledger.write_conn() as conn:
            host_id = hosts.host_id(ledger, conn, host_name)
            held = held_lease.lock(conn, [lease_id])
            try:
                _renew(conn, held, host_id, host_name, lease_id, ttl_s, now)
            except LeaseNotActive as err:
                # Commit what lazy expiry found (and journalled) before refusing:
                # rolling it back would leave a lease past its ttl looking active.
                refused = err
            else:
                _store_renewals(conn, held)
                return lease_views.show_in(conn, lease_id)
        raise refused

    return transitions.retrying(attempt, what=f"renewal of {lease_id}")


def end(
    ledger: Ledger,
    lease_id: str,
    event: LeaseEvent,
    actor: str,
    reason: str = "",
    host_name: str | None = None,
) -> LeaseOut:
    """Release, abort or reclaim a lease; `host_name` set means an agent asks for its own."""

    def attempt() -> LeaseOut:
        refused: LeaseNotActive | None = None
        with ledger.write_conn() as conn:
            lease = held_lease.lock_one(conn, lease_id)
            if host_name is not None:
                held_lease.owned_by_host(lease, hosts.host_id(ledger, conn, host_name), host_name)
            now = utcnow()
            # Its agent's release may be a reclaim by now; an admin's is refused then.
            moved = held_lease.release_event(
                conn, lease, event, now, by_its_agent=host_name is not None
            )
            try:
                held_lease.move(conn, lease, moved, actor, now, reason)
            except LeaseNotActive as err:
                refused = err  # keep a lazy expiry, as renew() does
            else:
                return lease_views.show_in(conn, lease_id)
        raise refused

    return transitions.retrying(attempt, what=f"{event.value} of {lease_id}")
