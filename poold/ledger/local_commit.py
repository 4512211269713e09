"""May poold record the lease an agent granted alone inside its reservation, and
recording it (`commit`): the `local_grant` op of an agent's outbox.

Its own module because the checks are their own question: an ordinary op moves a lease
poold already holds from one state to the next (poold/ledger/leases.py), while a local
grant arrives as a lease poold has never seen, made within a delegation
(poold/ledger/delegation.py) whose reservation, epoch block and budget it must fit.
`leases.apply_ops` dispatches to it, so it runs in the batch's transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, text

from poold.errors import (
    BadRequest,
    BudgetExceeded,
    InvalidSize,
    LeaseOverlap,
    LocalGrantMismatch,
    NotOwner,
    OutsideReservation,
    UnknownReservation,
)
from poold.lease_states import LIVE_STATES_SQL, LeaseState
from poold.ledger import budgets, tenants, transitions
from poold.ledger.granting import INSERT_LEASE, quota_use
from poold.ledger.models import Budget, Device, Lease, Reservation, Tenant
from poold.ledger.transitions import event_row
from poold.ledger.types import check_ints_fit
from poold.wire.agent import LeaseOpResult
from poold.wire.delegation import EPOCH_BLOCK, LocalGrant

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")
_RESERVATION = (
    select(
        Reservation.id,
        Reservation.host_id,
        Reservation.device_id,
        Reservation.offset_bytes,
        Reservation.length_bytes,
        Reservation.epoch_base,
        Reservation.expires_at,
        Device.alignment_bytes,
    )
    .join(Device, Device.id == Reservation.device_id)
    .where(Reservation.id == bindparam("reservation_id"))
)
_LOCAL_GRANT_AS_RECORDED = select(
    Lease.host_id,
    Lease.reservation_id,
    Lease.tenant_id,
    Lease.offset_bytes,
    Lease.length_bytes,
    Lease.epoch,
    Lease.state,
).where(Lease.id == bindparam("lease_id"))
_OVERLAPPING = (
    select(Lease.id)
    .where(
        Lease.device_id == bindparam("device_id"),
        _LIVE_SQL,
        Lease.offset_bytes < bindparam("end"),
        Lease.offset_bytes + Lease.length_bytes > bindparam("offset"),
    )
    .limit(1)
)
_BUDGET_OF = select(Budget.bytes, Budget.leases).where(
    Budget.tenant_id == bindparam("tenant_id"), Budget.host_id == bindparam("host_id")
)
_LOCAL_USE = select(func.coalesce(func.sum(Lease.length_bytes), 0), func.count(Lease.id)).where(
    Lease.tenant_id == bindparam("tenant_id"),
    Lease.host_id == bindparam("host_id"),
    Lease.reservation_id.is_not(None),
    _LIVE_SQL,
)


def commit(
    conn: Connection, host_id: int, host_name: str, grant: LocalGrant, now: datetime, actor: str
) -> LeaseOpResult:
    """Record a lease the host's agent granted alone inside its reservation (an ordinary
    active lease from then on), or refuse it with a code; idempotent by lease id.

    Checked before anything is written: the reservation is this host's, the extent lies
    in it (aligned) and its epoch in its block, no live lease overlaps it, the process
    may act for the tenant there, and the tenant's budget on this host covers it. The
    tenant's generation is swapped, so a clawback that read the budget's use before this
    commits reads again (no quota excess between them).
    """
    recorded = conn.execute(_LOCAL_GRANT_AS_RECORDED, {"lease_id": grant.lease_id}).one_or_none()
    tenant = tenants.resolve(conn, grant.tenant, grant.uid, grant.gids, host_name)
    if recorded is not None:
        same = (
            recorded.host_id == host_id
            and recorded.reservation_id == grant.reservation_id
            and recorded.tenant_id == tenant.id
            and recorded.offset_bytes == grant.offset_bytes
            and recorded.length_bytes == grant.length_bytes
            and recorded.epoch == grant.epoch
        )
        if not same:
            raise LocalGrantMismatch(
                f"lease {grant.lease_id} is already recorded with other fields",
                lease_id=grant.lease_id,
            )
        return LeaseOpResult(lease_id=grant.lease_id, state=recorded.state)  # a replay
    res = conn.execute(_RESERVATION, {"reservation_id": grant.reservation_id}).one_or_none()
    if res is None:
        raise UnknownReservation(
            f"no reservation {grant.reservation_id!r}", reservation_id=grant.reservation_id
        )
    if res.host_id != host_id:
        raise NotOwner(
            f"reservation {res.id} is not held by host {host_name!r}", reservation_id=res.id
        )
    end_bytes = grant.offset_bytes + grant.length_bytes
    if (
        grant.offset_bytes < res.offset_bytes
        or end_bytes > res.offset_bytes + res.length_bytes
        or not res.epoch_base <= grant.epoch < res.epoch_base + EPOCH_BLOCK
    ):
        raise OutsideReservation(
            f"lease {grant.lease_id} [{grant.offset_bytes}, {end_bytes}) epoch {grant.epoch} "
            f"is outside reservation {res.id} [{res.offset_bytes}, "
            f"{res.offset_bytes + res.length_bytes}) epochs {res.epoch_base}+{EPOCH_BLOCK}",
            lease_id=grant.lease_id,
            reservation_id=res.id,
        )
    if grant.offset_bytes % res.alignment_bytes or grant.length_bytes % res.alignment_bytes:
        raise InvalidSize(
            f"lease {grant.lease_id} is not aligned to its device's {res.alignment_bytes} bytes",
            lease_id=grant.lease_id,
            alignment_bytes=res.alignment_bytes,
        )
    if grant.granted_at > res.expires_at:
        raise OutsideReservation(
            f"lease {grant.lease_id} was granted after reservation {res.id} expired",
            lease_id=grant.lease_id,
            reservation_id=res.id,
        )
    other = conn.execute(
        _OVERLAPPING,
        {"device_id": res.device_id, "offset": grant.offset_bytes, "end": end_bytes},
    ).scalar()
    if other is not None:
        raise LeaseOverlap(
            f"lease {grant.lease_id} overlaps live lease {other}",
            lease_id=grant.lease_id,
            other_lease_id=other,
        )
    if grant.requested_bytes > grant.length_bytes:
        raise BadRequest(
            f"lease {grant.lease_id} requested more bytes than it holds",
            lease_id=grant.lease_id,
        )
    check_ints_fit(Lease.__table__, {"holder_uid": grant.uid, "holder_pid": grant.pid})
    params = {"tenant_id": tenant.id, "host_id": host_id}
    budget = conn.execute(_BUDGET_OF, params).one_or_none()
    spent_bytes, spent_leases = (int(x) for x in conn.execute(_LOCAL_USE, params).one())
    # The budget is a mechanism, the quota the invariant: a grant its agent made before
    # hearing its budget was lowered (a quota cut, a central grant of this host, a fair
    # share) is kept when the quota has room for it (budgets.fit_local_grant). No budget
    # row at all: the agent never held one here, or asked it back having capped its view.
    if budget is None or (
        (spent_leases + 1 > budget.leases or spent_bytes + grant.length_bytes > budget.bytes)
        and not budgets.fit_local_grant(
            conn,
            tenant_id=tenant.id,
            host_id=host_id,
            use=quota_use(conn, tenant.id),
            quota_bytes=tenant.quota_bytes,
            quota_leases=tenant.quota_leases,
            length_bytes=grant.length_bytes,
            lease_id=grant.lease_id,
            actor=actor,
        )
    ):
        raise BudgetExceeded(
            f"tenant {tenant.name!r} on host {host_name!r} would hold "
            f"{spent_bytes + grant.length_bytes} bytes in {spent_leases + 1} local leases; "
            f"its budget there is "
            + ("none" if budget is None else f"{budget.bytes} bytes, {budget.leases} leases"),
            tenant=tenant.name,
            budget_bytes=0 if budget is None else budget.bytes,
            budget_leases=0 if budget is None else budget.leases,
        )
    if not transitions.compare_and_bump(conn, Tenant, tenant.id, tenant.generation):
        raise transitions.LostRace
    INSERT_LEASE.write(
        conn,
        {
            "id": grant.lease_id,
            "tenant_id": tenant.id,
            "host_id": host_id,
            "device_id": res.device_id,
            "offset_bytes": grant.offset_bytes,
            "length_bytes": grant.length_bytes,
            "requested_bytes": grant.requested_bytes,
            "state": LeaseState.ACTIVE.value,
            "ttl_s": grant.ttl_s,
            "epoch": grant.epoch,
            "granted_at": grant.granted_at,
            "activated_at": grant.granted_at,
            "expires_at": grant.granted_at + timedelta(seconds=grant.ttl_s),
            "ended_at": None,
            "holder_uid": grant.uid,
            "holder_gid": grant.gids[0] if grant.gids else None,
            "holder_pid": grant.pid,
            "labels": dict(grant.labels),
            "exclusive_bytes": 0,
            "replica_bytes": 0,
            "reported_at": None,
            "reservation_id": res.id,
        },
    )
    common: dict[str, Any] = {
        "at": now,
        "actor": actor,
        "lease_id": grant.lease_id,
        "tenant_id": tenant.id,
        "host_id": host_id,
        "device_id": res.device_id,
    }
    transitions.record(
        conn,
        event_row(
            **common,
            kind="lease.grant",
            to_state="granted",
            detail={
                "offset_bytes": grant.offset_bytes,
                "length_bytes": grant.length_bytes,
                "epoch": grant.epoch,
                "uid": grant.uid,
                "pid": grant.pid,
                "reservation_id": res.id,
                "granted_at": grant.granted_at.isoformat(),
            },
        ),
        event_row(**common, kind="lease.activate", from_state="granted", to_state="active"),
    )
    return LeaseOpResult(lease_id=grant.lease_id, state=LeaseState.ACTIVE.value)
