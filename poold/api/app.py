"""poold's HTTP/JSON API: parse, authorise, call the ledger, map errors. Nothing else.

Every route of `poold.wire.routes` gets one handler here, bound by its name; the app
refuses to build when a route has none. Who may call a route is the table's word
(`Route.auth`), checked before the handler runs. Handlers open no transactions: each
calls one ledger function (which owns its transaction) and returns its value. Every
failure leaves as `{"code", "message"}` with the status its `PoolError` class carries.
"""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime, timedelta
from typing import Annotated

import anyio
import anyio.to_thread
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.pool import QueuePool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from poold import __version__, pressure
from poold.api import openapi
from poold.api.binding import Binder
from poold.api.gate import (
    Authenticator,
    Caller,
    Gate,
    Principal,
    Refusals,
    error_response,
    invalid_response,
)
from poold.api.metrics import PooldMetrics
from poold.errors import (
    BadRequest,
    NotFound,
    NotOwner,
    PoolError,
)
from poold.lease_states import LeaseEvent
from poold.ledger import accounting as ledger_accounting
from poold.ledger import (
    admin_ops,
    budget_sizing,
    capacity,
    delegation,
    device_hosts,
    devices,
    draining,
    host_deletion,
    hosts,
    lease_views,
    leases,
    op_batches,
    tenants,
)
from poold.ledger import audit as ledger_audit
from poold.ledger import heartbeat as ledger_heartbeat
from poold.ledger.db import Ledger
from poold.ledger.reaper import ReaperPolicy
from poold.settings import DEFAULT_MAX_BODY_BYTES
from poold.wire.admin import (
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
from poold.wire.routes import (
    AccountingQuery,
    AuditQuery,
    HostDeleteQuery,
    LeaseQuery,
)

log = logging.getLogger("poold.api")

DEFAULT_WORKER_THREADS = 16


def worker_threads(ledger: Ledger) -> int:
    """How many requests may do ledger work at once: as many as the pool has connections.

    More threads than connections would only queue inside the pool (and time out there
    as `ledger_unavailable`); fewer would leave connections idle. `poold serve` keeps
    `db_pool_size` connections and no overflow (poold/settings.py); SQLite gets the same
    bound: its writers serialise on BEGIN IMMEDIATE whatever the bound, and its readers
    run in parallel under WAL.
    """
    pool = ledger.engine.pool
    if isinstance(pool, QueuePool):
        overflow = int(getattr(pool, "_max_overflow", -1))  # QueuePool has no public getter
        if overflow >= 0:
            return max(1, pool.size() + overflow)
    return DEFAULT_WORKER_THREADS


def _host_of(p: Principal) -> str:
    """The calling agent's host (routes of auth "agent" have checked there is one)."""
    assert p.host is not None
    return p.host


class PooldApp(FastAPI):
    """FastAPI, with the agents' hot routes served before any of its layers.

    `Gate` is a middleware inside FastAPI's own layers (its body limit, its telemetry,
    Starlette's error middleware), which every request crossed, the hot routes the gate
    serves itself (`DIRECT_ROUTES`) too: ~0.04 ms of poold's CPU per request (an empty
    op batch: 0.42 -> 0.37 ms). Those now go straight to a gate of their own (the same
    authenticator, limits, refusals and metrics); every other request takes the whole
    way, as before, so that a crash in a FastAPI handler is still answered by the gate
    inside the error middleware.
    """

    front: Gate | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front
        if front is not None and front.serves_directly(scope):
            await front(scope, receive, send)
        else:
            await self.behind_front(scope, receive, send)

    async def behind_front(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself, with its layers and the gate inside them."""
        await super().__call__(scope, receive, send)


def create_app(
    ledger: Ledger, admin_token: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> PooldApp:
    # /docs and /redoc are FastAPI's pages: they load Swagger UI and ReDoc from a CDN, so
    # they render only where the browser reaches it; /openapi.json is whole without it.
    app = PooldApp(
        title="poold",
        version=__version__,
        description="The far-memory pool's ledger: leases, tenants, hosts, devices.",
        docs_url="/docs",
        redoc_url="/redoc",
    )
    # The schema is built from the route table (poold/api/openapi.py), not inferred.
    app.openapi = lambda: openapi.build(app)  # type: ignore[method-assign]
    app.state.ledger = ledger
    app.state.admin_token = admin_token
    app.state.auth_cache = {}
    pool_metrics = PooldMetrics(ledger)
    app.state.metrics = pool_metrics  # server.py counts its reaper passes here
    refusals = Refusals(pool_metrics.registry)
    limiter = anyio.CapacityLimiter(worker_threads(ledger))
    ledger.listen_for_news()  # other poolds' news for the agents waiting here (PostgreSQL)
    app.state.limiter = limiter
    bind = Binder(app, limiter, refusals.outage, on_cpu=pool_metrics.worker_cpu)
    # One gate's settings, two places: inside FastAPI's layers, and in front of them for
    # the hot routes (PooldApp).
    gate = functools.partial(
        Gate,
        router=app.router,
        authenticate=Authenticator(ledger, admin_token, app.state.auth_cache),
        refusals=refusals,
        limiter=limiter,
        max_body_bytes=max_body_bytes,
        metrics=pool_metrics,
        direct=bind.direct,  # filled as the handlers below are bound
    )
    app.add_middleware(gate)
    app.front = gate(app.behind_front)

    @app.exception_handler(PoolError)
    async def _pool_error(req: Request, err: PoolError) -> JSONResponse:
        return refusals.response(err, req.scope)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_req: Request, err: RequestValidationError) -> JSONResponse:
        return invalid_response(refusals, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            return error_response(NotFound(f"no such endpoint: {err.detail}"))
        body = {
            "code": "bad_request" if err.status_code < 500 else "internal",
            "message": str(err.detail),
        }
        return JSONResponse(body, status_code=err.status_code)

    # No handler for Exception: Starlette would register it in ServerErrorMiddleware,
    # which re-raises after answering. `Gate` answers unexpected exceptions instead.

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
            delegation_policy=delegation_policy(),
        )

    def delegation_policy() -> delegation.DelegationPolicy:
        # server.py sets the configured one (reservation_ttl_s); a test's app the default.
        found = getattr(app.state, "delegation_policy", None)
        if isinstance(found, delegation.DelegationPolicy):
            return found
        return delegation.DEFAULT_POLICY

    @bind
    async def health() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @bind
    async def metrics() -> Response:
        # The ledger's gauges are read at scrape time, in a worker thread like any ledger
        # work; a ledger that is down gives `poold_ledger_up 0`, never a 500.
        body = await anyio.to_thread.run_sync(pool_metrics.render, limiter=limiter)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # --- tenants ---------------------------------------------------------
    @bind
    def create_tenant(spec: TenantSpec, p: Caller) -> TenantOut:
        return tenants.create_tenant(ledger, spec, p.actor)

    @bind
    def list_tenants() -> list[TenantOut]:
        return tenants.list_tenants(ledger)

    @bind
    def get_tenant(name: str) -> TenantOut:
        return tenants.get_tenant(ledger, name)

    @bind
    def update_tenant(name: str, change: TenantUpdate, p: Caller) -> TenantOut:
        return tenants.update_tenant(
            ledger, name, change, p.actor, on_quota_change=budget_sizing.claw_back
        )

    @bind
    def delete_tenant(name: str, p: Caller) -> Response:
        tenants.delete_tenant(ledger, name, p.actor)
        return Response(status_code=204)

    # --- hosts and their agents ------------------------------------------
    @bind
    def add_host(spec: HostSpec, p: Caller) -> HostCreated:
        return hosts.add_host(ledger, spec.name, p.actor)

    @bind
    def list_hosts() -> list[HostOut]:
        return hosts.list_hosts(ledger)

    @bind
    def delete_host(name: str, q: Annotated[HostDeleteQuery, Query()], p: Caller) -> HostDeleted:
        out = host_deletion.delete_host(ledger, name, p.actor, force=q.force)
        # Its credential stops working at once in this process: drop the cached name
        # (other poold processes' caches forget it within AUTH_CACHE_TTL_S).
        cache: dict[str, tuple[str, float]] = app.state.auth_cache
        for digest in [d for d, (n, _at) in list(cache.items()) if n == name]:
            cache.pop(digest, None)
        return out

    @bind
    def register(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        if beat.inventory is None:
            raise BadRequest("register needs the host's inventory")
        return receive(beat, p, register=True)

    @bind
    def heartbeat(beat: Heartbeat, p: Caller) -> HeartbeatReply:
        return receive(beat, p, register=False)

    @bind
    async def wait_news(body: NewsWait, p: Caller) -> News:
        host = _host_of(p)
        host_id = ledger.host_ids.get(host)
        if host_id is None:
            host_id = await anyio.to_thread.run_sync(
                lambda: hosts.host_id_of(ledger, host), limiter=limiter
            )
        news, token = await ledger.news.wait(host_id, body.since, body.timeout_s)
        return News(news=news, token=token)

    @bind
    def apply_ops(body: AgentOps, p: Caller) -> list[LeaseOpResult]:
        return op_batches.apply_ops(
            ledger, _host_of(p), body.ops, p.actor, request_id=body.request_id
        )

    @bind
    def confirm_revoked(body: RevokedConfirm, p: Caller) -> list[LeaseOpResult]:
        return admin_ops.confirm_revoked(ledger, _host_of(p), body.lease_ids, p.actor)

    @bind
    def delegate(body: DelegationRequest, p: Caller) -> Delegation:
        return delegation.delegate(ledger, _host_of(p), body, p.actor, delegation_policy())

    # --- leases ----------------------------------------------------------
    @bind
    def grant(req: GrantRequest, p: Caller) -> GrantReply:
        return leases.grant(ledger, _host_of(p), req, p.actor)

    @bind
    def activate(lease_id: str, p: Caller) -> LeaseOut:
        return leases.activate(ledger, _host_of(p), lease_id, p.actor)

    @bind
    def renew(lease_id: str, body: RenewRequest, p: Caller) -> LeaseOut:
        return leases.renew(ledger, _host_of(p), lease_id, body.ttl_s)

    @bind
    def release(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.RELEASE, p.actor, body.reason, host_name=p.host
        )

    @bind
    def abort(lease_id: str, body: EndRequest, p: Caller) -> LeaseOut:
        return leases.end(
            ledger, lease_id, LeaseEvent.ABORT, p.actor, body.reason, host_name=_host_of(p)
        )

    @bind
    def revoke(lease_id: str, body: RevokeRequest, p: Caller) -> LeaseOut:
        deadline_s = body.deadline_s if body.deadline_s is not None else policy().revoke_deadline_s
        return admin_ops.revoke_lease(ledger, lease_id, body.reason, p.actor, deadline_s=deadline_s)

    @bind
    def end_lease(lease_id: str, body: LeaseEndRequest, p: Caller) -> LeaseEnded:
        return admin_ops.end_lease(ledger, lease_id, p.actor, body.reason)

    @bind
    def list_leases(p: Caller, q: Annotated[LeaseQuery, Query()]) -> list[LeaseOut]:
        # An agent sees its own host's leases only.
        host = q.host if p.admin else p.host
        return lease_views.list_leases(
            ledger, tenant=q.tenant, host=host, states=q.state, live_only=q.live, limit=q.limit
        )

    @bind
    def show_lease(lease_id: str, p: Caller) -> LeaseOut:
        out = lease_views.show(ledger, lease_id)
        if not p.admin and out.host != p.host:
            # The same code renew/release/activate give for another host's lease.
            raise NotOwner(f"lease {lease_id} is not held on host {p.host!r}", lease_id=lease_id)
        return out

    # --- capacity and devices --------------------------------------------
    @bind
    def status() -> PoolStatus:
        return capacity.pool_status(ledger)

    @bind
    def show_device(uid: str) -> DeviceStatus:
        return capacity.device_status(ledger, uid)

    @bind
    def annotate_device(uid: str, change: DeviceAnnotate, p: Caller) -> DeviceStatus:
        devices.annotate_device(ledger, uid, change, p.actor)
        return capacity.device_status(ledger, uid)

    # --- drain (poold/ledger/draining.py) -----------------------------------
    @bind
    def drain_device(uid: str, body: DeviceDrainRequest, p: Caller) -> DrainResult:
        return draining.drain_device(
            ledger,
            uid,
            p.actor,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @bind
    def undrain_device(uid: str, p: Caller) -> DrainResult:
        return draining.undrain_device(ledger, uid, p.actor)

    # --- which hosts may report a device (poold/ledger/device_hosts.py) -------
    @bind
    def allow_device_host(uid: str, host: str, p: Caller) -> DeviceHosts:
        return device_hosts.allow_host(ledger, uid, host, p.actor)

    @bind
    def disallow_device_host(uid: str, host: str, p: Caller) -> DeviceHosts:
        return device_hosts.disallow_host(ledger, uid, host, p.actor)

    @bind
    def drain_host(name: str, p: Caller, body: HostDrainRequest | None = None) -> DrainResult:
        body = body or HostDrainRequest()  # older clients send no body: no deadline
        return draining.drain_host(
            ledger,
            name,
            p.actor,
            draining=True,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @bind
    def undrain_host(name: str, p: Caller) -> DrainResult:
        return draining.drain_host(ledger, name, p.actor, draining=False)

    # --- audit and accounting --------------------------------------------
    @bind
    def audit(q: Annotated[AuditQuery, Query()]) -> AuditReport:
        try:
            report = ledger_audit.run_audit(ledger, policy(), reclaim_safe=q.reclaim)
        except Exception:
            pool_metrics.audit_run(None)
            raise
        pool_metrics.audit_run(report.exit_code)
        return report

    @bind
    def accounting(q: Annotated[AccountingQuery, Query()]) -> AccountingReport:
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
