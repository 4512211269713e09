"""How poolctl and the agent call poold: a typed httpx client over `poold.wire.routes`.

Each method is one route of the table, under the route's name; paths, methods,
bodies and response types come from the table, never from here. Errors come back
as the `PoolError` subclass the server raised (matched by code); a poold that
cannot be reached is `poold_unreachable`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from poold.errors import PooldUnreachable, PoolError, from_wire
from poold.wire import routes
from poold.wire.admin import (
    AccountingBy,
    AccountingReport,
    AuditReport,
    DeviceAnnotate,
    DeviceDrainRequest,
    DeviceStatus,
    DrainResult,
    HostCreated,
    HostDrainRequest,
    HostOut,
    HostSpec,
    PoolStatus,
    RevokeRequest,
    TenantOut,
    TenantSpec,
    TenantUpdate,
)
from poold.wire.agent import (
    AgentOps,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    LeaseOp,
    LeaseOpResult,
    RenewRequest,
    RevokedConfirm,
)
from poold.wire.common import EndRequest, LeaseOut
from poold.wire.routes import AccountingQuery, AuditQuery, LeaseQuery, Route

R = TypeVar("R")

AUDIT_TIMEOUT_S = 600.0  # an audit of a large ledger takes seconds, not the default 10


class PooldClient:
    def __init__(self, base_url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PooldClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(
        self,
        route: Route[R],
        body: BaseModel | None = None,
        query: BaseModel | None = None,
        *,
        timeout_s: float | None = None,
        **path: str,
    ) -> R:
        """One call of `route`: its path filled in, `body` as JSON, `query` as parameters."""
        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = timeout_s
        try:
            resp = self._http.request(
                route.method,
                route.url(**path),
                params=query.model_dump(mode="json", exclude_none=True) if query else None,
                content=body.model_dump_json() if body is not None else None,
                headers={"content-type": "application/json"} if body is not None else None,
                **extra,
            )
        except httpx.TransportError as exc:
            raise PooldUnreachable(f"cannot reach poold at {self.base_url}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                data = resp.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and "code" in data:
                raise from_wire(str(data["code"]), str(data.get("message", "")), data.get("detail"))
            raise PoolError(f"poold answered HTTP {resp.status_code}: {resp.text[:200]}")
        if route.response is str:
            return resp.text  # type: ignore[return-value]  # R is str for a text route
        return route.parse_json(resp.content)

    # health and metrics
    def health(self) -> dict[str, str]:
        return self._send(routes.health)

    def metrics(self) -> str:
        """The Prometheus text exposition."""
        return self._send(routes.metrics)

    # tenants
    def create_tenant(self, spec: TenantSpec) -> TenantOut:
        return self._send(routes.create_tenant, spec)

    def list_tenants(self) -> list[TenantOut]:
        return self._send(routes.list_tenants)

    def get_tenant(self, name: str) -> TenantOut:
        return self._send(routes.get_tenant, name=name)

    def update_tenant(self, name: str, change: TenantUpdate) -> TenantOut:
        return self._send(routes.update_tenant, change, name=name)

    def delete_tenant(self, name: str) -> None:
        self._send(routes.delete_tenant, name=name)

    # hosts and their agents
    def add_host(self, name: str) -> HostCreated:
        return self._send(routes.add_host, HostSpec(name=name))

    def list_hosts(self) -> list[HostOut]:
        return self._send(routes.list_hosts)

    def register(self, beat: Heartbeat) -> HeartbeatReply:
        return self._send(routes.register, beat)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        return self._send(routes.heartbeat, beat)

    def apply_ops(self, ops: list[LeaseOp]) -> list[LeaseOpResult]:
        return self._send(routes.apply_ops, AgentOps(ops=ops))

    def confirm_revoked(self, lease_ids: list[str]) -> list[LeaseOpResult]:
        """The agent's side: these revoked leases are torn down (revoking → reclaimed)."""
        return self._send(routes.confirm_revoked, RevokedConfirm(lease_ids=lease_ids))

    # leases
    def grant(self, req: GrantRequest) -> LeaseOut:
        return self._send(routes.grant, req)

    def activate(self, lease_id: str) -> LeaseOut:
        return self._send(routes.activate, lease_id=lease_id)

    def renew(self, lease_id: str, ttl_s: int | None = None) -> LeaseOut:
        return self._send(routes.renew, RenewRequest(ttl_s=ttl_s), lease_id=lease_id)

    def release(self, lease_id: str, reason: str = "") -> LeaseOut:
        return self._send(routes.release, EndRequest(reason=reason), lease_id=lease_id)

    def abort(self, lease_id: str, reason: str = "") -> LeaseOut:
        return self._send(routes.abort, EndRequest(reason=reason), lease_id=lease_id)

    def revoke(self, lease_id: str, reason: str, deadline_s: float | None = None) -> LeaseOut:
        body = RevokeRequest(reason=reason, deadline_s=deadline_s)
        return self._send(routes.revoke, body, lease_id=lease_id)

    def list_leases(
        self,
        *,
        tenant: str | None = None,
        host: str | None = None,
        states: list[str] | None = None,
        live: bool = False,
        limit: int = 1000,
    ) -> list[LeaseOut]:
        query = LeaseQuery(
            tenant=tenant or None, host=host or None, state=states or None, live=live, limit=limit
        )
        return self._send(routes.list_leases, query=query)

    def show_lease(self, lease_id: str) -> LeaseOut:
        return self._send(routes.show_lease, lease_id=lease_id)

    # capacity and devices
    def status(self) -> PoolStatus:
        return self._send(routes.status)

    def show_device(self, uid: str) -> DeviceStatus:
        return self._send(routes.show_device, uid=uid)

    def annotate_device(self, uid: str, change: DeviceAnnotate) -> DeviceStatus:
        return self._send(routes.annotate_device, change, uid=uid)

    # drain: no new leases; live ones are revoked at the deadline (or at once with `now`)
    def drain_device(
        self, uid: str, *, deadline_s: float = 300.0, now: bool = False
    ) -> DrainResult:
        body = DeviceDrainRequest(deadline_s=deadline_s, now=now)
        return self._send(routes.drain_device, body, uid=uid)

    def undrain_device(self, uid: str) -> DrainResult:
        return self._send(routes.undrain_device, uid=uid)

    def drain_host(
        self, name: str, *, deadline_s: float | None = None, now: bool = False
    ) -> DrainResult:
        """A host's live leases run to their end when no deadline is given."""
        body = HostDrainRequest(deadline_s=deadline_s, now=now)
        return self._send(routes.drain_host, body, name=name)

    def undrain_host(self, name: str) -> DrainResult:
        return self._send(routes.undrain_host, name=name)

    # audit and accounting
    def audit(self, *, reclaim: bool = False, timeout_s: float = AUDIT_TIMEOUT_S) -> AuditReport:
        """Run one reclamation audit in poold (it may take seconds on a large ledger)."""
        return self._send(routes.audit, query=AuditQuery(reclaim=reclaim), timeout_s=timeout_s)

    def accounting(
        self,
        by: AccountingBy = "tenant",
        *,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AccountingReport:
        """Usage per group now, and GiB-hours and cost over [since, until] (default 30 days)."""
        query = AccountingQuery(by=by, since=since, until=until)
        return self._send(routes.accounting, query=query)
