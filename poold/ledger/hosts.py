"""Which hosts exist, and how do their agents authenticate?

An administrator adds a host and gets its agent credential once; poold keeps
only a SHA-256 of it (the credential is 256 random bits, so a slow hash would
add latency to every agent request and no security). What a host's heartbeat
changes is poold/ledger/heartbeat.py.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from sqlalchemy import Connection, bindparam, delete, select
from sqlalchemy.orm import Session

from poold.errors import AlreadyExists, NotOwner, Unauthorized, UnknownHost
from poold.ledger import transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Base, Host, Lease
from poold.ledger.types import utcnow
from poold.wire.admin import HostCreated, HostOut


def hash_credential(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


def new_credential(name: str) -> str:
    return f"pa1.{name}.{secrets.token_urlsafe(32)}"


def to_out(host: Host) -> HostOut:
    return HostOut(
        id=host.id,
        name=host.name,
        status=host.status,
        last_heartbeat_at=host.last_heartbeat_at,
        created_at=host.created_at,
    )


def add(session: Session, name: str, actor: str) -> tuple[Host, str]:
    """Create a host and its agent credential (returned once, never stored in clear)."""
    if session.scalar(select(Host.id).where(Host.name == name)) is not None:
        raise AlreadyExists(f"host {name!r} already exists", host=name)
    credential = new_credential(name)
    host = Host(
        name=name, status="down", credential_hash=hash_credential(credential), created_at=utcnow()
    )
    session.add(host)
    session.flush()
    transitions.record(
        session,
        transitions.event_row(actor=actor, kind="host.add", host_id=host.id, detail={"name": name}),
    )
    return host, credential


def get_by_name(session: Session, name: str) -> Host:
    # A deleted host's tombstone (`remove`) is no host: it is never found by name.
    host = session.scalar(select(Host).where(Host.name == name, Host.status != DELETED))
    if host is None:
        raise UnknownHost(f"no host named {name!r}", host=name)
    return host


# --- deletion --------------------------------------------------------------------------

# The status of a deleted host's tombstone: kept (renamed, without a credential) only
# while leases point at it, so their history keeps its host.
DELETED = "deleted"


def delete_cascading(session: Session, parent: str, row_id: int) -> None:
    """Delete the rows that name `parent`'s row `row_id` in a foreign key ON DELETE CASCADE.

    Explicit, not left to the database: a host kept as a tombstone is not deleted, yet
    what would cascade with it (device paths, remembered agent requests, which devices
    it may report) must go; and the models' metadata lists every such table, so one
    added later goes too.
    """
    for table in reversed(Base.metadata.sorted_tables):
        for fk in table.foreign_keys:
            if fk.column.table.name == parent and fk.ondelete == "CASCADE":
                session.execute(delete(table).where(fk.parent == row_id))


def remove(session: Session, host: Host, actor: str, detail: dict[str, Any]) -> bool:
    """Delete a host without live leases: its credential stops matching at once.

    What cascades with it goes (`delete_cascading`). A host that ever held a lease
    is kept as a tombstone, as a deleted tenant is: renamed `<name>~deleted~<id>` (the
    name is free for `hosts add` again), status `deleted`, and a credential hash no
    credential has (the SHA-256 of 256 random bits nobody keeps). True when it was kept.
    """
    delete_cascading(session, "hosts", host.id)
    name = host.name
    kept = session.scalar(select(Lease.id).where(Lease.host_id == host.id).limit(1)) is not None
    if kept:
        suffix = f"~deleted~{host.id}"
        host.name = name[: Host.name.type.length - len(suffix)] + suffix
        host.status = DELETED
        host.credential_hash = hash_credential(secrets.token_urlsafe(32))
        host.agent_leases = None
        host.agent_leases_at = None
        host.inventory_digest = None
    else:
        session.delete(host)
    transitions.record(
        session,
        transitions.event_row(
            actor=actor,
            kind="host.delete",
            host_id=host.id,
            detail={"name": name, "history_kept": kept, **detail},
        ),
    )
    session.flush()
    return kept


_NAME_BY_CREDENTIAL = select(Host.name).where(Host.credential_hash == bindparam("digest"))


def authenticate_name(conn: Connection, credential_digest: str) -> str:
    """The host whose agent credential hashes to this digest (Core: every request does it)."""
    name = conn.execute(_NAME_BY_CREDENTIAL, {"digest": credential_digest}).scalar()
    if name is None:
        raise Unauthorized("unknown agent credential")
    return str(name)


# --- entry points: each owns its transaction (the API opens none) -------------------


def add_host(ledger: Ledger, name: str, actor: str) -> HostCreated:
    with ledger.write() as session:
        host, credential = add(session, name, actor)
        return HostCreated(**to_out(host).model_dump(), credential=credential)


def list_hosts(ledger: Ledger) -> list[HostOut]:
    with ledger.read() as session:
        stmt = select(Host).where(Host.status != DELETED).order_by(Host.name)
        return [to_out(h) for h in session.scalars(stmt)]


def authenticate(ledger: Ledger, credential_digest: str) -> str:
    """The host name behind an agent credential's digest, or `unauthorized`."""
    with ledger.read() as session:
        return authenticate_name(session.connection(), credential_digest)


# --- a host's id, on the lease path ----------------------------------------------------

_HOST_ID = select(Host.id).where(Host.name == bindparam("host_name"))


def host_id(ledger: Ledger, conn: Connection, host_name: str) -> int:
    """A registered host's id, in ``conn``'s transaction (cached: hosts are looked up on
    every lease call); ``not_owner`` for a name no host has."""
    cached = ledger.host_ids.get(host_name)
    if cached is not None:
        return cached
    found = conn.execute(_HOST_ID, {"host_name": host_name}).scalar()
    if found is None:
        raise NotOwner(f"host {host_name!r} is not registered")
    ledger.host_ids[host_name] = int(found)
    return int(found)


def host_id_of(ledger: Ledger, host_name: str) -> int:
    """A registered host's id (cached: hosts are looked up on every lease call)."""
    cached = ledger.host_ids.get(host_name)
    if cached is not None:
        return cached
    with ledger.read() as s:
        return host_id(ledger, s.connection(), host_name)
