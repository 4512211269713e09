"""How poolctl and the agent call poold: a typed httpx client over the shared schemas.

Errors come back as the `PoolError` subclass the server raised (matched by
code); a poold that cannot be reached is `poold_unreachable`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from poold.api.schemas import (
    AccountingBy,
    AccountingReport,
    AgentOps,
    AuditReport,
    DeviceAnnotate,
    DeviceDrainRequest,
    DeviceStatus,
    DrainResult,
    EndRequest,
    GrantRequest,
    Heartbeat,
    HeartbeatReply,
    HostCreated,
    HostDrainRequest,
    HostOut,
    LeaseOp,
    LeaseOpResult,
    LeaseOut,
    PoolStatus,
    RenewRequest,
    RevokedConfirm,
    RevokeRequest,
    TenantOut,
    TenantSpec,
    TenantUpdate,
)
from poold.errors import PooldUnreachable, PoolError, from_wire

M = TypeVar("M", bound=BaseModel)


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

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        try:
            resp = self._http.request(
                method,
                path,
                params=params,
                content=body.model_dump_json(exclude_unset=False) if body is not None else None,
                headers={"content-type": "application/json"} if body is not None else None,
            )
        except httpx.TransportError as exc:
            raise PooldUnreachable(f"cannot reach poold at {self.base_url}: {exc}") from exc
        if resp.status_code == 204:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code >= 400:
            if isinstance(data, dict) and "code" in data:
                raise from_wire(str(data["code"]), str(data.get("message", "")), data.get("detail"))
            raise PoolError(f"poold answered HTTP {resp.status_code}: {resp.text[:200]}")
        return data

    def _model(
        self,
        model: type[M],
        method: str,
        path: str,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
    ) -> M:
        return model.model_validate(self._call(method, path, body, params))

    # health
    def health(self) -> dict[str, str]:
        data = self._call("GET", "/v1/health")
        assert isinstance(data, dict)
        return data

    # tenants
    def create_tenant(self, spec: TenantSpec) -> TenantOut:
        return self._model(TenantOut, "POST", "/v1/tenants", spec)

    def list_tenants(self) -> list[TenantOut]:
        return TypeAdapter(list[TenantOut]).validate_python(self._call("GET", "/v1/tenants"))

    def get_tenant(self, name: str) -> TenantOut:
        return self._model(TenantOut, "GET", f"/v1/tenants/{name}")

    def update_tenant(self, name: str, change: TenantUpdate) -> TenantOut:
        return self._model(TenantOut, "PATCH", f"/v1/tenants/{name}", change)

    def delete_tenant(self, name: str) -> None:
        self._call("DELETE", f"/v1/tenants/{name}")

    # hosts
    def add_host(self, name: str) -> HostCreated:
        from poold.api.schemas import HostSpec

        return self._model(HostCreated, "POST", "/v1/hosts", HostSpec(name=name))

    def list_hosts(self) -> list[HostOut]:
        return TypeAdapter(list[HostOut]).validate_python(self._call("GET", "/v1/hosts"))

    def register(self, beat: Heartbeat) -> HeartbeatReply:
        return self._model(HeartbeatReply, "POST", "/v1/agent/register", beat)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        return self._model(HeartbeatReply, "POST", "/v1/agent/heartbeat", beat)

    def apply_ops(self, ops: list[LeaseOp]) -> list[LeaseOpResult]:
        return TypeAdapter(list[LeaseOpResult]).validate_python(
            self._call("POST", "/v1/agent/ops", AgentOps(ops=ops))
        )

    # leases
    def grant(self, req: GrantRequest) -> LeaseOut:
        return self._model(LeaseOut, "POST", "/v1/leases", req)

    def activate(self, lease_id: str) -> LeaseOut:
        return self._model(LeaseOut, "POST", f"/v1/leases/{lease_id}/activate")

    def renew(self, lease_id: str, ttl_s: int | None = None) -> LeaseOut:
        return self._model(
            LeaseOut, "POST", f"/v1/leases/{lease_id}/renew", RenewRequest(ttl_s=ttl_s)
        )

    def release(self, lease_id: str, reason: str = "") -> LeaseOut:
        return self._model(
            LeaseOut, "POST", f"/v1/leases/{lease_id}/release", EndRequest(reason=reason)
        )

    def abort(self, lease_id: str, reason: str = "") -> LeaseOut:
        return self._model(
            LeaseOut, "POST", f"/v1/leases/{lease_id}/abort", EndRequest(reason=reason)
        )

    def list_leases(
        self,
        *,
        tenant: str | None = None,
        host: str | None = None,
        states: list[str] | None = None,
        live: bool = False,
        limit: int = 1000,
    ) -> list[LeaseOut]:
        params: dict[str, Any] = {"live": live, "limit": limit}
        if tenant:
            params["tenant"] = tenant
        if host:
            params["host"] = host
        if states:
            params["state"] = states
        return TypeAdapter(list[LeaseOut]).validate_python(
            self._call("GET", "/v1/leases", params=params)
        )

    def show_lease(self, lease_id: str) -> LeaseOut:
        return self._model(LeaseOut, "GET", f"/v1/leases/{lease_id}")

    def status(self) -> PoolStatus:
        return self._model(PoolStatus, "GET", "/v1/status")

    # devices
    def show_device(self, uid: str) -> DeviceStatus:
        return self._model(DeviceStatus, "GET", f"/v1/devices/{quote(uid, safe='')}")

    def annotate_device(self, uid: str, change: DeviceAnnotate) -> DeviceStatus:
        return self._model(DeviceStatus, "PATCH", f"/v1/devices/{quote(uid, safe='')}", change)

    # lifecycle: revoke, drain, audit
    def revoke(self, lease_id: str, reason: str, deadline_s: float | None = None) -> LeaseOut:
        return self._model(
            LeaseOut,
            "POST",
            f"/v1/leases/{lease_id}/revoke",
            RevokeRequest(reason=reason, deadline_s=deadline_s),
        )

    def confirm_revoked(self, lease_ids: list[str]) -> list[LeaseOpResult]:
        """The agent's side: these revoked leases are torn down (revoking → reclaimed)."""
        return TypeAdapter(list[LeaseOpResult]).validate_python(
            self._call("POST", "/v1/agent/revoked", RevokedConfirm(lease_ids=lease_ids))
        )

    def drain_device(
        self, uid: str, *, deadline_s: float = 300.0, now: bool = False
    ) -> DrainResult:
        return self._model(
            DrainResult,
            "POST",
            f"/v1/devices/{quote(uid, safe='')}/drain",
            DeviceDrainRequest(deadline_s=deadline_s, now=now),
        )

    def undrain_device(self, uid: str) -> DrainResult:
        return self._model(DrainResult, "POST", f"/v1/devices/{quote(uid, safe='')}/undrain")

    def drain_host(
        self, name: str, *, deadline_s: float | None = None, now: bool = False
    ) -> DrainResult:
        """No new leases on the host; its live leases are revoked at the deadline
        (or at once with `now`), or run to their end when there is none."""
        return self._model(
            DrainResult,
            "POST",
            f"/v1/hosts/{name}/drain",
            HostDrainRequest(deadline_s=deadline_s, now=now),
        )

    def undrain_host(self, name: str) -> DrainResult:
        return self._model(DrainResult, "POST", f"/v1/hosts/{name}/undrain")

    def accounting(
        self,
        by: AccountingBy = "tenant",
        *,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AccountingReport:
        """Usage per group now, and GiB-hours and cost over [since, until] (default 30 days)."""
        params: dict[str, Any] = {"by": by}
        if since is not None:
            params["since"] = since.isoformat()
        if until is not None:
            params["until"] = until.isoformat()
        return self._model(AccountingReport, "GET", "/v1/accounting", params=params)

    def audit(self, *, reclaim: bool = False, timeout_s: float = 600.0) -> AuditReport:
        """Run one reclamation audit in poold (it may take seconds on a large ledger)."""
        try:
            resp = self._http.post("/v1/audit", params={"reclaim": reclaim}, timeout=timeout_s)
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
        return AuditReport.model_validate_json(resp.content)
