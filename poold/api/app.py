"""poold's HTTP/JSON API: parse, authorise, call the ledger, map errors. Nothing else.

Handlers are plain functions over `poold.ledger`; every failure leaves as
`{"code", "message"}` with the status its `PoolError` class carries.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from sqlalchemy import select
from starlette.exceptions import HTTPException as StarletteHTTPException

from poold import __version__, pressure
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
    HostSpec,
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
from poold.errors import (
    BadRequest,
    Forbidden,
    InvalidSize,
    NotFound,
    NotOwner,
    PoolError,
    Unauthorized,
)
from poold.lease_states import LeaseEvent
from poold.ledger import (
    accounting,
    admin_ops,
    audit,
    capacity,
    devices,
    events,
    hosts,
    leases,
    tenants,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Host, Tenant
from poold.ledger.reaper import ReaperPolicy

log = logging.getLogger("poold.api")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the administrator, or the agent of one host."""

    admin: bool
    host: str | None = None

    @property
    def actor(self) -> str:
        return "admin" if self.admin else f"agent:{self.host}"


AUTH_CACHE_TTL_S = 5.0


async def principal(request: Request) -> Principal:
    """Authenticate the bearer token: the admin token, or one host's agent credential.

    Agent credentials are looked up once and cached for a few seconds: every
    agent request carries one, and the lookup was a third of poold's CPU time
    per lease. Hosts are never renamed, so a cached name cannot be wrong.
    """
    if "\x00" in request.url.path:
        # Every endpoint but /v1/health authenticates, so this is the one place
        # to refuse what PostgreSQL cannot compare (SQLite would just not match).
        raise BadRequest("the request path contains a NUL byte")
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token")
    admin_token: str = request.app.state.admin_token
    if hmac.compare_digest(token.encode(), admin_token.encode()):
        return Principal(admin=True)
    cache: dict[str, tuple[str, float]] = request.app.state.auth_cache
    digest = hosts.hash_credential(token)
    now = time.monotonic()
    hit = cache.get(digest)
    if hit is not None and now - hit[1] < AUTH_CACHE_TTL_S:
        return Principal(admin=False, host=hit[0])
    ledger: Ledger = request.app.state.ledger
    with ledger.read() as session:
        name = hosts.authenticate_name(session.connection(), digest)
    if len(cache) > 10_000:
        cache.clear()
    cache[digest] = (name, now)
    return Principal(admin=False, host=name)


# Module level: FastAPI resolves string annotations against module globals.
Caller = Annotated[Principal, Depends(principal)]


def _error(err: PoolError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.http_status)


def create_app(ledger: Ledger, admin_token: str) -> FastAPI:
    app = FastAPI(title="poold", version=__version__, docs_url=None, redoc_url=None)
    app.state.ledger = ledger
    app.state.admin_token = admin_token
    app.state.auth_cache = {}
    registry = CollectorRegistry()
    requests_total = Counter(
        "poold_api_errors_total", "API errors by code", ["code"], registry=registry
    )

    @app.exception_handler(PoolError)
    async def _pool_error(_req: Request, err: PoolError) -> JSONResponse:
        requests_total.labels(err.code).inc()
        log.info("refused: %s: %s", err.code, err.message)
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in err.errors()
        )
        # As on the agent socket (agent/protocol.py): a bad size is invalid_size,
        # so a tenant sees the same code whichever hop refused it.
        cls = (
            InvalidSize
            if any(tuple(e.get("loc", ()))[:2] == ("body", "size_bytes") for e in err.errors())
            else BadRequest
        )
        requests_total.labels(cls.code).inc()
        return _error(cls(f"invalid request: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            return _error(NotFound(f"no such endpoint: {err.detail}"))
        body = {
            "code": "bad_request" if err.status_code < 500 else "internal",
            "message": str(err.detail),
        }
        return JSONResponse(body, status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _crash(_req: Request, err: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(
            {"code": "internal", "message": f"internal error: {type(err).__name__}"},
            status_code=500,
        )

    def admin_only(p: Principal) -> None:
        if not p.admin:
            raise Forbidden("this needs the admin token")

    def agent_only(p: Principal) -> str:
        if p.host is None:
            raise Forbidden("this needs an agent credential")
        return p.host

    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # --- tenants ---------------------------------------------------------
    @app.post("/v1/tenants", status_code=201)
    async def create_tenant(spec: TenantSpec, p: Caller) -> TenantOut:
        admin_only(p)
        with ledger.write() as s:
            return tenants.to_out(s, tenants.create(s, spec, p.actor))

    @app.get("/v1/tenants")
    async def list_tenants(p: Caller) -> list[TenantOut]:
        admin_only(p)
        with ledger.read() as s:
            return [tenants.to_out(s, t) for t in s.scalars(select(Tenant).order_by(Tenant.name))]

    @app.get("/v1/tenants/{name}")
    async def get_tenant(name: str, p: Caller) -> TenantOut:
        admin_only(p)
        with ledger.read() as s:
            return tenants.to_out(s, tenants.get_by_name(s, name))

    @app.patch("/v1/tenants/{name}")
    async def update_tenant(name: str, change: TenantUpdate, p: Caller) -> TenantOut:
        admin_only(p)
        with ledger.write() as s:
            return tenants.to_out(s, tenants.update(s, name, change, p.actor))

    @app.delete("/v1/tenants/{name}", status_code=204)
    async def delete_tenant(name: str, p: Caller) -> Response:
        admin_only(p)
        with ledger.write() as s:
            tenants.delete(s, name, p.actor)
        return Response(status_code=204)

    # --- hosts -----------------------------------------------------------
    @app.post("/v1/hosts", status_code=201)
    async def add_host(spec: HostSpec, p: Caller) -> HostCreated:
        admin_only(p)
        with ledger.write() as s:
            host, credential = hosts.add(s, spec.name, p.actor)
            return HostCreated(**hosts.to_out(host).model_dump(), credential=credential)

    @app.get("/v1/hosts")
    async def list_hosts(p: Caller) -> list[HostOut]:
        admin_only(p)
        with ledger.read() as s:
            return [hosts.to_out(h) for h in s.scalars(select(Host).order_by(Host.name))]

    def pressure_options() -> dict[str, float]:
        """The heartbeat's pressure settings (PooldSettings, as serve() put them on the app)."""
        return {
            "pressure_watermark": float(
                getattr(app.state, "pressure_watermark", pressure.DEFAULT_WATERMARK)
            ),
            "shrink_deadline_s": float(
                getattr(app.state, "shrink_deadline_s", pressure.DEFAULT_DEADLINE_S)
            ),
        }

    @app.post("/v1/agent/register")
    async def register(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        name = agent_only(p)
        if beat.inventory is None:
            raise BadRequest("register needs the host's inventory")
        with ledger.write() as s:
            host = hosts.get_by_name(s, name)
            events.record(
                s,
                actor=p.actor,
                kind="host.register",
                host_id=host.id,
                detail={"agent_version": beat.agent_version, "devices": len(beat.inventory)},
            )
            return hosts.heartbeat(s, host, beat, **pressure_options())

    @app.post("/v1/agent/heartbeat")
    async def heartbeat(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        name = agent_only(p)
        with ledger.write() as s:
            return hosts.heartbeat(s, hosts.get_by_name(s, name), beat, **pressure_options())

    # --- leases ----------------------------------------------------------
    @app.post("/v1/agent/ops")
    async def agent_ops(body: AgentOps, p: Caller) -> list[LeaseOpResult]:
        return leases.apply_ops(ledger, agent_only(p), body.ops, p.actor)

    @app.post("/v1/leases", status_code=201)
    async def grant(req: GrantRequest, p: Caller) -> LeaseOut:
        return leases.grant(ledger, agent_only(p), req, p.actor)

    @app.post("/v1/leases/{lease_id}/activate")
    async def activate(lease_id: str, p: Caller) -> LeaseOut:
        return leases.activate(ledger, agent_only(p), lease_id, p.actor)

    @app.post("/v1/leases/{lease_id}/renew")
    async def renew(lease_id: str, body: RenewRequest, p: Caller) -> LeaseOut:
        return leases.renew(ledger, agent_only(p), lease_id, body.ttl_s)

    @app.post("/v1/leases/{lease_id}/release")
    async def release(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.RELEASE, p.actor, body.reason, host_name=p.host
        )

    @app.post("/v1/leases/{lease_id}/abort")
    async def abort(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.ABORT, p.actor, body.reason, host_name=agent_only(p)
        )

    @app.get("/v1/leases")
    async def list_leases(
        p: Caller,
        tenant: str | None = None,
        host: str | None = None,
        state: Annotated[list[str] | None, Query()] = None,
        live: bool = False,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[LeaseOut]:
        if not p.admin:
            host = p.host  # an agent sees its own host's leases only
        return leases.list_leases(
            ledger, tenant=tenant, host=host, states=state, live_only=live, limit=limit
        )

    @app.get("/v1/leases/{lease_id}")
    async def show_lease(lease_id: str, p: Caller) -> LeaseOut:
        out = leases.show(ledger, lease_id)
        if not p.admin and out.host != p.host:
            # The same code renew/release/activate give for another host's lease.
            raise NotOwner(f"lease {lease_id} is not held on host {p.host!r}", lease_id=lease_id)
        return out

    @app.get("/v1/status")
    async def status(p: Caller) -> PoolStatus:
        admin_only(p)
        return capacity.pool_status(ledger)

    # --- devices ---------------------------------------------------------
    # `:path`: device uids contain "/" (host-scoped ones are "host/numa:node2").
    @app.get("/v1/devices/{uid:path}")
    async def show_device(uid: str, p: Caller) -> DeviceStatus:
        admin_only(p)
        return capacity.device_status(ledger, uid)

    @app.patch("/v1/devices/{uid:path}")
    async def annotate_device(uid: str, change: DeviceAnnotate, p: Caller) -> DeviceStatus:
        admin_only(p)
        with ledger.write() as s:
            devices.annotate(s, uid, change, p.actor)
        return capacity.device_status(ledger, uid)

    # --- lifecycle: revoke, drain, audit (poold/ledger/admin_ops.py, audit.py) ---
    def policy() -> ReaperPolicy:
        # server.py sets the configured one; an app built by a test uses the defaults.
        found = getattr(app.state, "reaper_policy", None)
        return found if isinstance(found, ReaperPolicy) else ReaperPolicy()

    @app.post("/v1/leases/{lease_id}/revoke")
    async def revoke_lease(lease_id: str, body: RevokeRequest, p: Caller) -> LeaseOut:
        admin_only(p)
        deadline_s = body.deadline_s if body.deadline_s is not None else policy().revoke_deadline_s
        return admin_ops.revoke_lease(ledger, lease_id, body.reason, p.actor, deadline_s=deadline_s)

    @app.post("/v1/agent/revoked")
    async def revoked(body: RevokedConfirm, p: Caller) -> list[LeaseOpResult]:
        return admin_ops.confirm_revoked(ledger, agent_only(p), body.lease_ids, p.actor)

    # Declared after GET/PATCH /v1/devices/{uid:path}: a POST matches only these.
    @app.post("/v1/devices/{uid:path}/drain")
    async def drain_device(uid: str, body: DeviceDrainRequest, p: Caller) -> DrainResult:
        admin_only(p)
        return admin_ops.drain_device(
            ledger,
            uid,
            p.actor,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @app.post("/v1/devices/{uid:path}/undrain")
    async def undrain_device(uid: str, p: Caller) -> DrainResult:
        admin_only(p)
        return admin_ops.undrain_device(ledger, uid, p.actor)

    @app.post("/v1/hosts/{name}/drain")
    async def drain_host(name: str, p: Caller, body: HostDrainRequest | None = None) -> DrainResult:
        admin_only(p)
        body = body or HostDrainRequest()  # older clients send no body: no deadline
        return admin_ops.drain_host(
            ledger,
            name,
            p.actor,
            draining=True,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @app.post("/v1/hosts/{name}/undrain")
    async def undrain_host(name: str, p: Caller) -> DrainResult:
        admin_only(p)
        return admin_ops.drain_host(ledger, name, p.actor, draining=False)

    @app.post("/v1/audit")
    async def run_audit(p: Caller, reclaim: bool = False) -> AuditReport:
        admin_only(p)
        return audit.run_audit(ledger, policy(), reclaim_safe=reclaim)

    # --- accounting (poold/ledger/accounting.py) ---------------------------------
    @app.get("/v1/accounting")
    async def get_accounting(
        p: Caller,
        by: AccountingBy = "tenant",
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AccountingReport:
        admin_only(p)
        # A time without a zone is UTC, as everywhere in the ledger.
        until = _utc(until) if until is not None else datetime.now(UTC)
        since = _utc(since) if since is not None else until - ACCOUNTING_PERIOD
        if since >= until:
            raise BadRequest(f"since ({since.isoformat()}) must be before until")
        # server.py sets the configured price; an app built by a test has none.
        ddr5 = getattr(app.state, "ddr5_cost_per_gib_month", None)
        return accounting.report(
            ledger, by, since, until, float(ddr5) if ddr5 is not None else None
        )

    return app


ACCOUNTING_PERIOD = timedelta(days=30)  # --since left out: the last 30 days


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
