"""poold's HTTP/JSON API: parse, authorise, call the ledger, map errors. Nothing else.

Every route of `poold.wire.routes` gets one handler here, bound by its name; the app
refuses to build when a route has none. Who may call a route is the table's word
(`Route.auth`), checked before the handler runs. Handlers open no transactions: each
calls one ledger function (which owns its transaction) and returns its value. Every
failure leaves as `{"code", "message"}` with the status its `PoolError` class carries.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from poold import __version__, pressure
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
from poold.ledger import accounting as ledger_accounting
from poold.ledger import admin_ops, capacity, devices, hosts, lease_views, leases, tenants
from poold.ledger import audit as ledger_audit
from poold.ledger import heartbeat as ledger_heartbeat
from poold.ledger.db import Ledger
from poold.ledger.reaper import ReaperPolicy
from poold.wire.admin import (
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
    LeaseOpResult,
    RenewRequest,
    RevokedConfirm,
)
from poold.wire.common import EndRequest, LeaseOut
from poold.wire.routes import (
    ROUTES,
    AccountingQuery,
    AuditQuery,
    Auth,
    LeaseQuery,
    Route,
)

log = logging.getLogger("poold.api")

F = TypeVar("F", bound=Callable[..., Any])


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
    name = hosts.authenticate(ledger, digest)
    if len(cache) > 10_000:
        cache.clear()
    cache[digest] = (name, now)
    return Principal(admin=False, host=name)


# Module level: FastAPI resolves string annotations against module globals.
Caller = Annotated[Principal, Depends(principal)]


async def _admin(p: Caller) -> Principal:
    if not p.admin:
        raise Forbidden("this needs the admin token")
    return p


async def _agent(p: Caller) -> Principal:
    if p.host is None:
        raise Forbidden("this needs an agent credential")
    return p


_AUTH: dict[Auth, list[Any]] = {
    "none": [],
    "admin": [Depends(_admin)],
    "agent": [Depends(_agent)],
    "any": [Depends(principal)],
}


def _host_of(p: Principal) -> str:
    """The calling agent's host (routes of auth "agent" have checked there is one)."""
    assert p.host is not None
    return p.host


def _error(err: PoolError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.http_status)


class _Binder:
    """Binds handlers to the routes of `poold.wire.routes`, by name (subiquity's `bind`)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.bound: set[str] = set()

    def __call__(self, fn: F) -> F:
        route = ROUTES.get(fn.__name__)
        if route is None:
            raise RuntimeError(f"handler {fn.__name__} has no route in poold.wire.routes")
        _check_body(route, fn)
        self.app.add_api_route(
            route.path,
            fn,
            methods=[route.method],
            status_code=route.status_code,
            dependencies=_AUTH[route.auth],
            name=route.name,
        )
        self.bound.add(route.name)
        return fn

    def check_complete(self) -> None:
        missing = [name for name in ROUTES if name not in self.bound]
        if missing:
            raise RuntimeError(f"routes without a handler: {', '.join(missing)}")


def _check_body(route: Route[Any], fn: Callable[..., Any]) -> None:
    """A handler's body parameter is the model the route table names, or none at all."""
    hints = typing.get_type_hints(fn, include_extras=True)
    models = set()
    for name in inspect.signature(fn).parameters:
        hint = hints.get(name)
        for tp in (hint, *typing.get_args(hint)):
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                if route.query is not None and tp is route.query:
                    continue
                models.add(tp)
    expected = {route.body} if route.body is not None else set()
    if models != expected:
        raise RuntimeError(f"handler {fn.__name__} takes {models}, its route says {expected}")


def create_app(ledger: Ledger, admin_token: str) -> FastAPI:
    app = FastAPI(title="poold", version=__version__, docs_url=None, redoc_url=None)
    app.state.ledger = ledger
    app.state.admin_token = admin_token
    app.state.auth_cache = {}
    registry = CollectorRegistry()
    errors_total = Counter(
        "poold_api_errors_total", "API errors by code", ["code"], registry=registry
    )
    bind = _Binder(app)

    @app.exception_handler(PoolError)
    async def _pool_error(_req: Request, err: PoolError) -> JSONResponse:
        errors_total.labels(err.code).inc()
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
        errors_total.labels(cls.code).inc()
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

    def policy() -> ReaperPolicy:
        # server.py sets the configured one; an app built by a test uses the defaults.
        found = getattr(app.state, "reaper_policy", None)
        return found if isinstance(found, ReaperPolicy) else ReaperPolicy()

    def receive(beat: Heartbeat, p: Principal, *, register: bool) -> HeartbeatReply:
        """Apply a heartbeat with the pressure settings serve() put on the app."""
        return ledger_heartbeat.receive_heartbeat(
            ledger,
            _host_of(p),
            beat,
            p.actor,
            register=register,
            pressure_watermark=float(
                getattr(app.state, "pressure_watermark", pressure.DEFAULT_WATERMARK)
            ),
            shrink_deadline_s=float(
                getattr(app.state, "shrink_deadline_s", pressure.DEFAULT_DEADLINE_S)
            ),
        )

    @bind
    async def health() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @bind
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # --- tenants ---------------------------------------------------------
    @bind
    async def create_tenant(spec: TenantSpec, p: Caller) -> TenantOut:
        return tenants.create_tenant(ledger, spec, p.actor)

    @bind
    async def list_tenants() -> list[TenantOut]:
        return tenants.list_tenants(ledger)

    @bind
    async def get_tenant(name: str) -> TenantOut:
        return tenants.get_tenant(ledger, name)

    @bind
    async def update_tenant(name: str, change: TenantUpdate, p: Caller) -> TenantOut:
        return tenants.update_tenant(ledger, name, change, p.actor)

    @bind
    async def delete_tenant(name: str, p: Caller) -> Response:
        tenants.delete_tenant(ledger, name, p.actor)
        return Response(status_code=204)

    # --- hosts and their agents ------------------------------------------
    @bind
    async def add_host(spec: HostSpec, p: Caller) -> HostCreated:
        return hosts.add_host(ledger, spec.name, p.actor)

    @bind
    async def list_hosts() -> list[HostOut]:
        return hosts.list_hosts(ledger)

    @bind
    async def register(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        if beat.inventory is None:
            raise BadRequest("register needs the host's inventory")
        return receive(beat, p, register=True)

    @bind
    async def heartbeat(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        return receive(beat, p, register=False)

    @bind
    async def apply_ops(body: AgentOps, p: Caller) -> list[LeaseOpResult]:
        return leases.apply_ops(ledger, _host_of(p), body.ops, p.actor)

    @bind
    async def confirm_revoked(body: RevokedConfirm, p: Caller) -> list[LeaseOpResult]:
        return admin_ops.confirm_revoked(ledger, _host_of(p), body.lease_ids, p.actor)

    # --- leases ----------------------------------------------------------
    @bind
    async def grant(req: GrantRequest, p: Caller) -> LeaseOut:
        return leases.grant(ledger, _host_of(p), req, p.actor)

    @bind
    async def activate(lease_id: str, p: Caller) -> LeaseOut:
        return leases.activate(ledger, _host_of(p), lease_id, p.actor)

    @bind
    async def renew(lease_id: str, body: RenewRequest, p: Caller) -> LeaseOut:
        return leases.renew(ledger, _host_of(p), lease_id, body.ttl_s)

    @bind
    async def release(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.RELEASE, p.actor, body.reason, host_name=p.host
        )

    @bind
    async def abort(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.ABORT, p.actor, body.reason, host_name=_host_of(p)
        )

    @bind
    async def revoke(lease_id: str, body: RevokeRequest, p: Caller) -> LeaseOut:
        deadline_s = body.deadline_s if body.deadline_s is not None else policy().revoke_deadline_s
        return admin_ops.revoke_lease(ledger, lease_id, body.reason, p.actor, deadline_s=deadline_s)

    @bind
    async def list_leases(p: Caller, q: Annotated[LeaseQuery, Query()]) -> list[LeaseOut]:
        # An agent sees its own host's leases only.
        host = q.host if p.admin else p.host
        return lease_views.list_leases(
            ledger, tenant=q.tenant, host=host, states=q.state, live_only=q.live, limit=q.limit
        )

    @bind
    async def show_lease(lease_id: str, p: Caller) -> LeaseOut:
        out = lease_views.show(ledger, lease_id)
        if not p.admin and out.host != p.host:
            # The same code renew/release/activate give for another host's lease.
            raise NotOwner(f"lease {lease_id} is not held on host {p.host!r}", lease_id=lease_id)
        return out

    # --- capacity and devices --------------------------------------------
    @bind
    async def status() -> PoolStatus:
        return capacity.pool_status(ledger)

    @bind
    async def show_device(uid: str) -> DeviceStatus:
        return capacity.device_status(ledger, uid)

    @bind
    async def annotate_device(uid: str, change: DeviceAnnotate, p: Caller) -> DeviceStatus:
        devices.annotate_device(ledger, uid, change, p.actor)
        return capacity.device_status(ledger, uid)

    # --- drain (poold/ledger/admin_ops.py) ----------------------------------
    @bind
    async def drain_device(uid: str, body: DeviceDrainRequest, p: Caller) -> DrainResult:
        return admin_ops.drain_device(
            ledger,
            uid,
            p.actor,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @bind
    async def undrain_device(uid: str, p: Caller) -> DrainResult:
        return admin_ops.undrain_device(ledger, uid, p.actor)

    @bind
    async def drain_host(name: str, p: Caller, body: HostDrainRequest | None = None) -> DrainResult:
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

    @bind
    async def undrain_host(name: str, p: Caller) -> DrainResult:
        return admin_ops.drain_host(ledger, name, p.actor, draining=False)

    # --- audit and accounting --------------------------------------------
    @bind
    async def audit(q: Annotated[AuditQuery, Query()]) -> AuditReport:
        return ledger_audit.run_audit(ledger, policy(), reclaim_safe=q.reclaim)

    @bind
    async def accounting(q: Annotated[AccountingQuery, Query()]) -> AccountingReport:
        # A time without a zone is UTC, as everywhere in the ledger.
        until = _utc(q.until) if q.until is not None else datetime.now(UTC)
        since = _utc(q.since) if q.since is not None else until - ACCOUNTING_PERIOD
        if since >= until:
            raise BadRequest(f"since ({since.isoformat()}) must be before until")
        # server.py sets the configured price; an app built by a test has none.
        ddr5 = getattr(app.state, "ddr5_cost_per_gib_month", None)
        return ledger_accounting.report(
            ledger, q.by, since, until, float(ddr5) if ddr5 is not None else None
        )

    bind.check_complete()
    return app


ACCOUNTING_PERIOD = timedelta(days=30)  # --since left out: the last 30 days


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
