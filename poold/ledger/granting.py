"""What every grant of a lease reads and writes alike: the tenant's quota use as the
granting transaction reads it (`quota_use`), the devices a host reaches with what
occupies them (`candidates`), and the one insert of a new lease row (`INSERT_LEASE`).

Its own module so that the central grant (poold/ledger/leases.py), the commit of a
lease an agent granted alone (poold/ledger/local_commit.py) and the placing of a
reservation (poold/ledger/delegation.py) share them without importing each other.
Core statements, prepared once: they run on every grant.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    case,
    func,
    insert,
    literal_column,
    select,
    text,
    union_all,
)

from poold import placement
from poold.extents import Extent
from poold.lease_states import LIVE_STATES_SQL
from poold.ledger import devices
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import InsertRows, Prepared, PreparedIn
from poold.ledger.models import Budget, Device, DevicePath, Host, Lease, Quarantine, Reservation

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")
_CENTRAL = Lease.reservation_id.is_(None)


def _tenant_use(lease_tenant: Any, budget_tenant: Any) -> Any:
    """What counts against quotas, in one statement: per tenant and host its live leases,
    central and local (granted inside a reservation) ("lease" rows), and its budgets
    ("budget" rows: bytes, leases). The arguments filter on the tenant column of
    each."""
    return union_all(
        select(
            literal_column("'lease'").label("kind"),
            Lease.tenant_id,
            Lease.host_id,
            func.coalesce(func.sum(case((_CENTRAL, Lease.length_bytes), else_=0)), 0),
            func.count(case((_CENTRAL, 1))),
            func.coalesce(func.sum(case((_CENTRAL, 0), else_=Lease.length_bytes)), 0),
            func.count(case((_CENTRAL, None), else_=1)),
        )
        .where(lease_tenant, _LIVE_SQL)
        .group_by(Lease.tenant_id, Lease.host_id),
        select(
            literal_column("'budget'"),
            Budget.tenant_id,
            Budget.host_id,
            Budget.bytes,
            Budget.leases,
            literal_column("0"),
            literal_column("0"),
        ).where(budget_tenant),
    )


# One tenant's, on every grant; many tenants' at once in `quota_uses`.
_TENANT_USE = Prepared(
    _tenant_use(
        Lease.tenant_id == bindparam("tenant_id"), Budget.tenant_id == bindparam("tenant_id")
    )
)
# Built once: building the union and its cache key on every call cost more than
# running it.
_TENANTS_USE = PreparedIn(
    lambda member: _tenant_use(
        member(Lease.tenant_id, "tenant_ids"), member(Budget.tenant_id, "tenant_ids")
    )
)
_HOST_ROW = select(Host.id).where(Host.id == bindparam("host_id"))
_HOST_STATE = Prepared(_HOST_ROW.with_only_columns(Host.status, Host.generation))
_HOST_DEVICES = Prepared(
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
        Device.reported_annotations,
        # The host's own, on every row: a grant reads them with its devices, one round
        # trip less (a host without devices is read alone: `host_state`).
        _HOST_ROW.with_only_columns(Host.status).scalar_subquery().label("host_status"),
        _HOST_ROW.with_only_columns(Host.generation).scalar_subquery().label("host_generation"),
    )
    .join(DevicePath, DevicePath.device_id == Device.id)
    .where(DevicePath.host_id == bindparam("host_id"), DevicePath.present.is_(True))
)
_HOST_DEVICE_IDS = select(DevicePath.device_id).where(
    DevicePath.host_id == bindparam("host_id"), DevicePath.present.is_(True)
)
# What occupies the host's devices, in one statement: live leases, quarantined ranges,
# and every reservation: a reservation occupies its bytes for a central grant, the
# requesting host's own too (its agent places local leases there without asking, so a
# central lease in them would collide with a local one not yet committed).
_USED = Prepared(
    union_all(
        select(Lease.device_id, Lease.offset_bytes, Lease.length_bytes).where(
            Lease.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery()), _LIVE_SQL
        ),
        select(Quarantine.device_id, Quarantine.offset_bytes, Quarantine.length_bytes).where(
            Quarantine.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery())
        ),
        select(Reservation.device_id, Reservation.offset_bytes, Reservation.length_bytes).where(
            Reservation.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery())
        ),
    )
)
# Every column a new lease row is given (central and local grants give the same).
NEW_LEASE_COLUMNS = (
    "id",
    "tenant_id",
    "host_id",
    "device_id",
    "offset_bytes",
    "length_bytes",
    "requested_bytes",
    "state",
    "ttl_s",
    "epoch",
    "granted_at",
    "activated_at",
    "expires_at",
    "ended_at",
    "holder_uid",
    "holder_gid",
    "holder_pid",
    "labels",
    "exclusive_bytes",
    "replica_bytes",
    "reported_at",
    "reservation_id",
)
INSERT_LEASE = Prepared(insert(Lease), column_keys=NEW_LEASE_COLUMNS)
# Several at once (an op batch's local grants: poold/ledger/write_behind.py).
INSERT_LEASES = InsertRows(insert(Lease), NEW_LEASE_COLUMNS)


def quota_use(conn: Connection, tenant_id: int) -> QuotaUse:
    """The tenant's quota use as this transaction reads it (under its generation swap)."""
    return _fold(_TENANT_USE.rows(conn, {"tenant_id": tenant_id})).get(tenant_id, QuotaUse())


def quota_uses(conn: Connection, tenant_ids: Iterable[int]) -> dict[int, QuotaUse]:
    """Each tenant's quota use in one statement (a delegation's budgets: one statement,
    not one per tenant)."""
    ids = sorted(set(tenant_ids))
    if not ids:
        return {}
    rows = _TENANTS_USE.rows(conn, {"tenant_ids": ids})
    found = _fold(rows)
    return {t: found.get(t, QuotaUse()) for t in ids}


def _fold(rows: Iterable[Any]) -> dict[int, QuotaUse]:
    central: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    local: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    budgets: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    # int(): PostgreSQL's SUM(bigint) is a numeric (Decimal), which would leak
    # into the quota_exceeded detail and fail to serialise to JSON.
    for kind, tenant_id, host_id, c_bytes, c_leases, l_bytes, l_leases in rows:
        tenant = int(tenant_id)
        if kind == "budget":
            budgets[tenant][int(host_id)] = (int(c_bytes), int(c_leases))
            continue
        use = central[tenant]
        use[0] += int(c_bytes)
        use[1] += int(c_leases)
        if l_leases:
            local[tenant][int(host_id)] = (int(l_bytes), int(l_leases))
    return {
        t: QuotaUse(central[t][0], central[t][1], local[t], budgets[t])
        for t in set(central) | set(budgets)
    }


def host_devices(conn: Connection, host_id: int) -> list[Any]:
    """The devices a host reaches (rows `candidates` takes)."""
    return _HOST_DEVICES.rows(conn, {"host_id": host_id})


def host_state(conn: Connection, host_id: int, rows: list[Any]) -> tuple[str, int]:
    """The host's status and generation, from its `host_devices` rows if it has any."""
    if rows:
        return rows[0].host_status, int(rows[0].host_generation)
    status, generation = _HOST_STATE.rows(conn, {"host_id": host_id})[0]
    return status, int(generation)


def candidates(
    conn: Connection, host_id: int, rows: list[Any] | None = None
) -> tuple[list[placement.Candidate], dict[int, dict[str, Any]]]:
    """The devices a host reaches (``rows``: as `host_devices` read them), with what
    occupies them, and how the host names them."""
    params = {"host_id": host_id}
    if rows is None:
        rows = host_devices(conn, host_id)
    if not rows:
        return [], {}
    used: dict[int, list[Extent]] = defaultdict(list)
    for device_id, offset, length in _USED.rows(conn, params):
        used[device_id].append(Extent(offset, length))
    reserved: dict[int, tuple[Extent, ...]] = {}
    for row in rows:  # held by dax devices poold did not place (poold/ledger/devices.py)
        reserved[row.id] = tuple(devices.reserved(row.reserved_extents))
        used[row.id].extend(reserved[row.id])
    found = [
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
            whole_only=devices.whole_only(row.reported_annotations),
            reserved=reserved[row.id],
        )
        for row in rows
    ]
    paths = {
        row.id: {"uid": row.uid, "numa_node": row.numa_node, "local_name": row.local_name}
        for row in rows
    }
    return found, paths
