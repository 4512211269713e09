"""Which HTTP routes does poold serve, and what does each carry?

One table, read by both sides: `poold.api.app` binds a handler to every route (and
refuses to start when one is missing), and `poold.api.client` builds every call from
it, so a path, a method or a body model is written once. A route's name is the name
of its handler and of its client method; `tests/poold/wire/test_routes.py` checks
that each route has both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from poold.wire.admin import (
    AccountingBy,
    AccountingReport,
    AuditReport,
    DeviceAnnotate,
    DeviceDrainRequest,
    DeviceHosts,
    DeviceStatus,
    DrainResult,
    HostCreated,
    HostDeleted,
    HostDrainRequest,
    HostOut,
    HostSpec,
    LeaseEnded,
    LeaseEndRequest,
    PoolStatus,
    RevokeRequest,
    TenantOut,
    TenantSpec,
    TenantUpdate,
)
from poold.wire.agent import (
    AgentOps,
    GrantReply,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    LeaseOpResult,
    News,
    NewsWait,
    RenewRequest,
    RevokedConfirm,
)
from poold.wire.common import EndRequest, LeaseOut
from poold.wire.delegation import Delegation, DelegationRequest

R = TypeVar("R")

# Who may call a route: nobody needs a token (health, metrics), the admin token, one
# host's agent credential, or either (then the handler scopes what it returns).
Auth = Literal["none", "admin", "agent", "any"]


class QueryModel(BaseModel):
    """Base for query-string models: unknown parameters are ignored, as HTTP clients expect."""

    model_config = ConfigDict(extra="ignore")


class LeaseQuery(QueryModel):
    """Query of `GET /v1/leases`; an agent sees its own host's leases only."""

    tenant: str | None = None
    host: str | None = None
    state: list[str] | None = None
    live: bool = False
    limit: int = Field(default=1000, ge=1, le=100_000)


class HostDeleteQuery(QueryModel):
    """`DELETE /v1/hosts/{name}`: with `force`, the host's live leases are ended first."""

    force: bool = False


class AuditQuery(QueryModel):
    reclaim: bool = False


class AccountingQuery(QueryModel):
    """Usage now, and GiB-hours over [since, until] (default: the last 30 days)."""

    by: AccountingBy = "tenant"
    since: datetime | None = None
    until: datetime | None = None


# Path parameters: `{name}` is one segment; `{name:path}` may hold "/" (device uids
# such as "host/numa:node2"), so the client quotes it whole.
_PARAM = re.compile(r"\{(\w+)(?::path)?\}")


@dataclass(frozen=True)
class Route(Generic[R]):
    """One HTTP route: method, path template, body and query models, response type."""

    method: Literal["GET", "POST", "PATCH", "DELETE"]
    path: str
    response: Any  # a type: a model, list[model], or None for 204
    auth: Auth
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    status_code: int = 200
    # A body the caller may leave out (older clients sent none): the model's defaults.
    body_optional: bool = False
    name: str = field(default="", compare=False)

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(_PARAM.findall(self.path))

    def url(self, **params: str) -> str:
        """The path with its parameters filled in and quoted (a `:path` one whole)."""
        if set(params) != set(self.path_params):
            raise TypeError(f"{self.name} takes path parameters {self.path_params}, not {params}")
        return _PARAM.sub(lambda m: quote(params[m.group(1)], safe=""), self.path)

    def parse_json(self, content: bytes) -> R:
        """A response body as the route's response type (None for a 204 route)."""
        if self.response is None:
            return None  # type: ignore[return-value]  # R is None for a 204 route
        adapter: TypeAdapter[R] = _adapter(self.response)
        return adapter.validate_json(content)


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(tp: Any) -> TypeAdapter[Any]:
    found = _ADAPTERS.get(tp)
    if found is None:
        found = _ADAPTERS[tp] = TypeAdapter(tp)
    return found


# The table. Order matters where paths overlap: Starlette tries routes in order, so
# GET/PATCH /v1/devices/{uid:path} precede the POST .../drain and .../undrain routes.
health: Route[dict[str, str]] = Route("GET", "/v1/health", dict[str, str], "none")
metrics: Route[str] = Route("GET", "/metrics", str, "none")

create_tenant: Route[TenantOut] = Route(
    "POST", "/v1/tenants", TenantOut, "admin", body=TenantSpec, status_code=201
)
list_tenants: Route[list[TenantOut]] = Route("GET", "/v1/tenants", list[TenantOut], "admin")
get_tenant: Route[TenantOut] = Route("GET", "/v1/tenants/{name}", TenantOut, "admin")
update_tenant: Route[TenantOut] = Route(
    "PATCH", "/v1/tenants/{name}", TenantOut, "admin", body=TenantUpdate
)
delete_tenant: Route[None] = Route("DELETE", "/v1/tenants/{name}", None, "admin", status_code=204)

add_host: Route[HostCreated] = Route(
    "POST", "/v1/hosts", HostCreated, "admin", body=HostSpec, status_code=201
)
list_hosts: Route[list[HostOut]] = Route("GET", "/v1/hosts", list[HostOut], "admin")
delete_host: Route[HostDeleted] = Route(
    "DELETE", "/v1/hosts/{name}", HostDeleted, "admin", query=HostDeleteQuery
)

register: Route[HeartbeatReply] = Route(
    "POST", "/v1/agent/register", HeartbeatReply, "agent", body=Heartbeat
)
heartbeat: Route[HeartbeatReply] = Route(
    "POST", "/v1/agent/heartbeat", HeartbeatReply, "agent", body=Heartbeat
)
# A long poll: held open up to the body's timeout_s, on the event loop, never a
# worker thread (see `Binder` in poold/api/binding.py).
wait_news: Route[News] = Route("POST", "/v1/agent/news", News, "agent", body=NewsWait)
apply_ops: Route[list[LeaseOpResult]] = Route(
    "POST", "/v1/agent/ops", list[LeaseOpResult], "agent", body=AgentOps
)
confirm_revoked: Route[list[LeaseOpResult]] = Route(
    "POST", "/v1/agent/revoked", list[LeaseOpResult], "agent", body=RevokedConfirm
)
# Refill and give-back of the host's reservations and budgets; the reply is all it holds.
delegate: Route[Delegation] = Route(
    "POST", "/v1/agent/delegation", Delegation, "agent", body=DelegationRequest
)

grant: Route[GrantReply] = Route(
    "POST", "/v1/leases", GrantReply, "agent", body=GrantRequest, status_code=201
)
activate: Route[LeaseOut] = Route("POST", "/v1/leases/{lease_id}/activate", LeaseOut, "agent")
renew: Route[LeaseOut] = Route(
    "POST", "/v1/leases/{lease_id}/renew", LeaseOut, "agent", body=RenewRequest
)
release: Route[LeaseOut] = Route(
    "POST", "/v1/leases/{lease_id}/release", LeaseOut, "any", body=EndRequest
)
abort: Route[LeaseOut] = Route(
    "POST", "/v1/leases/{lease_id}/abort", LeaseOut, "agent", body=EndRequest
)
revoke: Route[LeaseOut] = Route(
    "POST", "/v1/leases/{lease_id}/revoke", LeaseOut, "admin", body=RevokeRequest
)
end_lease: Route[LeaseEnded] = Route(
    "POST", "/v1/leases/{lease_id}/end", LeaseEnded, "admin", body=LeaseEndRequest
)
list_leases: Route[list[LeaseOut]] = Route(
    "GET", "/v1/leases", list[LeaseOut], "any", query=LeaseQuery
)
show_lease: Route[LeaseOut] = Route("GET", "/v1/leases/{lease_id}", LeaseOut, "any")

status: Route[PoolStatus] = Route("GET", "/v1/status", PoolStatus, "admin")
show_device: Route[DeviceStatus] = Route("GET", "/v1/devices/{uid:path}", DeviceStatus, "admin")
annotate_device: Route[DeviceStatus] = Route(
    "PATCH", "/v1/devices/{uid:path}", DeviceStatus, "admin", body=DeviceAnnotate
)
drain_device: Route[DrainResult] = Route(
    "POST", "/v1/devices/{uid:path}/drain", DrainResult, "admin", body=DeviceDrainRequest
)
undrain_device: Route[DrainResult] = Route(
    "POST", "/v1/devices/{uid:path}/undrain", DrainResult, "admin"
)
# Which hosts may report a device (poold/ledger/device_hosts.py).
allow_device_host: Route[DeviceHosts] = Route(
    "POST", "/v1/devices/{uid:path}/hosts/{host}", DeviceHosts, "admin"
)
disallow_device_host: Route[DeviceHosts] = Route(
    "DELETE", "/v1/devices/{uid:path}/hosts/{host}", DeviceHosts, "admin"
)
drain_host: Route[DrainResult] = Route(
    "POST",
    "/v1/hosts/{name}/drain",
    DrainResult,
    "admin",
    body=HostDrainRequest,
    body_optional=True,
)
undrain_host: Route[DrainResult] = Route("POST", "/v1/hosts/{name}/undrain", DrainResult, "admin")

audit: Route[AuditReport] = Route("POST", "/v1/audit", AuditReport, "admin", query=AuditQuery)
accounting: Route[AccountingReport] = Route(
    "GET", "/v1/accounting", AccountingReport, "admin", query=AccountingQuery
)


def _collect() -> dict[str, Route[Any]]:
    table: dict[str, Route[Any]] = {}
    for name, value in list(globals().items()):
        if isinstance(value, Route):
            object.__setattr__(value, "name", name)
            table[name] = value
    return table


# Every route by name, in serving order.
ROUTES: dict[str, Route[Any]] = _collect()
