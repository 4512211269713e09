"""What travels over poold's HTTP API: one set of pydantic models shared by poold,
the agent (its poold client) and poolctl, so that the wire format is written once."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Kinds of pool device poold can carve (DESIGN.md "devices").
DeviceKind = Literal["devdax", "numa", "emulated"]
# Media classes; "unknown" when neither sysfs nor an annotation tells.
MediaClass = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_\-]+$")]
DeviceState = Literal["online", "draining", "failed", "retired", "missing"]
HealthState = Literal["ok", "warning", "critical", "unknown"]

MAX_LEASE_BYTES = 1 << 50  # 1 PiB: anything larger is a typo, not a request
MAX_TTL_S = 7 * 24 * 3600


class Model(BaseModel):
    """Base for wire models: unknown fields are errors, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid")


class InventoryDevice(Model):
    """One pool device as an agent sees it from its host."""

    uid: Annotated[str, Field(min_length=1, max_length=256)]
    kind: DeviceKind
    media: MediaClass = "unknown"
    recycled: bool = False
    provenance: str | None = None
    cost_per_gib_month: float | None = Field(default=None, ge=0)
    capacity_bytes: int = Field(ge=0)
    alignment_bytes: int = Field(default=2 << 20, gt=0)
    health: HealthState = "unknown"
    # How this host reaches it (becomes a device_paths row).
    local_name: str = ""
    numa_node: int | None = None
    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None
    distance: int | None = None
    # Kernel memory tier (/sys/devices/virtual/memory_tiering) of numa_node on this host.
    memory_tier: int | None = None
    # CXL memdev serials behind the device (empty for non-CXL memory).
    memdev_serials: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=4096)
    # Why health is not "ok" ("serial 3: life used 95%"), from cxl-cli.
    health_reasons: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=1024
    )
    # [offset, length] ranges held by dax devices the agent did not create (the kernel's
    # dax0.0, an administrator's daxctl device): poold never places a lease on them.
    # Absent from older agents: nothing reserved.
    reserved_extents: list[
        tuple[Annotated[int, Field(ge=0, le=1 << 62)], Annotated[int, Field(gt=0, le=1 << 62)]]
    ] = Field(default_factory=list, max_length=4096)


# --- errors ---------------------------------------------------------------


class ErrorBody(Model):
    """Every error reply: a stable code (poold.errors) and a message a person can act on."""

    code: str
    message: str
    detail: dict[str, object] | None = None


# --- tenants --------------------------------------------------------------

TenantName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
HostName = Annotated[
    str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]


class TenantSpec(Model):
    name: TenantName
    quota_bytes: int = Field(ge=0, le=MAX_LEASE_BYTES * 1024)
    quota_leases: int = Field(default=1024, ge=0, le=1 << 31)
    allowed_media: list[MediaClass] = Field(default_factory=list)
    allowed_uids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(default_factory=list)
    allowed_gids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(default_factory=list)
    allowed_hosts: list[HostName] = Field(default_factory=list)


class TenantUpdate(Model):
    quota_bytes: int | None = Field(default=None, ge=0, le=MAX_LEASE_BYTES * 1024)
    quota_leases: int | None = Field(default=None, ge=0, le=1 << 31)
    allowed_media: list[MediaClass] | None = None
    allowed_uids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] | None = None
    allowed_gids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] | None = None
    allowed_hosts: list[HostName] | None = None


class TenantOut(TenantSpec):
    id: int
    leased_bytes: int = 0
    live_leases: int = 0
    created_at: datetime


# --- hosts ----------------------------------------------------------------


class HostSpec(Model):
    name: HostName


class HostOut(Model):
    id: int
    name: str
    status: str
    last_heartbeat_at: datetime | None
    created_at: datetime


class HostCreated(HostOut):
    """Returned once, when an administrator adds a host: the agent's credential."""

    credential: str


class Renewal(Model):
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    ttl_s: int = Field(gt=0, le=MAX_TTL_S)


MAX_BLOCKS = 1 << 48  # as the agent socket protocol allows (agent/protocol.py)


class LeaseReport(Model):
    """A tenant's exclusive/replica accounting of one lease, as the agent forwards it.

    Counts are the tenant's word; poold checks them per item when it stores them
    (exclusive + replica within used, used within the lease).
    """

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    used_bytes: int = Field(ge=0, le=MAX_LEASE_BYTES)
    exclusive_bytes: int = Field(ge=0, le=MAX_LEASE_BYTES)
    replica_bytes: int = Field(ge=0, le=MAX_LEASE_BYTES)
    exclusive_blocks: int = Field(default=0, ge=0, le=MAX_BLOCKS)
    replica_blocks: int = Field(default=0, ge=0, le=MAX_BLOCKS)


class LeaseHolder(Model):
    """A process that holds a lease's memory: pid plus start time (a pid alone is reused)."""

    pid: int = Field(ge=0)
    start_time: float | None = None  # seconds since the epoch; None: unreadable


class ScrubProgress(Model):
    """A scrub the agent is running now."""

    started_at: datetime
    bytes_done: int | None = Field(default=None, ge=0)  # None: the backend does not tell


# held: the agent has the memory for a live holder; revoked_held: revoked, but a live
# holder still maps the memfd; scrubbing: the agent is zeroing the lease's range now.
AgentLeaseState = Literal["held", "revoked_held", "scrubbing"]


class AgentLease(Model):
    """One lease as its agent sees it: the richer form of an id in `Heartbeat.held`."""

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    state: AgentLeaseState = "held"
    holders: list[LeaseHolder] = Field(default_factory=list, max_length=64)
    sub_device: Annotated[str, Field(max_length=64)] | None = None  # devdax: "dax0.3"
    scrub: ScrubProgress | None = None


class LeftoverSubDevice(Model):
    """A dax sub-device the agent made for a lease, still there with no held lease behind it."""

    sub_device: Annotated[str, Field(min_length=1, max_length=64)]
    region_id: int = Field(ge=0)
    size_bytes: int = Field(ge=0)
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]  # the lease it was made for


class Heartbeat(Model):
    """One request per host per interval: inventory, all renewals, agent facts."""

    agent_version: str = ""
    inventory_digest: str | None = None
    # Sent only when it changed (digest differs) or poold asked for it.
    inventory: list[InventoryDevice] | None = None
    renewals: list[Renewal] = Field(default_factory=list, max_length=100_000)
    # The latest accounting of every lease whose report changed since the last heartbeat.
    reports: list[LeaseReport] = Field(default_factory=list, max_length=100_000)
    # Every lease id the agent holds memory for (None: not reported in this beat).
    # poold revokes what it no longer knows as live; the audit compares the two.
    held: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None, max_length=100_000
    )
    # The oldest lease request waiting on this agent for capacity (admission wait_s):
    # poold asks tenants for that much back, replicas first.
    admission_wanted_bytes: int = Field(default=0, ge=0, le=MAX_LEASE_BYTES)
    # Revoked memfd leases whose holder still maps the pages: the agent cannot take
    # them back, so they stay `revoking` (and count as used) until the holder exits.
    revoked_held: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=100_000
    )
    # The richer form of `held` (agents that send it leave `held` out): per lease its
    # holders, sub-device and local state, scrubs running now included.
    held_leases: list[AgentLease] | None = Field(default=None, max_length=100_000)
    # Sub-devices the agent made that no lease it holds accounts for (audit: leaked).
    leftovers: list[LeftoverSubDevice] = Field(default_factory=list, max_length=10_000)

    def held_ids(self) -> list[str] | None:
        """The ids the agent holds memory for, whichever form it sent (None: not reported)."""
        if self.held_leases is not None:
            return [x.lease_id for x in self.held_leases if x.state != "scrubbing"]
        return None if self.held is None else list(self.held)


class RenewResult(Model):
    lease_id: str
    expires_at: datetime | None = None
    code: str | None = None  # set when this renewal was refused
    message: str | None = None


class Revocation(Model):
    lease_id: str
    reason: str
    deadline_at: datetime | None = None


class ScrubOrder(Model):
    """A released or reclaimed devdax range the agent must zero before it is free again."""

    lease_id: str
    device_uid: str
    offset_bytes: int
    length_bytes: int
    # Set when `poolctl audit --reclaim` re-issued the order (the agent reported no scrub
    # of it for too long): scrub again even if done before, once per value.
    reissued_at: datetime | None = None


class ReportRefusal(Model):
    """A lease report poold did not store (not this host's lease, ended, inconsistent)."""

    lease_id: str
    code: str
    message: str


class ShrinkHint(Model):
    """Give ``target_bytes`` of this lease back by ``deadline_at`` (poold/pressure.py).

    ``replica_bytes`` of them can come from replicas; the rest would be exclusive bytes.
    """

    lease_id: str
    target_bytes: int = Field(gt=0)
    replica_bytes: int = Field(default=0, ge=0)
    deadline_at: datetime


class HeartbeatReply(Model):
    server_time: datetime
    renewed: list[RenewResult] = Field(default_factory=list)
    revocations: list[Revocation] = Field(default_factory=list)
    scrub: list[ScrubOrder] = Field(default_factory=list)
    # Reports refused one by one; the rest of the heartbeat still applies.
    report_errors: list[ReportRefusal] = Field(default_factory=list)
    # True when poold has no (or a stale) inventory for this host.
    want_inventory: bool = False
    # Pressure: this host's leases whose tenants are asked to give memory back.
    shrink: list[ShrinkHint] = Field(default_factory=list)


# --- leases ---------------------------------------------------------------

LeaseState = Literal[
    "granted",
    "active",
    "expired",
    "orphaned",
    "revoking",
    "scrubbing",
    "released",
    "reclaimed",
    "aborted",
]


class LeaseOp(Model):
    """A lease transition an agent queued (its outbox), delivered with its next request."""

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    # release_dirty: the holder is done but the bytes need zeroing (devdax);
    # scrubbed / scrub_failed: the agent's verdict on that zeroing.
    # orphan: the holder process is gone (the agent saw it exit).
    # shrink: the holder gave back the tail of its memfd lease (ftruncate down);
    # the lease keeps its state and offset, with length_bytes its new length.
    op: Literal["release", "release_dirty", "abort", "scrubbed", "scrub_failed", "orphan", "shrink"]
    reason: Annotated[str, Field(max_length=1024)] = ""
    length_bytes: int | None = Field(default=None, gt=0, le=MAX_LEASE_BYTES)

    @model_validator(mode="after")
    def _length_only_for_shrink(self) -> LeaseOp:
        if (self.op == "shrink") != (self.length_bytes is not None):
            raise ValueError("length_bytes is required for shrink and only for shrink")
        return self


class LeaseOpResult(Model):
    lease_id: str
    state: str | None = None
    code: str | None = None
    message: str | None = None


class AgentOps(Model):
    ops: list[LeaseOp] = Field(max_length=100_000)


class GrantRequest(Model):
    """What an agent asks for on behalf of a tenant process it authenticated."""

    tenant: TenantName | None = None  # None: the one tenant the uid/gid may act for
    size_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    ttl_s: int = Field(default=60, gt=0, le=MAX_TTL_S)
    media: MediaClass | None = None
    # From SO_PEERCRED, never from what the tenant claimed.
    uid: int = Field(ge=0, lt=1 << 32)
    gids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(
        default_factory=list, max_length=1024
    )
    pid: int = Field(ge=0)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    # The agent already materialised the memory (memfd backends, whose memory
    # does not depend on the offset): grant and activate in one transaction.
    activate: bool = False
    # The agent's queued transitions, applied (in their own transaction) first,
    # so a release just before this grant frees its bytes and quota in time.
    pending: list[LeaseOp] = Field(default_factory=list, max_length=100_000)


class LeaseOut(Model):
    id: str
    tenant: str
    host: str
    device_uid: str
    device_kind: DeviceKind
    media: str
    offset_bytes: int
    length_bytes: int
    requested_bytes: int
    alignment_bytes: int
    state: LeaseState
    epoch: int
    ttl_s: int
    granted_at: datetime
    activated_at: datetime | None
    expires_at: datetime
    ended_at: datetime | None
    numa_node: int | None = None
    local_name: str = ""
    holder_uid: int | None = None
    holder_pid: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    exclusive_bytes: int = 0
    replica_bytes: int = 0


class RenewRequest(Model):
    ttl_s: int | None = Field(default=None, gt=0, le=MAX_TTL_S)


class EndRequest(Model):
    """Release, abort or revoke: who asked and why goes into the event journal."""

    reason: Annotated[str, Field(max_length=1024)] = ""


# --- status ---------------------------------------------------------------


class DeviceAnnotation(Model):
    """What an administrator says about a device that sysfs cannot tell.

    A field left out (None) is not touched; ``clear`` names fields to drop so that the
    agent's value applies again.
    """

    media: MediaClass | None = None
    recycled: bool | None = None
    provenance: Annotated[str, Field(max_length=1024)] | None = None
    cost_per_gib_month: float | None = Field(default=None, ge=0)


class DeviceAnnotate(DeviceAnnotation):
    """Body of ``PATCH /v1/devices/{uid}``."""

    clear: list[Literal["media", "recycled", "provenance", "cost_per_gib_month"]] = Field(
        default_factory=list
    )


class DeviceStatus(Model):
    id: int
    uid: str
    kind: str
    media: str
    recycled: bool
    state: str
    health: str
    hosts: list[str]
    local_names: list[str]
    numa_node: int | None
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    largest_free_bytes: int
    live_leases: int
    alignment_bytes: int
    provenance: str | None = None
    cost_per_gib_month: float | None = None
    memory_tier: int | None = None
    memdev_serials: list[int] = Field(default_factory=list)
    health_reasons: list[str] = Field(default_factory=list)
    # What an administrator set with `poolctl devices annotate` (wins over the agent's).
    admin_annotations: DeviceAnnotation = Field(default_factory=DeviceAnnotation)
    # [offset, length] ranges held by dax devices poold did not place (the agent's report);
    # reserved_bytes is their union inside the device. Neither leased nor free.
    reserved_extents: list[tuple[int, int]] = Field(default_factory=list)
    reserved_bytes: int = 0


class HostStatus(Model):
    name: str
    status: str
    last_heartbeat_at: datetime | None
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    live_leases: int


class PoolStatus(Model):
    hosts: list[HostStatus]
    devices: list[DeviceStatus]
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int


# --- lifecycle: revoke, drain, the agent's confirmation ---------------------------


class RevokeRequest(Model):
    """`poolctl leases revoke`: why, and how long the agent has to give the memory back."""

    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    deadline_s: float | None = Field(default=None, ge=0, le=MAX_TTL_S)  # None: poold's default


class DeviceDrainRequest(Model):
    """`poolctl devices drain`: no new leases; live ones are revoked at the deadline."""

    deadline_s: float = Field(default=300.0, ge=0, le=MAX_TTL_S)
    now: bool = False  # revoke the live leases at once (same as deadline_s=0)


class HostDrainRequest(Model):
    """`poolctl hosts drain`: no new leases; live ones run to their end, or are revoked
    at the deadline (by the reaper) when one is given, or at once with `now`."""

    deadline_s: float | None = Field(default=None, ge=0, le=MAX_TTL_S)  # None: no deadline
    now: bool = False


class DrainResult(Model):
    target: str  # device uid or host name
    state: str
    deadline_at: datetime | None = None
    live_leases: int = 0
    revoked: list[str] = Field(default_factory=list)


class RevokedConfirm(Model):
    """The agent's word that it tore down these revoked leases (the memory is gone)."""

    lease_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(max_length=100_000)


# --- the reclamation audit (DESIGN.md "Reclamation audit") ------------------------


class AuditItem(Model):
    """One finding: what, on which lease/device/tenant, and what the audit did about it."""

    kind: str  # e.g. overlap, out_of_bounds, expired, stale_grant
    lease_id: str | None = None
    device_id: int | None = None
    device_uid: str | None = None
    tenant: str | None = None
    host: str | None = None
    state: str | None = None
    message: str
    action: str | None = None  # reclaimed / aborted / lost_race, when --reclaim acted
    sub_device: str | None = None  # the agent's dax sub-device ("dax0.3"), when it named one


class AgentFindings(Model):
    """The ledger against what agents report holding: leaked and stale memory.

    `available` is False when no agent reported its leases recently.
    """

    available: bool = False
    leaked: list[AuditItem] = Field(default_factory=list)  # memory in use, no live lease
    stale: list[AuditItem] = Field(default_factory=list)  # live lease, no memory behind it
    # scrubbing in the ledger for long, no scrub running on the agent (or the agent down)
    unfinished_scrubs: list[AuditItem] = Field(default_factory=list)
    # the ledger's holder differs from the agent's, or the agent has a live lease's
    # sub-device but holds no lease for it
    holder_mismatches: list[AuditItem] = Field(default_factory=list)
    note: str = ""


class AuditReport(Model):
    run_id: int | None = None
    started_at: datetime
    finished_at: datetime
    audit_s: float
    reclaim: bool
    exit_code: int  # 0 clean, 1 reclaimed something, 2 needs a human
    leases: int  # leases examined (every row)
    live_leases: int
    devices: int
    violations: list[AuditItem] = Field(default_factory=list)  # invariants: need a human
    reclaimable: list[AuditItem] = Field(default_factory=list)  # safe to reclaim now
    pending: list[AuditItem] = Field(default_factory=list)  # ended, within their grace
    agents: AgentFindings = Field(default_factory=AgentFindings)
    reclaimed: int = 0


# --- accounting (DESIGN.md "Exclusive-copy accounting") ------------------------------

AccountingBy = Literal["tenant", "host", "device", "media"]


class UsageRow(Model):
    """Live leases of one group (or the whole pool): leased, and what tenants reported."""

    group: str
    leases: int = 0
    reported_leases: int = 0  # leases with at least one report; the rest count as unused
    leased_bytes: int = 0
    used_bytes: int = 0
    exclusive_bytes: int = 0
    replica_bytes: int = 0
    exclusive_blocks: int = 0
    replica_blocks: int = 0
    exclusive_ratio: float = 0.0  # exclusive / leased: what the memory is worth to the pool


class ServedRow(Model):
    """GiB-hours one tenant was served on one media class over a period, and their cost."""

    tenant: str
    media: str
    gib_hours: float = 0.0
    recycled_gib_hours: float = 0.0
    cost: float = 0.0  # over the GiB-hours whose device has a cost basis
    unpriced_gib_hours: float = 0.0  # on devices without a cost basis
    # What recycled DDR4 saved against new DDR5 (None: no DDR5 price configured).
    savings: float | None = None


class AccountingReport(Model):
    by: AccountingBy
    generated_at: datetime
    pool: UsageRow
    groups: list[UsageRow]
    since: datetime
    until: datetime
    ddr5_cost_per_gib_month: float | None = None
    served: list[ServedRow]
    served_total: ServedRow
