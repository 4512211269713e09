"""What an agent and poold say to each other: inventory, heartbeats and their
replies, grants, and the agent's queued lease transitions (its outbox)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, model_validator

from poold.wire.common import (
    MAX_BLOCKS,
    MAX_LEASE_BYTES,
    MAX_TTL_S,
    DeviceKind,
    HealthState,
    LeaseOut,
    MediaClass,
    Model,
    RequestId,
    TenantName,
)
from poold.wire.delegation import Delegation, LocalGrant


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
    # A device leased only whole (a static dax region: its one device, never carved):
    # poold places only a lease of exactly its usable size there. Absent from older
    # agents: carvable.
    whole_only: bool = False


class Renewal(Model):
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    ttl_s: int = Field(gt=0, le=MAX_TTL_S)


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
# holder still maps the memfd; scrubbing: the agent is zeroing the lease's range now;
# mapped: the lease ended for its holder, but processes (`holders`) still map or hold
# its memfd (agent/mappings.py), since `mapped_since`.
AgentLeaseState = Literal["held", "revoked_held", "scrubbing", "mapped"]


class AgentLease(Model):
    """One lease as its agent sees it: the richer form of an id in `Heartbeat.held`."""

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    state: AgentLeaseState = "held"
    holders: list[LeaseHolder] = Field(default_factory=list, max_length=64)
    sub_device: Annotated[str, Field(max_length=64)] | None = None  # devdax: "dax0.3"
    scrub: ScrubProgress | None = None
    mapped_since: datetime | None = None  # state "mapped": when the lease ended for its holder


class LeftoverSubDevice(Model):
    """A dax sub-device the agent made for a lease, still there with no held lease behind it."""

    sub_device: Annotated[str, Field(min_length=1, max_length=64)]
    region_id: int = Field(ge=0)
    size_bytes: int = Field(ge=0)
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]  # the lease it was made for


class Heartbeat(Model):
    """One request per host per interval: inventory, all renewals, agent facts.

    Renewals are idempotent (a renewal applied twice sets the same expiry from a later
    now), so a heartbeat needs no request id; a failed one is resent whole.
    """

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
            return [x.lease_id for x in self.held_leases if x.state in ("held", "revoked_held")]
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
    """A lease report poold did not store (not this host's lease, ended, inconsistent),
    or an inventory item it dropped (``device_uid`` set: a device this host may not report)."""

    lease_id: str = ""
    code: str
    message: str
    device_uid: str | None = None


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
    # Inventory items dropped one by one (device_not_bound); the rest of the inventory
    # still applies (poold/ledger/device_hosts.py).
    inventory_errors: list[ReportRefusal] = Field(default_factory=list)
    # True when poold has no (or a stale) inventory for this host.
    want_inventory: bool = False
    # Pressure: this host's leases whose tenants are asked to give memory back.
    shrink: list[ShrinkHint] = Field(default_factory=list)
    # The host's delegation now (reservations, budgets; their TTLs renewed by this
    # heartbeat), when it has any: clawbacks and drains reach the agent here.
    delegation: Delegation | None = None


class LeaseOp(Model):
    """A lease transition an agent queued (its outbox), delivered with its next request."""

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    # release_dirty: the holder is done but the bytes need zeroing (devdax);
    # scrubbed / scrub_failed: the agent's verdict on that zeroing.
    # orphan: the holder process is gone (the agent saw it exit).
    # shrink: the holder gave back the tail of its memfd lease (ftruncate down);
    # the lease keeps its state and offset, with length_bytes its new length.
    # release_mapped / reclaim_mapped: the lease ended, but its memfd is still mapped or
    # held (it stays counted); unmapped: no process maps or holds it any more.
    op: Literal[
        "release",
        "release_dirty",
        "abort",
        "scrubbed",
        "scrub_failed",
        "orphan",
        "shrink",
        "release_mapped",
        "reclaim_mapped",
        "unmapped",
        # local_grant: a lease the agent granted inside its delegation (`grant`).
        "local_grant",
    ]
    reason: Annotated[str, Field(max_length=1024)] = ""
    length_bytes: int | None = Field(default=None, gt=0, le=MAX_LEASE_BYTES)
    grant: LocalGrant | None = None

    @model_validator(mode="after")
    def _length_only_for_shrink(self) -> LeaseOp:
        if (self.op == "shrink") != (self.length_bytes is not None):
            raise ValueError("length_bytes is required for shrink and only for shrink")
        if (self.op == "local_grant") != (self.grant is not None):
            raise ValueError("grant is required for local_grant and only for local_grant")
        if self.grant is not None and self.grant.lease_id != self.lease_id:
            raise ValueError("a local_grant's lease_id is its grant's")
        return self


class LeaseOpResult(Model):
    lease_id: str
    state: str | None = None
    code: str | None = None
    message: str | None = None


class BudgetSpent(Model):
    """Bytes and leases a central grant took from its host's budget of the tenant."""

    bytes: int = Field(ge=0, lt=1 << 63)
    leases: int = Field(ge=0, lt=1 << 31)


class GrantReply(LeaseOut):
    """A central grant's answer: the lease, and what became of each op that rode on the
    request (`GrantRequest.pending`), in their order, as an op batch answers. A refused
    op is the agent's to hear of: a local grant refused there is a lease the tenant holds
    and the ledger does not."""

    pending: list[LeaseOpResult] = Field(default_factory=list)
    # What this grant took from its host's budget of the tenant (budgets.spend_for_central):
    # [0, 0] when nothing. None when poold does not say (an older poold, or a retry answered
    # from the stored first answer): the agent then keeps its debit of the budget until a
    # delegation says the budget again.
    budget_spent: BudgetSpent | None = None


class AgentOps(Model):
    ops: list[LeaseOp] = Field(max_length=100_000)
    # Names this batch, so that a retry after a lost reply gets the first answer
    # instead of being applied again (poold remembers recent ids per host).
    request_id: RequestId | None = None


class LocalUse(Model):
    """The agent's own count of a tenant's local leases on its host, those poold has not
    heard of yet included: sent with a central grant that may spend the host's budget
    of the tenant, which poold then spends only down to the larger of this and what it
    has committed (poold/ledger/budgets.py spend_for_central)."""

    tenant: TenantName
    bytes: int = Field(ge=0, lt=1 << 63)
    leases: int = Field(ge=0, lt=1 << 31)

    def use_for(self, tenant: str) -> tuple[int, int] | None:
        """(bytes, leases) when it counts ``tenant`` (the one poold resolved), else None."""
        return (self.bytes, self.leases) if self.tenant == tenant else None


class GrantRequest(Model):
    """What an agent asks for on behalf of a tenant process it authenticated.

    ``request_id`` names the grant: a retry with the same id (after a timeout, on
    another poold) gets the lease the first attempt made, never a second one.
    """

    request_id: RequestId | None = None

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
    # Delegation on: the agent's count of the tenant's local use here (None: not sent).
    local_use: LocalUse | None = None


class RenewRequest(Model):
    ttl_s: int | None = Field(default=None, gt=0, le=MAX_TTL_S)


class RevokedConfirm(Model):
    """The agent's word that it tore down these revoked leases (the memory is gone)."""

    lease_ids: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(max_length=100_000)


class NewsWait(Model):
    """Wait until poold has news for this host (a revocation, an ended lease, a shrink
    request), or ``timeout_s``: the agent's long poll (poold/ledger/news.py)."""

    # The token of the last answer; none at first (answers at once with a token).
    since: Annotated[str, Field(max_length=128)] | None = None
    timeout_s: float = Field(default=25.0, ge=0, le=60)


class News(Model):
    """Whether there is news (then the agent heartbeats now), and the token to wait from."""

    news: bool
    token: str
