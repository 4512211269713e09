"""What every grant of a lease reads and writes alike: the tenant's quota use as the
granting transaction reads it (`quota_use`), the devices a host reaches with what
occupies them (`candidates`), and the one insert of a new lease row (`INSERT_LEASE`).
On PostgreSQL a central grant reads them in two statements: the host's devices with
the tenant it names (`host_devices_and_tenant`), then the quota use with the occupancy
(`use_and_occupancy`, merged into runs by the database); on SQLite the tenant alone
besides, and every occupying extent.

Its own module so that the central grant (poold/ledger/leases.py), the commit of a
lease an agent granted alone (poold/ledger/local_commit.py) and the placing of a
reservation (poold/ledger/delegation.py) share them without importing each other.
Core statements, prepared once: they run on every grant.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Connection,
    bindparam,
    case,
    cast,
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
from poold.ledger import devices, tenants
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import InsertRows, Prepared, PreparedIn
from poold.ledger.models import (
    Budget,
    Device,
    DevicePath,
    Host,
    Lease,
    Quarantine,
    Reservation,
    Tenant,
)

_LIVE_SQL = text(f"leases.state IN {LIVE_STATES_SQL}")
_CENTRAL = Lease.reservation_id.is_(None)


def _sum(value: Any) -> Any:
    # BIGINT, not PostgreSQL's numeric SUM(bigint): the union it is in then has one type
    # per column, so the offsets of `_USE_AND_USED` come back as ints, not Decimals.
    return cast(func.coalesce(func.sum(value), 0), BigInteger)


def _tenant_use_rows(lease_tenant: Any, budget_tenant: Any) -> tuple[Any, Any]:
    """What counts against quotas: per tenant and host its live leases, central and
    local (granted inside a reservation) ("lease" rows), and its budgets ("budget" rows:
    bytes, leases); two selects of one shape, for a union. The arguments filter on the
    tenant column of each."""
    return (
        select(
            literal_column("'lease'").label("kind"),
            Lease.tenant_id,
            Lease.host_id,
            _sum(case((_CENTRAL, Lease.length_bytes), else_=0)),
            func.count(case((_CENTRAL, 1))),
            _sum(case((_CENTRAL, 0), else_=Lease.length_bytes)),
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


def _tenant_use(lease_tenant: Any, budget_tenant: Any) -> Any:
    """`_tenant_use_rows` in one statement."""
    return union_all(*_tenant_use_rows(lease_tenant, budget_tenant))


# One tenant's, on every grant; many tenants' at once in `quota_uses`.
_ONE_TENANT = (
    Lease.tenant_id == bindparam("tenant_id"),
    Budget.tenant_id == bindparam("tenant_id"),
)
_TENANT_USE = Prepared(_tenant_use(*_ONE_TENANT))
# Built once: building the union and its cache key on every call cost more than
# running it.
_TENANTS_USE = PreparedIn(
    lambda member: _tenant_use(
        member(Lease.tenant_id, "tenant_ids"), member(Budget.tenant_id, "tenant_ids")
    )
)
_HOST_ROW = select(Host.id).where(Host.id == bindparam("host_id"))
_HOST_STATE = Prepared(_HOST_ROW.with_only_columns(Host.status, Host.generation))
_HOST_DEVICES_READ = (
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
_HOST_DEVICES = Prepared(_HOST_DEVICES_READ)
# With the row of the tenant a grant names after the device's own columns (NULLs: no
# such tenant): one round trip less on every grant that names its tenant. On the first
# row only, NULLs on the others: each value is decoded once (its JSON, its datetime),
# not once per device the host reaches.
_FIRST_ROW = func.row_number().over() == 1
_HOST_DEVICES_AND_TENANT = Prepared(
    _HOST_DEVICES_READ.add_columns(
        *(
            case((_FIRST_ROW, column)).label(f"tenant_{column.key}")
            for column in tenants.TENANT_COLUMNS
        )
    ).outerjoin(Tenant, Tenant.name == bindparam("tenant"))
)
_DEVICE_COLUMNS = len(_HOST_DEVICES_READ.selected_columns)


class Unread(enum.Enum):
    """`host_devices_and_tenant`: the tenant was not read (the caller resolves it)."""

    UNREAD = "unread"


UNREAD: Final = Unread.UNREAD
_HOST_DEVICE_IDS = select(DevicePath.device_id).where(
    DevicePath.host_id == bindparam("host_id"), DevicePath.present.is_(True)
)
# What occupies the host's devices: live leases, quarantined ranges, and every
# reservation: a reservation occupies its bytes for a central grant, the requesting
# host's own too (its agent places local leases there without asking, so a central
# lease in them would collide with a local one not yet committed). Each select gives
# (device id, offset, length).
_OCCUPYING = tuple(
    select(table.device_id, table.offset_bytes, table.length_bytes).where(
        table.device_id.in_(_HOST_DEVICE_IDS.scalar_subquery()), *where
    )
    for table, where in ((Lease, (_LIVE_SQL,)), (Quarantine, ()), (Reservation, ()))
)


def _islands() -> Any:
    """What `_OCCUPYING` gives, merged by PostgreSQL into its maximal runs (device id,
    offset, length): overlapping or touching extents are one, as `extents.normalise_used`
    would make them. A grant then decodes a row per run, not one per live lease of the
    device (~1.6 us of poold's Python per lease: 300 held made a central grant 2.06 ms
    instead of 1.44; packed by best fit, they are a few runs). Two window passes: a row
    starts a run when it begins after every end before it; the runs are numbered by a
    running sum of those starts."""
    occupied = union_all(*_OCCUPYING).subquery("occupied")
    device, offset = occupied.c.device_id, occupied.c.offset_bytes
    end = offset + occupied.c.length_bytes
    order = (offset, end)
    ends_before = func.max(end).over(partition_by=device, order_by=order, rows=(None, -1))
    starts = select(
        device.label("device_id"),
        offset.label("start"),
        end.label("stop"),
        case((offset > func.coalesce(ends_before, -1), 1), else_=0).label("starts_run"),
    ).subquery("starts")
    numbered = select(
        starts.c.device_id,
        starts.c.start,
        starts.c.stop,
        # RANGE, the default frame, not ROWS: rows tied on (start, stop) are peers and
        # share one number, whatever order this pass sees them in (with ROWS, a copy
        # that did not start the run could take the number of the run before it when
        # the plan sorted the two passes apart, and close the gap between).
        func.sum(starts.c.starts_run)
        .over(partition_by=starts.c.device_id, order_by=(starts.c.start, starts.c.stop))
        .label("run"),
    ).subquery("numbered")
    start = func.min(numbered.c.start)
    return select(
        numbered.c.device_id,
        cast(start, BigInteger).label("offset_bytes"),
        cast(func.max(numbered.c.stop) - start, BigInteger).label("length_bytes"),
    ).group_by(numbered.c.device_id, numbered.c.run)


def _used_rows(occupied: tuple[Any, ...]) -> list[Any]:
    """``occupied``'s selects in the shape of `_tenant_use_rows`, for one union: "used"
    rows of device id twice, offset, length."""
    return [
        select_.with_only_columns(
            literal_column("'used'"),
            select_.selected_columns[0],
            select_.selected_columns[0],
            select_.selected_columns[1],
            select_.selected_columns[2],
            literal_column("0"),
            literal_column("0"),
        )
        for select_ in occupied
    ]


# What occupies the host's devices, as each backend reads it best: PostgreSQL merges it
# into runs (`_islands`); SQLite, where the statement runs in poold's own process, reads
# every extent (its window passes over 1,000 extents took 2.7-3.2 ms, their plain read
# 0.33 ms).
_OCCUPIED: Final = {"postgresql": (_islands(),), "sqlite": _OCCUPYING}
_USED: Final = {name: Prepared(union_all(*sel)) for name, sel in _OCCUPIED.items()}
# A central grant's two reads after the host's devices, in one statement (one round trip
# less on every grant): the tenant's quota use ("lease" and "budget" rows) and what
# occupies the devices ("used" rows).
_USE_AND_USED: Final = {
    name: Prepared(union_all(*_tenant_use_rows(*_ONE_TENANT), *_used_rows(sel)))
    for name, sel in _OCCUPIED.items()
}
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
    # int(): whatever the driver hands back (the sums are cast to BIGINT, `_sum`), a
    # Decimal would leak into the quota_exceeded detail and fail to serialise to JSON.
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


def use_and_occupancy(
    conn: Connection, tenant_id: int, host_id: int
) -> tuple[QuotaUse, dict[int, list[Extent]]]:
    """`quota_use` and what occupies the host's devices (for `candidates`), read in one
    statement."""
    use: list[Any] = []
    used: list[tuple[int, int, int]] = []
    read = _USE_AND_USED[conn.dialect.name]
    for row in read.tuples(conn, {"tenant_id": tenant_id, "host_id": host_id}):
        if row[0] == "used":
            used.append((row[1], row[3], row[4]))
        else:
            use.append(row)
    return _fold(use).get(tenant_id, QuotaUse()), _by_device(used)


def _by_device(rows: Iterable[tuple[int, int, int]]) -> dict[int, list[Extent]]:
    """(device id, offset, length) rows of what occupies devices, as extents by device."""
    used: dict[int, list[Extent]] = defaultdict(list)
    for device_id, offset, length in rows:
        used[device_id].append(Extent(offset, length))
    return used


def host_devices(conn: Connection, host_id: int) -> list[Any]:
    """The devices a host reaches (rows `candidates` takes)."""
    return _HOST_DEVICES.rows(conn, {"host_id": host_id})


def host_devices_and_tenant(
    conn: Connection, host_id: int, tenant: str | None
) -> tuple[list[Any], Any | Unread | None]:
    """`host_devices`, and the row of the tenant named ``tenant`` (a `tenants.TenantRow`;
    None: no such tenant), read in one statement. `UNREAD` instead of the row when no
    tenant is named, or the host reaches no device (no row to carry it), and on SQLite:
    there a statement is a call, not a round trip, and the tenant's columns on the
    device rows cost more than its own read (the rows' decoding: 41 -> 52 us at four
    devices, 110 -> 157 at sixteen)."""
    if tenant is None or conn.dialect.name == "sqlite":
        return host_devices(conn, host_id), UNREAD
    rows = _HOST_DEVICES_AND_TENANT.rows(conn, {"host_id": host_id, "tenant": tenant})
    if not rows:
        return rows, UNREAD
    # The row that carries it (the first the database numbered; no order is assumed).
    for row in rows:
        if row[_DEVICE_COLUMNS] is not None:
            return rows, tenants.TenantRow._make(row[_DEVICE_COLUMNS:])
    return rows, None


def host_state(conn: Connection, host_id: int, rows: list[Any]) -> tuple[str, int]:
    """The host's status and generation, from its `host_devices` rows if it has any."""
    if rows:
        return rows[0].host_status, int(rows[0].host_generation)
    status, generation = _HOST_STATE.rows(conn, {"host_id": host_id})[0]
    return status, int(generation)


def candidates(
    conn: Connection,
    host_id: int,
    rows: list[Any] | None = None,
    used: dict[int, list[Extent]] | None = None,
) -> tuple[list[placement.Candidate], dict[int, dict[str, Any]]]:
    """The devices a host reaches (``rows``: as `host_devices` read them), with what
    occupies them (``used``: as `use_and_occupancy` read it, extended here with the
    devices' reserved extents), and how the host names them."""
    params = {"host_id": host_id}
    if rows is None:
        rows = host_devices(conn, host_id)
    if not rows:
        return [], {}
    if used is None:
        used = _by_device(_USED[conn.dialect.name].tuples(conn, params))
    reserved: dict[int, tuple[Extent, ...]] = {}
    for row in rows:  # held by dax devices poold did not place (poold/ledger/devices.py)
        reserved[row.id] = tuple(devices.reserved(row.reserved_extents))
        used.setdefault(row.id, []).extend(reserved[row.id])
    found = [
        placement.Candidate(
            device_id=row.id,
            kind=row.kind,
            media=row.media,
            state=row.state,
            health=row.health,
            capacity_bytes=row.capacity_bytes,
            alignment_bytes=row.alignment_bytes,
            used=tuple(used.get(row.id, ())),
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
