"""What poolctl and poold say to each other: tenants, hosts, devices, capacity,
revocation and drain, the reclamation audit and accounting."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from poold.wire.common import (
    MAX_LEASE_BYTES,
    MAX_TTL_S,
    HostName,
    LeaseOut,
    MediaClass,
    Model,
    TenantName,
)


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
    # Quota hosts' budgets leave for central grants until then (poold/ledger/central_room.py);
    # 0 and None when no room runs.
    central_room_bytes: int = 0
    central_room_until: datetime | None = None


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


class DelegatedExtent(Model):
    """One reservation of a device, as poolctl shows it."""

    id: str
    host: str
    offset_bytes: int
    length_bytes: int
    unleased_bytes: int
    state: str  # held / returning
    expires_at: datetime


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
    # [offset, length] ranges never to be allocated again (media poison, a failed scrub,
    # a devdax range whose host was deleted before it was zeroed); quarantined_bytes is
    # their union inside the device.
    quarantined_extents: list[tuple[int, int]] = Field(default_factory=list)
    quarantined_bytes: int = 0
    # Delegated capacity: extents reserved for a host whose agent grants inside them;
    # delegated_bytes is what no lease in them uses yet (reserved-but-unleased: neither
    # leased nor free).
    delegations: list[DelegatedExtent] = Field(default_factory=list)
    delegated_bytes: int = 0


DeviceScope = Literal["host", "shared"]


class DeviceHosts(Model):
    """Which hosts may report a device (`poolctl devices allow-host` / `disallow-host`).

    ``scope`` "host": only one host can reach it (emulated memory, a host's own NUMA node
    or dax region); "shared": a multi-headed or switched CXL device, by its memdev serials.
    """

    uid: str
    scope: DeviceScope
    hosts: list[str]


class HostStatus(Model):
    name: str
    status: str
    last_heartbeat_at: datetime | None
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    live_leases: int
    # Reserved for this host and not leased yet (its delegation), on the devices it reaches.
    delegated_bytes: int = 0


class PoolStatus(Model):
    hosts: list[HostStatus]
    devices: list[DeviceStatus]
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    delegated_bytes: int = 0


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
    # False: the target already was as asked (an undrain of a target not draining, a
    # drain without a deadline of one already draining without one); nothing written.
    changed: bool = True


class HostDeleted(Model):
    """`poolctl hosts delete`: what went with the host.

    `ended_leases`: live leases `--force` ended at once; `devices_missing`: devices no
    other host reaches, kept for their lease history and out of placement (`missing`);
    `devices_removed`: such devices that never held a lease, deleted; `history_kept`:
    the host row stays as a tombstone (renamed, no credential) for its leases' history.
    """

    name: str
    ended_leases: list[str] = Field(default_factory=list)
    quarantined_leases: list[str] = Field(default_factory=list)  # devdax, never zeroed
    devices_missing: list[str] = Field(default_factory=list)
    devices_removed: list[str] = Field(default_factory=list)
    history_kept: bool = False


class LeaseEndRequest(Model):
    """`poolctl leases end`: why (journalled)."""

    reason: Annotated[str, Field(min_length=1, max_length=1024)] = "ended by administrator"


LeaseEndAction = Literal["revoked", "reclaimed", "aborted", "none"]


class LeaseEnded(Model):
    """What `poolctl leases end` did to one lease (`changed` False: it had ended already)."""

    lease: LeaseOut
    action: LeaseEndAction
    changed: bool


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
    reservation_id: str | None = None  # the host's reservation (delegated capacity) it is about


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
