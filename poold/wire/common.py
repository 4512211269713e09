"""What every side of poold's HTTP API shares: the base model, the bounded scalar
types, the error body and the lease as poold reports it.

`poold.wire` is the floor every other package stands on: the ledger, the API, the
agent and poolctl import it, and it imports nothing of theirs (only the pure lease
state machine, whose `LeaseState` is the one spelling of a lease's state).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from poold.lease_states import LeaseState

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


class ErrorBody(Model):
    """Every error reply: a stable code (poold.errors) and a message a person can act on."""

    code: str
    message: str
    detail: dict[str, object] | None = None


TenantName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]


HostName = Annotated[
    str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]


# An agent's name for one mutating request (a uuid4 in practice), for idempotent retries.
RequestId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]

MAX_BLOCKS = 1 << 48  # as the agent socket protocol allows (agent/protocol.py)


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
    # Where it was granted: the host's reservation its agent placed it in (delegated
    # capacity), or None: centrally, by poold.
    reservation_id: str | None = None


class EndRequest(Model):
    """Release, abort or revoke: who asked and why goes into the event journal."""

    reason: Annotated[str, Field(max_length=1024)] = ""
