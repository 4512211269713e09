"""Granting, activating, renewing and ending leases: the ledger side of the lifecycle.

Allocation uses optimistic concurrency (STYLE.md pattern 1): read the device
and tenant generations, place, insert, then bump each generation only where
it still has the value read. A zero-row update means another writer changed
the device or the tenant in between, so what we read (free extents, quota
use) may be stale: roll back and start over in a fresh transaction.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Select, bindparam, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from poold import placement
from poold.errors import (
    GenerationConflict,
    InvalidSize,
    LeaseNotActive,
    NoCapacity,
    NotOwner,
    PoolError,
    QuotaExceeded,
    UnknownLease,
)
from poold.extents import Extent
from poold.lease_states import (
    LIVE_STATE_VALUES,
    LIVE_STATES_SQL,
    LeaseEvent,
    LeaseState,
    next_state,
)
from poold.ledger import events, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import (
    Device,
    DevicePath,
    Event,
    Host,
    Lease,
    Quarantine,
    Tenant,
)
from poold.ledger.types import check_ints_fit, utcnow
from poold.wire.agent import GrantRequest, LeaseOp, LeaseOpResult
from poold.wire.common import LeaseOut

MAX_ATTEMPTS = 16
IN_CHUNK = 10_000
RETRY_BACKOFF_S = 0.002

# The hot path's statements, built once: constructing a Select costs tens of
# microseconds of Python each time, and a grant runs about ten of them.
_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")
_HOST_ID = select(Host.id).where(Host.name == bindparam("host_name"))
_TENANT_USAGE = select(func.coalesce(func.sum(Lease.length_bytes), 0), func.count(Lease.id)).where(
    Lease.tenant_id == bindparam("tenant_id"), _LIVE_SQL
)
_HOST_DEVICES = (
    select(
        Device.id,
        Device.uid,
        Device.kind,
        Device.media,
        Device.state,
        Device.health,
        Device.capacity_bytes,
        Device.alignment_bytes,
        Device.generation,
        DevicePath.read_latency_ns,
        DevicePath.distance,
        DevicePath.numa_node,
        DevicePath.local_name,
        Device.reserved_extents,
    )
    .join(DevicePath, DevicePath.device_id == Device.id)
    .where(DevicePath.host_id == bindparam("host_id"), DevicePath.present.is_(True))
)
_HOST_DEVICE_IDS = select(DevicePath.device_id).where(
    DevicePath.host_id == bindparam("host_id"), DevicePath.present.is_(True)
)
_USED_BY_LEASES = select(Lease.device_id, Lease.offset_bytes, Lease.length_bytes).where(
    Lease.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery()), _LIVE_SQL
)
_USED_BY_QUARANTINE = select(
    Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes
).where(Quarantine.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery()))
_INSERT_LEASE = insert(Lease)
_INSERT_EVENT = insert(Event)
_BUMP = {
    model: update(model)
    .where(model.id == bindparam("row_id"), model.generation == bindparam("seen"))
    .values(generation=bindparam("new_generation"))
    for model in (Device, Tenant)
}
_LEASE_FOR_OP = select(
    Lease.state,
    Lease.host_id,
    Lease.tenant_id,
    Lease.device_id,
    Lease.expires_at,
    Lease.offset_bytes,
    Lease.length_bytes,
).where(Lease.id == bindparam("lease_id"))
_INSERT_QUARANTINE = insert(Quarantine)
_OP_EVENTS = {
    "release": LeaseEvent.RELEASE,
    "release_dirty": LeaseEvent.RELEASE_DIRTY,
    "abort": LeaseEvent.ABORT,
    "scrubbed": LeaseEvent.SCRUBBED,
    "scrub_failed": LeaseEvent.SCRUB_FAILED,
    "orphan": LeaseEvent.ORPHAN,
}
_SET_STATE = (
    update(Lease)
    .where(Lease.id == bindparam("lease_id"), Lease.state == bindparam("from_state"))
    .values(state=bindparam("to_state"), ended_at=bindparam("ended_at"))
)
_DEVICE_FREED = (
    update(Device)
    .where(Device.id == bindparam("device_id"))
    .values(generation=Device.generation + 1)
)


def _host_id(ledger: Ledger, conn: Connection, host_name: str) -> int:
    cached = ledger.host_ids.get(host_name)
    if cached is not None:
        return cached
    host_id = conn.execute(_HOST_ID, {"host_name": host_name}).scalar()
    if host_id is None:
        raise NotOwner(f"host {host_name!r} is not registered")
    ledger.host_ids[host_name] = int(host_id)
    return int(host_id)


class _Retry(Exception):
    """Another writer won a generation race; start the transaction again."""


def grant(ledger: Ledger, host_name: str, req: GrantRequest, actor: str) -> LeaseOut:
    """Place and record a new lease for the tenant the requesting process may act for."""
    check_ints_fit(
        Lease.__table__,
        {
            "holder_uid": req.uid,
            "holder_gid": req.gids[0] if req.gids else None,
            "holder_pid": req.pid,
        },
    )
    if req.pending:
        apply_ops(ledger, host_name, req.pending, actor)
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            # Writers that lost the same race retry at once and collide again;
            # a short, growing, random pause spreads them out.
            time.sleep(random.uniform(0, RETRY_BACKOFF_S * attempt))  # noqa: S311
        try:
            with ledger.write_conn() as conn:
                return _grant_once(ledger, conn, host_name, req, actor)
        except _Retry:
            continue
        except IntegrityError as exc:
            # PostgreSQL's exclusion constraint caught an overlap a racing
            # writer created; it is the same situation as a generation miss.
            if "ex_leases_no_overlap" not in str(exc.orig):
                raise
            continue
        except OperationalError as exc:  # serialisation failure / deadlock: retry
            if "deadlock" not in str(exc.orig) and "could not serialize" not in str(exc.orig):
                raise
            continue
    raise GenerationConflict(f"allocation lost {MAX_ATTEMPTS} races in a row; retry")


def _grant_once(
    ledger: Ledger, conn: Connection, host_name: str, req: GrantRequest, actor: str
) -> LeaseOut:
    # The hot path of every lease: SQLAlchemy Core, a handful of statements,
    # and the reply built from values already in hand (measured: the ORM
    # version spent ~4 ms per grant in Python on the CI machine).
    host_id = _host_id(ledger, conn, host_name)
    _refuse_if_host_draining(conn, host_id, host_name)
    tenant = tenants.resolve(conn, req.tenant, req.uid, req.gids, host_name)
    usage = conn.execute(_TENANT_USAGE, {"tenant_id": tenant.id}).one()
    # int(): PostgreSQL's SUM(bigint) is a numeric (Decimal), which would leak
    # into the quota_exceeded detail and fail to serialise to JSON.
    used_bytes, used_leases = int(usage[0]), int(usage[1])
    candidates, paths = _candidates(conn, host_id)
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
    if used_leases + 1 > tenant.quota_leases:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} holds {used_leases} of {tenant.quota_leases} leases",
            quota_leases=tenant.quota_leases,
            live_leases=used_leases,
        )
    if used_bytes + length > tenant.quota_bytes:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} would hold {used_bytes + length} bytes, "
            f"quota is {tenant.quota_bytes}",
            quota_bytes=tenant.quota_bytes,
            leased_bytes=used_bytes,
            requested_bytes=length,
        )
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
    }
    # Claim the generations *before* inserting the lease. On PostgreSQL the
    # conditional UPDATE takes the device row lock, so racing grants queue
    # here and each loser sees a zero-row update the moment the winner
    # commits. Inserting first lets two grants of the same range both reach
    # the exclusion constraint, where each waits for the other: a deadlock
    # PostgreSQL only breaks after deadlock_timeout (1 s), again every round.
    _bump(conn, Device, dev.device_id, dev.generation)
    _bump(conn, Tenant, tenant.id, tenant.generation)
    conn.execute(_INSERT_LEASE, values)
    common = {
        "at": now,
        "actor": actor,
        "lease_id": lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": dev.device_id,
        "reason": None,
    }
    rows = [
        {
            **common,
            "kind": "lease.grant",
            "from_state": None,
            "to_state": "granted",
            "detail": {
                "offset_bytes": choice.extent.offset,
                "length_bytes": length,
                "epoch": values["epoch"],
                "uid": req.uid,
                "pid": req.pid,
            },
        }
    ]
    if req.activate:
        # The agent made the memory before asking: the activate arrow of the
        # state machine happens in this same transaction, with its own event.
        next_state(LeaseState.GRANTED, LeaseEvent.ACTIVATE)
        rows.append(
            {
                **common,
                "kind": "lease.activate",
                "from_state": "granted",
                "to_state": "active",
                "detail": {},
            }
        )
    conn.execute(_INSERT_EVENT, rows)
    return LeaseOut(
        id=lease_id,
        tenant=tenant.name,
        host=host_name,
        device_uid=path["uid"],
        device_kind=dev.kind,
        media=dev.media,
        offset_bytes=choice.extent.offset,
        length_bytes=length,
        requested_bytes=req.size_bytes,
        alignment_bytes=dev.alignment_bytes,
        state=state.value,
        epoch=values["epoch"],
        ttl_s=req.ttl_s,
        granted_at=now,
        activated_at=values["activated_at"],
        expires_at=values["expires_at"],
        ended_at=None,
        numa_node=path["numa_node"],
        local_name=path["local_name"],
        holder_uid=req.uid,
        holder_pid=req.pid,
        labels=dict(req.labels),
    )


def apply_ops(
    ledger: Ledger, host_name: str, ops: Sequence[LeaseOp], actor: str
) -> list[LeaseOpResult]:
    """Apply an agent's queued transitions in one transaction; each may fail on its own.

    A refused op (the lease expired meanwhile, an admin already released it)
    is reported back and changes nothing, so replaying an outbox is safe.
    Core statements only: releases ride on every grant of the hot path.
    """
    if not ops:
        return []
    results: list[LeaseOpResult] = []
    with ledger.write_conn() as conn:
        host_id = _host_id(ledger, conn, host_name)
        now = utcnow()
        event_rows: list[dict[str, Any]] = []
        freed_devices: set[int] = set()
        for op in ops:
            row = conn.execute(_LEASE_FOR_OP, {"lease_id": op.lease_id}).one_or_none()
            try:
                if row is None:
                    raise UnknownLease(f"no lease {op.lease_id!r}", lease_id=op.lease_id)
                if row.host_id != host_id:
                    raise NotOwner(
                        f"lease {op.lease_id} is not held on host {host_name!r}",
                        lease_id=op.lease_id,
                    )
                if op.op == "shrink":
                    event_rows.append(_shrink(conn, op, row, now, actor))
                    freed_devices.add(row.device_id)
                    results.append(LeaseOpResult(lease_id=op.lease_id, state=row.state))
                    continue
                event = _OP_EVENTS[op.op]
                before = LeaseState(row.state)
                if (
                    event in (LeaseEvent.RELEASE, LeaseEvent.RELEASE_DIRTY)
                    and before is LeaseState.ACTIVE
                    and row.expires_at <= now
                ):
                    # Lazy expiry: past its ttl the holder no longer owns it.
                    conn.execute(
                        _SET_STATE,
                        {
                            "lease_id": op.lease_id,
                            "from_state": before.value,
                            "to_state": LeaseState.EXPIRED.value,
                            "ended_at": None,
                        },
                    )
                    event_rows.append(
                        _event_row(
                            now,
                            "poold",
                            "lease.expire",
                            op.lease_id,
                            row,
                            before,
                            LeaseState.EXPIRED,
                            "ttl passed without renewal",
                        )
                    )
                    before = LeaseState.EXPIRED
                after = next_state(before, event)
            except PoolError as err:
                results.append(
                    LeaseOpResult(lease_id=op.lease_id, code=err.code, message=err.message)
                )
                continue
            conn.execute(
                _SET_STATE,
                {
                    "lease_id": op.lease_id,
                    "from_state": before.value,
                    "to_state": after.value,
                    "ended_at": now if after.value not in LIVE_STATE_VALUES else None,
                },
            )
            if after.value not in LIVE_STATE_VALUES:
                freed_devices.add(row.device_id)
            if event is LeaseEvent.SCRUB_FAILED:
                # Bytes that may still hold a tenant's data are never handed out again.
                conn.execute(
                    _INSERT_QUARANTINE,
                    {
                        "device_id": row.device_id,
                        "offset_bytes": row.offset_bytes,
                        "length_bytes": row.length_bytes,
                        "created_at": now,
                        "reason": f"scrub failed after lease {op.lease_id}: {op.reason}",
                    },
                )
            event_rows.append(
                _event_row(
                    now,
                    actor,
                    f"lease.{event.value}",
                    op.lease_id,
                    row,
                    before,
                    after,
                    op.reason or None,
                )
            )
            results.append(LeaseOpResult(lease_id=op.lease_id, state=after.value))
        for device_id in freed_devices:
            conn.execute(_DEVICE_FREED, {"device_id": device_id})
        if event_rows:
            conn.execute(_INSERT_EVENT, event_rows)
    return results


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


def _shrink(conn: Connection, op: LeaseOp, row: Any, now: datetime, actor: str) -> dict[str, Any]:
    """The holder gave back the tail of its lease: shorter extent, same state and offset.

    What poold asked for under pressure (shrink_wanted_bytes) is reduced by what was
    given; once covered, the request and its deadline are gone (no revocation).
    """
    new_length = op.length_bytes
    assert new_length is not None  # LeaseOp's validator
    state = LeaseState(row.state)
    if state.value not in _SHRINKABLE_STATES:
        raise LeaseNotActive(
            f"lease {op.lease_id} is {state.value}; cannot shrink it",
            lease_id=op.lease_id,
            state=state.value,
        )
    if new_length >= row.length_bytes:
        raise InvalidSize(
            f"lease {op.lease_id} is {row.length_bytes} bytes; a shrink must make it "
            f"smaller, got {new_length}",
            lease_id=op.lease_id,
            length_bytes=new_length,
        )
    alignment = conn.execute(_DEVICE_ALIGNMENT, {"device_id": row.device_id}).scalar_one()
    if alignment and new_length % alignment:
        raise InvalidSize(
            f"a shrunk lease must stay a multiple of its device alignment {alignment}, "
            f"got {new_length}",
            lease_id=op.lease_id,
            length_bytes=new_length,
            alignment_bytes=alignment,
        )
    given = row.length_bytes - new_length
    wanted, deadline = conn.execute(_SHRINK_STATE, {"lease_id": op.lease_id}).one()
    left = None if wanted is None or wanted <= given else wanted - given
    conn.execute(
        _SET_LENGTH,
        {
            "lease_id": op.lease_id,
            "old_length": row.length_bytes,
            "new_length": new_length,
            "wanted": left,
            "deadline": None if left is None else deadline,
        },
    )
    event = _event_row(
        now,
        actor,
        "lease.shrink",
        op.lease_id,
        row,
        state,
        state,
        op.reason or f"gave back {given} bytes",
    )
    event["detail"] = {"from_bytes": row.length_bytes, "to_bytes": new_length}
    return event


def _event_row(
    now: datetime,
    actor: str,
    kind: str,
    lease_id: str,
    row: Any,
    before: LeaseState,
    after: LeaseState,
    reason: str | None,
) -> dict[str, Any]:
    return {
        "at": now,
        "actor": actor,
        "kind": kind,
        "lease_id": lease_id,
        "tenant_id": row.tenant_id,
        "host_id": row.host_id,
        "device_id": row.device_id,
        "from_state": before.value,
        "to_state": after.value,
        "reason": reason,
        "detail": {},
    }


def _bump(conn: Connection, model: type[Device] | type[Tenant], row_id: int, seen: int) -> None:
    result = conn.execute(
        _BUMP[model], {"row_id": row_id, "seen": seen, "new_generation": seen + 1}
    )
    if result.rowcount != 1:
        raise _Retry


def _candidates(
    conn: Connection, host_id: int
) -> tuple[list[placement.Candidate], dict[int, dict[str, Any]]]:
    """The devices a host reaches, with what occupies them, and how the host names them."""
    params = {"host_id": host_id}
    rows = conn.execute(_HOST_DEVICES, params).all()
    if not rows:
        return [], {}
    used: dict[int, list[Extent]] = defaultdict(list)
    for device_id, offset, length in conn.execute(_USED_BY_LEASES, params):
        used[device_id].append(Extent(offset, length))
    for device_id, offset, length in conn.execute(_USED_BY_QUARANTINE, params):
        used[device_id].append(Extent(offset, length))
    for row in rows:  # held by dax devices poold did not place (poold/ledger/devices.py)
        used[row.id].extend(Extent(offset, length) for offset, length in row.reserved_extents)
    candidates = [
        placement.Candidate(
            device_id=row.id,
            kind=row.kind,
            media=row.media,
            state=row.state,
            health=row.health,
            capacity_bytes=row.capacity_bytes,
            alignment_bytes=row.alignment_bytes,
            used=tuple(used[row.id]),
            read_latency_ns=row.read_latency_ns,
            distance=row.distance,
            generation=row.generation,
        )
        for row in rows
    ]
    paths = {
        row.id: {"uid": row.uid, "numa_node": row.numa_node, "local_name": row.local_name}
        for row in rows
    }
    return candidates, paths


def _load(session: Session, lease_id: str, *, for_update: bool = True) -> Lease:
    stmt = select(Lease).where(Lease.id == lease_id)
    if for_update:
        stmt = stmt.with_for_update()
    lease = session.scalar(stmt)
    if lease is None:
        raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
    return lease


def _owned_by_host(lease: Lease, host: Host) -> None:
    if lease.host_id != host.id:
        # Same wording as an unknown id would leak existence; the code differs
        # on purpose so an operator can tell a misrouted agent from a typo.
        raise NotOwner(f"lease {lease.id} is not held on host {host.name!r}", lease_id=lease.id)


def _move(session: Session, lease: Lease, event: LeaseEvent, actor: str, reason: str = "") -> None:
    before = LeaseState(lease.state)
    after = next_state(before, event)
    lease.state = after.value
    if after.value not in LIVE_STATE_VALUES:
        lease.ended_at = utcnow()
        # Freed bytes change what the allocator may hand out.
        session.execute(
            update(Device)
            .where(Device.id == lease.device_id)
            .values(generation=Device.generation + 1)
            .execution_options(synchronize_session=False)
        )
    if before != after:
        events.record(
            session,
            actor=actor,
            kind=f"lease.{event.value}",
            lease_id=lease.id,
            tenant_id=lease.tenant_id,
            host_id=lease.host_id,
            device_id=lease.device_id,
            from_state=before.value,
            to_state=after.value,
            reason=reason or None,
        )


def _expire_if_due(session: Session, lease: Lease, now: datetime) -> None:
    """Lazy expiry: a held lease past its expiry is expired before anything else happens."""
    if lease.state == LeaseState.ACTIVE.value and lease.expires_at <= now:
        _move(session, lease, LeaseEvent.EXPIRE, "poold", "ttl passed without renewal")


def activate(ledger: Ledger, host_name: str, lease_id: str, actor: str) -> LeaseOut:
    with ledger.write() as session:
        host = _host(session, host_name)
        lease = _load(session, lease_id)
        _owned_by_host(lease, host)
        _move(session, lease, LeaseEvent.ACTIVATE, actor)
        now = utcnow()
        lease.activated_at = now
        lease.expires_at = now + timedelta(seconds=lease.ttl_s)
        return _out(session, lease)


def load_many(session: Session, lease_ids: Sequence[str]) -> dict[str, Lease]:
    """Several leases in one locked query (a heartbeat renews them all at once)."""
    out: dict[str, Lease] = {}
    ids = list(lease_ids)
    for start in range(0, len(ids), IN_CHUNK):  # SQLite caps bound parameters per query
        stmt = select(Lease).where(Lease.id.in_(ids[start : start + IN_CHUNK])).with_for_update()
        out.update((lease.id, lease) for lease in session.scalars(stmt))
    return out


def renew_in(
    session: Session,
    host: Host,
    lease_id: str,
    ttl_s: int | None,
    now: datetime,
    loaded: dict[str, Lease] | None = None,
) -> Lease:
    """Extend a held lease (inside the caller's transaction: heartbeats batch these).

    `loaded` holds leases already read by `load_many`: a heartbeat carrying N
    renewals then costs one query, not N.
    """
    if loaded is None:
        lease = _load(session, lease_id)
    else:
        found = loaded.get(lease_id)
        if found is None:
            raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
        lease = found
    _owned_by_host(lease, host)
    _expire_if_due(session, lease, now)
    next_state(LeaseState(lease.state), LeaseEvent.RENEW)  # raises lease_not_active
    if ttl_s is not None:
        lease.ttl_s = ttl_s
    lease.expires_at = now + timedelta(seconds=lease.ttl_s)
    return lease


def renew(ledger: Ledger, host_name: str, lease_id: str, ttl_s: int | None) -> LeaseOut:
    now = utcnow()
    refused: LeaseNotActive | None = None
    with ledger.write() as session:
        host = _host(session, host_name)
        try:
            lease = renew_in(session, host, lease_id, ttl_s, now)
        except LeaseNotActive as err:
            # Commit what lazy expiry found (and journalled) before refusing:
            # rolling it back would leave a lease past its ttl looking active.
            refused = err
        else:
            return _out(session, lease)
    raise refused


def end(
    ledger: Ledger,
    lease_id: str,
    event: LeaseEvent,
    actor: str,
    reason: str = "",
    host_name: str | None = None,
) -> LeaseOut:
    """Release, abort or reclaim a lease; `host_name` set means an agent asks for its own."""
    refused: LeaseNotActive | None = None
    with ledger.write() as session:
        lease = _load(session, lease_id)
        if host_name is not None:
            _owned_by_host(lease, _host(session, host_name))
        if event in (LeaseEvent.RELEASE, LeaseEvent.RELEASE_DIRTY):
            _expire_if_due(session, lease, utcnow())
        try:
            _move(session, lease, event, actor, reason)
        except LeaseNotActive as err:
            refused = err  # keep a lazy expiry, as renew() does
        else:
            return _out(session, lease)
    raise refused


def _host(session: Session, name: str) -> Host:
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        raise NotOwner(f"host {name!r} is not registered")
    return host


def _query() -> Select[Lease, Tenant, Host, Device, DevicePath]:
    return (
        select(Lease, Tenant, Host, Device, DevicePath)
        .join(Tenant, Tenant.id == Lease.tenant_id)
        .join(Host, Host.id == Lease.host_id)
        .join(Device, Device.id == Lease.device_id)
        .outerjoin(
            DevicePath,
            (DevicePath.device_id == Lease.device_id) & (DevicePath.host_id == Lease.host_id),
        )
    )


def _row_out(
    lease: Lease, tenant: Tenant, host: Host, dev: Device, path: DevicePath | None
) -> LeaseOut:
    return LeaseOut(
        id=lease.id,
        tenant=tenant.name,
        host=host.name,
        device_uid=dev.uid,
        device_kind=dev.kind,
        media=dev.media,
        offset_bytes=lease.offset_bytes,
        length_bytes=lease.length_bytes,
        requested_bytes=lease.requested_bytes,
        alignment_bytes=dev.alignment_bytes,
        state=lease.state,
        epoch=lease.epoch,
        ttl_s=lease.ttl_s,
        granted_at=lease.granted_at,
        activated_at=lease.activated_at,
        expires_at=lease.expires_at,
        ended_at=lease.ended_at,
        numa_node=path.numa_node if path else None,
        local_name=path.local_name if path else "",
        holder_uid=lease.holder_uid,
        holder_pid=lease.holder_pid,
        labels=dict(lease.labels),
        exclusive_bytes=lease.exclusive_bytes,
        replica_bytes=lease.replica_bytes,
    )


def _out(session: Session, lease: Lease) -> LeaseOut:
    session.flush()
    row = session.execute(_query().where(Lease.id == lease.id)).one()
    return _row_out(*row)


def show(ledger: Ledger, lease_id: str) -> LeaseOut:
    with ledger.read() as session:
        row = session.execute(_query().where(Lease.id == lease_id)).one_or_none()
        if row is None:
            raise UnknownLease(f"no lease {lease_id!r}", lease_id=lease_id)
        return _row_out(*row)


def list_leases(
    ledger: Ledger,
    *,
    tenant: str | None = None,
    host: str | None = None,
    states: Sequence[str] | None = None,
    live_only: bool = False,
    limit: int = 1000,
) -> list[LeaseOut]:
    stmt = _query()
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    if host is not None:
        stmt = stmt.where(Host.name == host)
    if live_only:
        stmt = stmt.where(Lease.state.in_(LIVE_STATE_VALUES))
    if states:
        stmt = stmt.where(Lease.state.in_(list(states)))
    stmt = stmt.order_by(Lease.granted_at.desc()).limit(limit)
    with ledger.read() as session:
        return [_row_out(*row) for row in session.execute(stmt)]


# --- lifecycle helpers for the reaper, revoke/drain and the audit -----------------

_HOST_STATUS = select(Host.status).where(Host.id == bindparam("host_id"))


def _refuse_if_host_draining(conn: Connection, host_id: int, host_name: str) -> None:
    """A draining host (`poolctl hosts drain`) keeps its leases but gets no new ones."""
    if conn.execute(_HOST_STATUS, {"host_id": host_id}).scalar() == "draining":
        raise NoCapacity(
            f"host {host_name!r} is draining: no new leases are placed on it",
            host=host_name,
            host_status="draining",
        )


_LEASE_IDS = select(Lease.tenant_id, Lease.host_id, Lease.device_id).where(
    Lease.id == bindparam("lease_id")
)


def move_if(
    conn: Connection,
    lease_id: str,
    expected: LeaseState,
    event: LeaseEvent,
    *,
    actor: str,
    reason: str,
    now: datetime,
    where: Sequence[Any] = (),
    values: dict[str, Any] | None = None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """One lease transition as a conditional update, plus its event: False if it lost a race.

    `UPDATE ... WHERE id = :id AND state = :expected [AND where...]` touches no
    row when another writer (a second poold's reaper, the holder releasing,
    an admin) moved the lease first; then nothing is written, so concurrent
    reapers on PostgreSQL never journal a transition twice. `where` carries
    the reason's own condition (e.g. `expires_at <= now`) so a renewal that
    lands between the caller's read and this write wins.
    """
    after = next_state(expected, event)
    ids = conn.execute(_LEASE_IDS, {"lease_id": lease_id}).one_or_none()
    if ids is None:
        return False
    changes: dict[str, Any] = {"state": after.value, **(values or {})}
    ended = after.value not in LIVE_STATE_VALUES
    if ended:
        changes["ended_at"] = now
    result = conn.execute(
        update(Lease)
        .where(Lease.id == lease_id, Lease.state == expected.value, *where)
        .values(**changes)
    )
    if result.rowcount != 1:
        return False
    if ended:
        conn.execute(_DEVICE_FREED, {"device_id": ids.device_id})
    conn.execute(
        _INSERT_EVENT,
        {
            "at": now,
            "actor": actor,
            "kind": f"lease.{event.value}",
            "lease_id": lease_id,
            "tenant_id": ids.tenant_id,
            "host_id": ids.host_id,
            "device_id": ids.device_id,
            "from_state": expected.value,
            "to_state": after.value,
            "reason": reason or None,
            "detail": detail or {},
        },
    )
    return True
