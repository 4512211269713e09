"""Which hosts exist, and how do their agents authenticate?

An administrator adds a host and gets its agent credential once; poold keeps
only a SHA-256 of it (the credential is 256 random bits, so a slow hash would
add latency to every agent request and no security). What a host's heartbeat
changes is poold/ledger/heartbeat.py.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import Connection, bindparam, select
from sqlalchemy.orm import Session

from poold.errors import AlreadyExists, Unauthorized, UnknownHost
from poold.ledger import transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Host
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
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        raise UnknownHost(f"no host named {name!r}", host=name)
    return host


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
        return [to_out(h) for h in session.scalars(select(Host).order_by(Host.name))]


def authenticate(ledger: Ledger, credential_digest: str) -> str:
    """The host name behind an agent credential's digest, or `unauthorized`."""
    with ledger.read() as session:
        return authenticate_name(session.connection(), credential_digest)
