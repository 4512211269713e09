"""Who may lease, how much, and as which unix users: tenant records in the ledger."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from poold.errors import AlreadyExists, NotOwner, TenantInUse, UnknownTenant
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger import central_room, transitions
from poold.ledger.db import Ledger, Prepared, PreparedIn
from poold.ledger.models import Lease, Tenant
from poold.ledger.types import check_ints_fit, utcnow
from poold.wire.admin import TenantOut, TenantSpec, TenantUpdate


def get_by_name(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise UnknownTenant(f"no tenant named {name!r}", tenant=name)
    return tenant


def usage(session: Session, tenant_id: int) -> tuple[int, int]:
    """(live lease bytes, live lease count) held by a tenant."""
    row = session.execute(
        select(func.coalesce(func.sum(Lease.length_bytes), 0), func.count(Lease.id)).where(
            Lease.tenant_id == tenant_id, Lease.state.in_(LIVE_STATE_VALUES)
        )
    ).one()
    return int(row[0]), int(row[1])


def to_out(session: Session, tenant: Tenant) -> TenantOut:
    leased, count = usage(session, tenant.id)
    kept_bytes, _ = central_room.kept(tenant, utcnow())
    return TenantOut(
        id=tenant.id,
        name=tenant.name,
        quota_bytes=tenant.quota_bytes,
        quota_leases=tenant.quota_leases,
        allowed_media=list(tenant.allowed_media),
        allowed_uids=list(tenant.allowed_uids),
        allowed_gids=list(tenant.allowed_gids),
        allowed_hosts=list(tenant.allowed_hosts),
        leased_bytes=leased,
        live_leases=count,
        created_at=tenant.created_at,
        central_room_bytes=kept_bytes,
        central_room_until=tenant.central_room_until if kept_bytes else None,
    )


def create(session: Session, spec: TenantSpec, actor: str) -> Tenant:
    check_ints_fit(Tenant.__table__, spec.model_dump())
    if session.scalar(select(Tenant.id).where(Tenant.name == spec.name)) is not None:
        raise AlreadyExists(f"tenant {spec.name!r} already exists", tenant=spec.name)
    tenant = Tenant(
        name=spec.name,
        quota_bytes=spec.quota_bytes,
        quota_leases=spec.quota_leases,
        allowed_media=sorted(set(spec.allowed_media)),
        allowed_uids=sorted(set(spec.allowed_uids)),
        allowed_gids=sorted(set(spec.allowed_gids)),
        allowed_hosts=sorted(set(spec.allowed_hosts)),
        generation=0,
        created_at=utcnow(),
    )
    session.add(tenant)
    try:
        session.flush()
    except IntegrityError as exc:  # a concurrent create won the unique name
        raise AlreadyExists(f"tenant {spec.name!r} already exists", tenant=spec.name) from exc
    transitions.record(
        session,
        transitions.event_row(
            actor=actor, kind="tenant.create", tenant_id=tenant.id, detail=spec.model_dump()
        ),
    )
    return tenant


def _claim(session: Session, tenant: Tenant) -> None:
    """Bump the generation this transaction read, or raise `transitions.LostRace`.

    A quota change must not race a grant that read the old quota: swapping the
    generation read makes that grant's own swap fail, and it reads the new quota.
    Written as `generation + 1` instead, on PostgreSQL's READ COMMITTED it could
    overwrite a concurrent grant's bump with the same number, and a grant that read
    that number would then pass its swap after this change committed.
    """
    seen = tenant.generation
    transitions.swap_or_rerun(session.connection(), Tenant, tenant.id, seen)
    set_committed_value(tenant, "generation", seen + 1)  # what the row now holds


# Called in the same transaction when a tenant's quota changes (the delegation's claw
# back, poold/ledger/budget_sizing.py `claw_back`: passed in by the API, not imported).
QuotaHook = Callable[[Connection, int], None]


def update(
    session: Session,
    name: str,
    change: TenantUpdate,
    actor: str,
    on_quota_change: QuotaHook | None = None,
) -> Tenant:
    """Change a tenant; `transitions.LostRace` when a grant moved it since it was read."""
    tenant = get_by_name(session, name)
    fields = change.model_dump(exclude_none=True)
    check_ints_fit(Tenant.__table__, fields)
    _claim(session, tenant)
    for key, value in fields.items():
        setattr(tenant, key, sorted(set(value)) if isinstance(value, list) else value)
    if on_quota_change is not None and ("quota_bytes" in fields or "quota_leases" in fields):
        session.flush()
        on_quota_change(session.connection(), tenant.id)  # a cut below what is delegated
    transitions.record(
        session,
        transitions.event_row(
            actor=actor, kind="tenant.update", tenant_id=tenant.id, detail=fields
        ),
    )
    return tenant


def delete(session: Session, name: str, actor: str) -> None:
    """Delete a tenant without live leases (keep a tombstone if it has history).

    The claim comes first: a grant racing the delete then either committed before
    it (and the delete, read again, sees its lease) or fails its swap after it.
    """
    tenant = get_by_name(session, name)
    _claim(session, tenant)
    _, live = usage(session, tenant.id)
    if live:
        raise TenantInUse(f"tenant {name!r} still holds {live} live lease(s)", live_leases=live)
    if session.scalar(select(Lease.id).where(Lease.tenant_id == tenant.id).limit(1)):
        # Ended leases keep their history; the tenant is kept with no quota instead.
        tenant.quota_bytes = 0
        tenant.quota_leases = 0
        tenant.allowed_uids = []
        tenant.allowed_gids = []
        # The tombstone must fit the column (String(128)) that a 128-character
        # name already fills; PostgreSQL refuses an overlong value outright.
        suffix = f"~deleted~{tenant.id}"
        tenant.name = tenant.name[: Tenant.name.type.length - len(suffix)] + suffix
    else:
        session.delete(tenant)
    transitions.record(
        session,
        transitions.event_row(
            actor=actor, kind="tenant.delete", tenant_id=tenant.id, detail={"name": name}
        ),
    )


_TENANT_ROWS = select(
    Tenant.id,
    Tenant.name,
    Tenant.quota_bytes,
    Tenant.quota_leases,
    Tenant.allowed_media,
    Tenant.allowed_uids,
    Tenant.allowed_gids,
    Tenant.allowed_hosts,
    Tenant.generation,
    Tenant.central_room_bytes,
    Tenant.central_room_until,
)
# On the driver's cursor (db.Prepared): every grant reads it (most with the host's
# devices: poold/ledger/granting.py, as a `TenantRow`).
_TENANT_BY_NAME = Prepared(_TENANT_ROWS.where(Tenant.name == bindparam("name")))
TENANT_COLUMNS = tuple(_TENANT_ROWS.selected_columns)
TenantRow = namedtuple("TenantRow", [c.key for c in TENANT_COLUMNS])  # type: ignore[misc]


# Several by name (every op batch with local grants, every delegation call), unlocked
# and locked; built once: building it per call cost three times running it.
def _by_names(*, lock: bool) -> PreparedIn:
    def build(member: Callable[[Any, str], Any]) -> Any:
        stmt = _TENANT_ROWS.where(member(Tenant.name, "names")).order_by(Tenant.name)
        return stmt.with_for_update(key_share=True) if lock else stmt

    return PreparedIn(build)


_TENANTS_BY_NAMES = {lock: _by_names(lock=lock) for lock in (False, True)}


def resolve(conn: Connection, name: str | None, uid: int, gids: list[int], host: str) -> Any:
    """The tenant a process may act for: the one named, or the only one its ids map to.

    Identity comes from SO_PEERCRED via the agent; a name the process sends is a
    claim, checked here against the tenant's allowed uids/gids. Core rows (with
    the same attribute names as the model): this runs on every grant.
    """
    if name is not None:
        row = _TENANT_BY_NAME.one_or_none(conn, {"name": name})
        return check_named(row, name, uid, gids, host)
    matches = [row for row in conn.execute(_TENANT_ROWS) if may_act(row, uid, gids, host)]
    if not matches:
        raise NotOwner(f"uid {uid} on host {host!r} may not act for any tenant", uid=uid)
    if len(matches) > 1:
        names = sorted(row.name for row in matches)
        raise NotOwner(f"uid {uid} may act for several tenants {names}; name one", uid=uid)
    return matches[0]


def by_names(conn: Connection, names: Iterable[str], *, lock: bool = False) -> dict[str, Any]:
    """The named tenants' rows (as `resolve` reads them) in one statement; ``lock``: row
    locks taken in name order (PostgreSQL), so what is read
    is what the transaction commits against."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    return {row.name: row for row in _TENANTS_BY_NAMES[lock].rows(conn, {"names": wanted})}


def check_named(row: Any, name: str, uid: int, gids: list[int], host: str) -> Any:
    """`resolve`'s verdict on the tenant named ``name`` (``row``: its row, None if none)."""
    if row is None:
        raise UnknownTenant(f"no tenant named {name!r}", tenant=name)
    if not may_act(row, uid, gids, host):
        raise NotOwner(
            f"uid {uid} (gids {gids}) on host {host!r} may not act for tenant {name!r}",
            tenant=name,
            uid=uid,
        )
    return row


def may_act(tenant: Any, uid: int, gids: list[int], host: str) -> bool:
    """Can a process with these credentials, on this host, act for the tenant?"""
    if tenant.allowed_hosts and host not in tenant.allowed_hosts:
        return False
    return uid in tenant.allowed_uids or any(g in tenant.allowed_gids for g in gids)


# --- entry points: each owns its transaction (the API opens none) -------------------


def create_tenant(ledger: Ledger, spec: TenantSpec, actor: str) -> TenantOut:
    with ledger.write() as session:
        return to_out(session, create(session, spec, actor))


def list_tenants(ledger: Ledger) -> list[TenantOut]:
    with ledger.read() as session:
        return [to_out(session, t) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


def get_tenant(ledger: Ledger, name: str) -> TenantOut:
    with ledger.read() as session:
        return to_out(session, get_by_name(session, name))


def update_tenant(
    ledger: Ledger,
    name: str,
    change: TenantUpdate,
    actor: str,
    on_quota_change: QuotaHook | None = None,
) -> TenantOut:
    """`update` in a transaction of its own, again from a fresh read when it loses a race."""

    def attempt() -> TenantOut:
        with ledger.write() as session:
            return to_out(session, update(session, name, change, actor, on_quota_change))

    return transitions.retrying(attempt, what=f"the update of tenant {name!r}")


def delete_tenant(ledger: Ledger, name: str, actor: str) -> None:
    def attempt() -> None:
        with ledger.write() as session:
            delete(session, name, actor)

    transitions.retrying(attempt, what=f"the deletion of tenant {name!r}")
