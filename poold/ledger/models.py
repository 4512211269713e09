"""What the ledger stores: the SQLAlchemy 2 models (DESIGN.md "The ledger").

The schema changes only through alembic revisions in migrations/; a test walks
them and checks they agree with these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ExcludeConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from poold.lease_states import LIVE_STATES_SQL
from poold.ledger.types import UTCDateTime

# Stable constraint names so that migrations can refer to them on every backend.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


def _ts() -> Mapped[datetime]:
    return mapped_column(UTCDateTime(), nullable=False)


class Host(Base):
    """One agent: a host that reaches some devices and serves tenants."""

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="down")  # up/down/draining
    credential_hash: Mapped[str] = mapped_column(String(64), unique=True)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    inventory_digest: Mapped[str | None] = mapped_column(String(64))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _ts()
    # What the agent last said it holds (audit: leaked / stale / scrubs / holders): older
    # agents' list of lease ids, or {"leases": [...], "leftovers": [...]}
    # (agent_reports.stored_report).
    agent_leases: Mapped[list[Any] | dict[str, Any] | None] = mapped_column(JSON)
    agent_leases_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Bumped by a drain and an undrain, swapped by every grant placed on the host: a
    # grant that read the host `up` before a drain committed loses its swap (pattern 1).
    generation: Mapped[int] = mapped_column(BigInteger, default=0)


class Device(Base):
    """A pool of far memory poold can carve: devdax region, NUMA node or emulated memfd."""

    __tablename__ = "devices"
    __table_args__ = (
        CheckConstraint("capacity_bytes >= 0", name="capacity"),
        CheckConstraint("alignment_bytes > 0", name="alignment"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(256), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    media: Mapped[str] = mapped_column(String(32), default="unknown")
    recycled: Mapped[bool] = mapped_column(Boolean, default=False)
    provenance: Mapped[str | None] = mapped_column(Text)
    cost_per_gib_month: Mapped[float | None] = mapped_column(Float)
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    alignment_bytes: Mapped[int] = mapped_column(BigInteger)
    health: Mapped[str] = mapped_column(String(16), default="unknown")
    state: Mapped[str] = mapped_column(String(16), default="online")
    # Bumped by every mutation of the device's allocations (STYLE.md pattern 1).
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = _ts()
    updated_at: Mapped[datetime] = _ts()
    memdev_serials: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
    health_reasons: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")
    # media/recycled/provenance/cost_per_gib_month above are what placement and poolctl
    # use: the administrator's annotation where there is one, else the agent's. Both
    # sources are kept so that either can change (or an admin field be cleared) later.
    reported_annotations: Mapped[dict[str, Any]] = mapped_column(
        JSON, default=dict, server_default="{}"
    )
    admin_annotations: Mapped[dict[str, Any]] = mapped_column(
        JSON, default=dict, server_default="{}"
    )
    # [[offset, length], ...] that the agent found in use by something poold did not
    # create (e.g. the kernel's dax0.0 claiming a region): never placed on.
    reserved_extents: Mapped[list[Any]] = mapped_column(JSON, default=list, server_default="[]")


class DevicePath(Base):
    """Which host reaches which device, under what local name and at what cost."""

    __tablename__ = "device_paths"
    __table_args__ = (UniqueConstraint("device_id", "host_id", name="uq_device_paths_device_host"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    local_name: Mapped[str] = mapped_column(String(64), default="")
    numa_node: Mapped[int | None] = mapped_column(Integer)
    read_latency_ns: Mapped[int | None] = mapped_column(Integer)
    write_latency_ns: Mapped[int | None] = mapped_column(Integer)
    read_bandwidth_mbps: Mapped[int | None] = mapped_column(Integer)
    write_bandwidth_mbps: Mapped[int | None] = mapped_column(Integer)
    distance: Mapped[int | None] = mapped_column(Integer)
    memory_tier: Mapped[int | None] = mapped_column(Integer)
    present: Mapped[bool] = mapped_column(Boolean, default=True)
    seen_at: Mapped[datetime] = _ts()


class DeviceHost(Base):
    """A host that may report a device (and so reach it for placement).

    A heartbeat's inventory item for a device its host is not bound to is refused
    whole (poold/ledger/device_hosts.py): no path, no capacity, health or media
    change. Bindings go with their host or device (ON DELETE CASCADE).
    """

    __tablename__ = "device_hosts"
    __table_args__ = (UniqueConstraint("device_id", "host_id", name="uq_device_hosts_device_host"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    # How the binding came about: "first_sight" (the device's first report), "admin"
    # (`poolctl devices allow-host`) or "path" (migration 0007, from a device_paths row).
    source: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = _ts()


class Tenant(Base):
    """A KV-cache tenant: quotas, allowed media, and who may act for it."""

    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("quota_bytes >= 0", name="quota_bytes"),
        CheckConstraint("quota_leases >= 0", name="quota_leases"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    quota_bytes: Mapped[int] = mapped_column(BigInteger)
    quota_leases: Mapped[int] = mapped_column(Integer)
    allowed_media: Mapped[list[Any]] = mapped_column(JSON, default=list)
    allowed_uids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    allowed_gids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    allowed_hosts: Mapped[list[Any]] = mapped_column(JSON, default=list)  # empty = any host
    # Bumped with every grant so concurrent grants cannot both pass the quota check.
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = _ts()
    # Quota kept out of hosts' budgets until then, for central grants their unspent
    # budgets refused (poold/ledger/central_room.py).
    central_room_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    central_room_until: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Lease(Base):
    """A byte range of a device handed to one tenant on one host."""

    __tablename__ = "leases"
    __table_args__ = (
        CheckConstraint("length_bytes > 0", name="length"),
        CheckConstraint("offset_bytes >= 0", name="offset"),
        Index("ix_leases_device_state", "device_id", "state"),
        Index("ix_leases_tenant_state", "tenant_id", "state"),
        Index("ix_leases_host_state", "host_id", "state"),
        Index("ix_leases_shrink_deadline", "shrink_deadline_at"),
        # Overlap between live leases is impossible on PostgreSQL even for a
        # buggy caller; SQLite relies on the allocator's generation check.
        ExcludeConstraint(
            ("device_id", "="),
            (text("int8range(offset_bytes, offset_bytes + length_bytes)"), "&&"),
            name="ex_leases_no_overlap",
            using="gist",
            where=text(f"state IN {LIVE_STATES_SQL}"),
        ).ddl_if(dialect="postgresql"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"))
    offset_bytes: Mapped[int] = mapped_column(BigInteger)
    length_bytes: Mapped[int] = mapped_column(BigInteger)
    requested_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    ttl_s: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(BigInteger)
    granted_at: Mapped[datetime] = _ts()
    activated_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = _ts()
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    holder_uid: Mapped[int | None] = mapped_column(Integer)
    holder_gid: Mapped[int | None] = mapped_column(Integer)
    holder_pid: Mapped[int | None] = mapped_column(Integer)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # The holder's last accounting report (DESIGN.md "Exclusive-copy accounting");
    # reported_at None: never reported. Written by heartbeat.store_reports.
    exclusive_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    replica_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    reported_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    used_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    exclusive_blocks: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    replica_blocks: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Pressure: poold asked the holder to give back this many bytes by the deadline,
    # after which the reaper revokes the lease (DESIGN.md "Pressure"). None: no request.
    shrink_wanted_bytes: Mapped[int | None] = mapped_column(BigInteger)
    shrink_deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Where the lease was granted: the host's reservation its agent placed it in (a
    # local grant, poold/ledger/delegation.py), or None: centrally, by poold. No foreign
    # key: the reservation row goes once returned, the lease row stays as history.
    reservation_id: Mapped[str | None] = mapped_column(String(36), index=True)


class Reservation(Base):
    """An extent of a device reserved for one host, whose agent grants leases inside it
    alone (DESIGN.md "Delegated capacity"; poold/ledger/delegation.py).

    Occupies the device like a lease for everyone else. `state` "held": renewed by the
    host's heartbeat, takes local grants; "returning": drained, expired or its host is
    down, takes no new lease, and goes once no live lease lies in it.
    """

    __tablename__ = "reservations"
    __table_args__ = (
        CheckConstraint("length_bytes > 0", name="length"),
        CheckConstraint("offset_bytes >= 0", name="offset"),
        Index("ix_reservations_device_id", "device_id"),
        # Reservations never overlap each other, even for a buggy caller (PostgreSQL).
        ExcludeConstraint(
            ("device_id", "="),
            (text("int8range(offset_bytes, offset_bytes + length_bytes)"), "&&"),
            name="ex_reservations_no_overlap",
            using="gist",
        ).ddl_if(dialect="postgresql"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    offset_bytes: Mapped[int] = mapped_column(BigInteger)
    length_bytes: Mapped[int] = mapped_column(BigInteger)
    # Local leases inside take epochs epoch_base .. epoch_base + EPOCH_BLOCK - 1.
    epoch_base: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = _ts()
    expires_at: Mapped[datetime] = _ts()


class Budget(Base):
    """A tenant's slice of its quota (bytes, leases) that one host's agent spends alone.

    The tenant's quota use is its central leases plus, per host, the larger of its
    budget there and its local leases there (poold/ledger/delegation.py).
    """

    __tablename__ = "budgets"
    __table_args__ = (
        UniqueConstraint("tenant_id", "host_id", name="uq_budgets_tenant_host"),
        CheckConstraint("bytes >= 0", name="bytes"),
        CheckConstraint("leases >= 0", name="leases"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    leases: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = _ts()
    expires_at: Mapped[datetime] = _ts()


class Event(Base):
    """Append-only journal of every state change: who, what, when, why."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _ts()
    actor: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    lease_id: Mapped[str | None] = mapped_column(String(36), index=True)
    tenant_id: Mapped[int | None] = mapped_column(Integer)
    host_id: Mapped[int | None] = mapped_column(Integer)
    device_id: Mapped[int | None] = mapped_column(Integer)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Quarantine(Base):
    """Device ranges never to be allocated (media poison, failed scrub)."""

    __tablename__ = "quarantine"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"), index=True)
    offset_bytes: Mapped[int] = mapped_column(BigInteger)
    length_bytes: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = _ts()


class AuditRun(Base):
    """What one reclamation audit found and did."""

    __tablename__ = "audit_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = _ts()
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    reclaim: Mapped[bool] = mapped_column(Boolean, default=False)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    findings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class AgentRequest(Base):
    """The answer poold gave to one request an agent named (a grant, an op batch).

    Written in the transaction of the change it answers, so a retry of the same
    request id from the same host gets this answer instead of a second change.
    The reaper forgets rows older than its retention (ReaperPolicy).
    """

    __tablename__ = "agent_requests"
    __table_args__ = (
        UniqueConstraint("host_id", "request_id", name="uq_agent_requests_host_request"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    request_id: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # "grant" / "ops"
    response: Mapped[list[Any] | dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), nullable=False, index=True)
