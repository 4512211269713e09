"""What poold delegates to a host, so that its agent grants leases alone (DESIGN.md
"Delegated capacity"): reservations of device extents, per-tenant budgets, and the
local grants the agent reports back.

The contract between poold/ledger/delegation.py (poold's side) and agent/delegation.py
(the agent's). A reply is always the host's whole delegation as poold sees it now, so
a retried or lost exchange never leaves the two sides disagreeing about what is held.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from poold.wire.common import (
    MAX_LEASE_BYTES,
    MAX_TTL_S,
    DeviceKind,
    HealthState,
    MediaClass,
    Model,
    RequestId,
    TenantName,
)

# Local leases of one reservation take epochs epoch_base .. epoch_base + EPOCH_BLOCK - 1.
# poold moves the device's generation past the block when it reserves, so any later
# grant of those bytes (central or local) has a larger epoch: epochs stay monotonic per
# byte range whoever grants. A reservation whose block is spent takes no more leases.
EPOCH_BLOCK = 1 << 20

DelegationId = Annotated[str, Field(min_length=1, max_length=64)]


class Reservation(Model):
    """An extent of a device reserved for one host: its agent places leases inside it."""

    id: DelegationId
    device_uid: Annotated[str, Field(min_length=1, max_length=256)]
    kind: DeviceKind
    media: MediaClass
    health: HealthState
    alignment_bytes: int = Field(gt=0)
    offset_bytes: int = Field(ge=0)
    length_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    epoch_base: int = Field(ge=1)
    expires_at: datetime
    # How this host reaches the device (its device_paths row).
    local_name: str = ""
    numa_node: int | None = None
    read_latency_ns: int | None = None
    distance: int | None = None


class Budget(Model):
    """A tenant's slice of its quota for one host, and who may spend it there."""

    tenant: TenantName
    bytes: int = Field(ge=0)
    leases: int = Field(ge=0)
    allowed_uids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(
        default_factory=list, max_length=1024
    )
    allowed_gids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(
        default_factory=list, max_length=1024
    )
    allowed_media: list[MediaClass] = Field(default_factory=list, max_length=64)
    expires_at: datetime
    # Other hosts of the tenant want some of its quota too, and this host holds more
    # than its fair share (poold/ledger/budget_sizing.py `fair_share`): the agent's next
    # request asks no more than max(what it granted, this). None: no one else wants any.
    share_bytes: int | None = Field(default=None, ge=0)
    share_leases: int | None = Field(default=None, ge=0)


class Delegation(Model):
    """The host's whole delegation now (a reply to `delegate`, and in heartbeat replies)."""

    server_time: datetime
    reservations: list[Reservation] = Field(default_factory=list, max_length=10_000)
    budgets: list[Budget] = Field(default_factory=list, max_length=100_000)


class ReserveWant(Model):
    """More reserved bytes on a device this host reaches (None: wherever placement says)."""

    device_uid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    media: MediaClass | None = None


class BudgetWant(Model):
    """The budget the agent would like to hold for a tenant (totals, not increments)."""

    tenant: TenantName
    bytes: int = Field(ge=0)
    leases: int = Field(ge=0)


class DelegationRequest(Model):
    """`POST /v1/agent/delegation`: refill, give back, or just ask what is held."""

    request_id: RequestId | None = None
    reserve: list[ReserveWant] = Field(default_factory=list, max_length=1024)
    # Reservations the agent gives back whole (none of its leases lies in them).
    give_back: list[DelegationId] = Field(default_factory=list, max_length=10_000)
    budgets: list[BudgetWant] = Field(default_factory=list, max_length=100_000)


class LocalGrant(Model):
    """A lease the agent granted alone inside a reservation, reported in an op batch
    (`LeaseOp(op="local_grant", grant=...)`). Idempotent by `lease_id`."""

    lease_id: Annotated[str, Field(min_length=1, max_length=64)]
    reservation_id: DelegationId
    tenant: TenantName
    offset_bytes: int = Field(ge=0)
    length_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    requested_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    epoch: int = Field(ge=1)
    ttl_s: int = Field(gt=0, le=MAX_TTL_S)
    granted_at: datetime
    uid: int = Field(ge=0, lt=1 << 32)
    gids: list[Annotated[int, Field(ge=0, lt=1 << 32)]] = Field(
        default_factory=list, max_length=1024
    )
    pid: int = Field(ge=0)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
