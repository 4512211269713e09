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
import threading
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from pydantic import BaseModel, TypeAdapter, ValidationError
from sqlalchemy.pool import QueuePool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poold import __version__, pressure
from poold.api import openapi
from poold.api.metrics import UNMATCHED_ROUTE, PooldMetrics
from poold.errors import (
    BadRequest,
    BodyTooLarge,
    Forbidden,
    InvalidSize,
    LedgerUnavailable,
    NotFound,
    NotOwner,
    PoolError,
    Unauthorized,
)
from poold.lease_states import LeaseEvent
from poold.ledger import accounting as ledger_accounting
from poold.ledger import (
    admin_ops,
    capacity,
    delegation,
    device_hosts,
    devices,
    hosts,
    lease_views,
    leases,
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
    ROUTES,
    AccountingQuery,
    AuditQuery,
    Auth,
    HostDeleteQuery,
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
# DEFAULT_MAX_BODY_BYTES (poold.settings, 48 MiB): the biggest legitimate request is the
# heartbeat of a host holding 100,000 leases: 100,000 renewals, reports and held leases
# (one holder each) are 41.6 MB of JSON (the renewals alone 6.3 MB). The cap is a little
# above; a bigger body is refused from its Content-Length, or as soon as a chunked one
# passes the cap.
# Requests doing ledger work at once when the engine's pool sets no bound (NullPool).
DEFAULT_WORKER_THREADS = 16
RETRY_AFTER_S = 1  # what a 503 ledger_unavailable tells the caller to wait
CRASH_TRACEBACK_EVERY_S = 60.0

# Authenticated routes whose handlers are `async def`: they wait (a long poll) and do
# no ledger work on the event loop.
ASYNC_ROUTES = frozenset({"wait_news"})
# The agent's per-lease routes, which `_Gate` serves itself (`_Gate._direct`): a body,
# the caller, one ledger call, no path or query parameters.
DIRECT_ROUTES = frozenset({"grant", "apply_ops"})

# Where the gate leaves the authenticated caller for the `principal` dependency.
_PRINCIPAL = "poold.principal"


def worker_threads(ledger: Ledger) -> int:
    """How many requests may do ledger work at once: as many as the pool has connections.

    More threads than connections would only queue inside the pool (and time out there
    after 30 s as a 500); fewer would leave connections idle. SQLite gets the same
    bound (SQLAlchemy's default QueuePool, 5 + 10 overflow): its writers serialise on
    BEGIN IMMEDIATE whatever the bound, and its readers run in parallel under WAL.
    """
    pool = ledger.engine.pool
    if isinstance(pool, QueuePool):
        overflow = int(getattr(pool, "_max_overflow", -1))  # QueuePool has no public getter
        if overflow >= 0:
            return max(1, pool.size() + overflow)
    return DEFAULT_WORKER_THREADS


async def principal(request: Request) -> Principal:
    """The caller `_Gate` authenticated before any byte of the body was read."""
    found = request.scope.get(_PRINCIPAL)
    if not isinstance(found, Principal):
        raise Unauthorized("missing bearer token")
    return found


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


async def _read_body(request: Request) -> bytes:
    """The raw body, read on the event loop (cheap); parsing it is the worker thread's job."""
    return await request.body()


RawBody = Annotated[bytes, Depends(_read_body)]
_RAW_BODY = "raw_body"


def _host_of(p: Principal) -> str:
    """The calling agent's host (routes of auth "agent" have checked there is one)."""
    assert p.host is not None
    return p.host


def _error(err: PoolError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.http_status, headers=headers)


def _invalid(refusals: _Refusals, err: RequestValidationError) -> JSONResponse:
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
    refusals.total.labels(cls.code).inc()
    return _error(cls(f"invalid request: {problems}"))


class _Outage:
    """Whether the ledger answers, as requests see it: logged when that changes, not per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._refused = 0

    def failed(self, err: PoolError) -> None:
        with self._lock:
            first = self._since is None
            if first:
                self._since = time.monotonic()
            self._refused += 1
        if first:
            log.warning("ledger unavailable, answering 503 until it is back: %s", err.message)

    def reachable(self) -> None:
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            since, refused = self._since, self._refused
            self._since, self._refused = None, 0
        if since is not None:
            log.info(
                "ledger reachable again after %.1fs (%d request(s) answered 503 meanwhile)",
                time.monotonic() - since,
                refused,
            )


class _Refusals:
    """How a `PoolError` leaves: counted by code, logged (an outage once), with its status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter(
            "poold_api_errors_total", "API errors by code", ["code"], registry=registry
        )
        for code in ("internal", "ledger_unavailable"):  # alerts see them from the start, at 0
            self.total.labels(code)
        self.outage = _Outage()
        self._tracebacks: dict[str, float] = {}  # exception type -> when one was last logged

    def response(self, err: PoolError) -> JSONResponse:
        self.total.labels(err.code).inc()
        if isinstance(err, LedgerUnavailable):
            self.outage.failed(err)
            return _error(err, {"Retry-After": str(RETRY_AFTER_S)})
        log.info("refused: %s: %s", err.code, err.message)
        return _error(err)

    def crash(self, exc: Exception, scope: Scope) -> JSONResponse:
        """A 500 for an unexpected exception: one line, its traceback once a minute per type."""
        self.total.labels("internal").inc()
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        now = time.monotonic()
        last = self._tracebacks.get(kind)
        fresh = last is None or now - last >= CRASH_TRACEBACK_EVERY_S
        if fresh:
            self._tracebacks[kind] = now
        log.error(
            "internal error on %s %s: %s: %s%s",
            scope.get("method"),
            scope.get("path"),
            kind,
            exc,
            "" if fresh else " (traceback at DEBUG: one per type per minute above it)",
            exc_info=exc if fresh else None,
        )
        if not fresh:
            log.debug("traceback of the internal error above", exc_info=exc)
        return JSONResponse(
            {"code": "internal", "message": f"internal error: {type(exc).__name__}"},
            status_code=500,
        )


class _Authenticator:
    """Bearer token -> Principal: the admin token, or one host's agent credential.

    Agent credentials are looked up once and cached for a few seconds: every
    agent request carries one, and the lookup was a third of poold's CPU time
    per lease. Hosts are never renamed, so a cached name cannot be wrong. A miss
    looks up in a worker thread, under the same limiter as the handlers.
    """

    def __init__(
        self, ledger: Ledger, admin_token: str, cache: dict[str, tuple[str, float]]
    ) -> None:
        self.ledger = ledger
        self.admin_token = admin_token.encode()
        self.cache = cache

    async def __call__(
        self, token: str, limiter: anyio.CapacityLimiter, outage: _Outage
    ) -> Principal:
        if hmac.compare_digest(token.encode(), self.admin_token):
            return Principal(admin=True)
        digest = hosts.hash_credential(token)
        now = time.monotonic()
        hit = self.cache.get(digest)
        if hit is not None and now - hit[1] < AUTH_CACHE_TTL_S:
            return Principal(admin=False, host=hit[0])
        name = await anyio.to_thread.run_sync(
            hosts.authenticate, self.ledger, digest, limiter=limiter
        )
        outage.reachable()
        if len(self.cache) > 10_000:
            self.cache.clear()
        self.cache[digest] = (name, now)
        return Principal(admin=False, host=name)


def _bearer(scope: Scope) -> str:
    header = ""
    for key, value in scope["headers"]:
        if key == b"authorization":
            header = value.decode("latin-1")
            break
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token")
    return token


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses it before we are called
    return None


class _Gate:
    """What every request passes before FastAPI reads a byte of its body, and the net under it.

    Pure ASGI, just inside Starlette's ServerErrorMiddleware: (1) for a route whose
    table `auth` is not "none", the bearer token is checked from the headers alone,
    so an unauthenticated body is never read (uvicorn discards what the client still
    sends, 64 KiB at a time); (2) a Content-Length past the cap is a 413 unread, and
    a chunked body is counted and stopped at the cap; (3) an unexpected exception is
    answered 500 here, without re-raising: ServerErrorMiddleware would re-raise it
    after answering, and uvicorn would then drop the keep-alive connection.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        router: APIRouter,
        authenticate: _Authenticator,
        refusals: _Refusals,
        limiter: anyio.CapacityLimiter,
        max_body_bytes: int,
        metrics: PooldMetrics,
        direct: dict[str, Callable[[dict[str, Any]], Response]],
    ) -> None:
        self.app = app
        self.router = router
        self.authenticate = authenticate
        self.refusals = refusals
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.direct = direct
        # (method, path) -> the route it matched, for routes without path parameters:
        # for those the match depends on nothing else, and it costs a scan of every route.
        self._static: dict[tuple[str, str], Route[Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        status: int | None = None
        arrived = time.perf_counter()
        route = self._route_of(scope)

        async def send_tracked(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
            await send(message)

        try:
            try:
                await self._admit(scope, route)
            except PoolError as err:
                await self.refusals.response(err)(scope, receive, send_tracked)
                return
            call = self.direct.get(route.name) if route is not None else None
            if route is not None and call is not None:
                reply = await self._direct(route, call, scope, self._counted(receive))
                await reply(scope, receive, send_tracked)
                return
            await self.app(scope, self._counted(receive), send_tracked)
        except ClientDisconnect:
            return  # nobody to answer
        except Exception as exc:  # the net: answered 500, never re-raised
            reply = self.refusals.crash(exc, scope)
            if not started:
                await reply(scope, receive, send_tracked)
        finally:
            # By route name, never the raw path: the label set stays the route table's.
            self.metrics.request(
                route.name if route is not None else UNMATCHED_ROUTE,
                status,
                time.perf_counter() - arrived,
            )

    async def _admit(self, scope: Scope, route: Route[Any] | None) -> None:
        """Authenticate (when the route wants it) and check the announced length."""
        if route is not None and route.auth != "none":
            if "\x00" in scope["path"]:
                # Every endpoint but /v1/health authenticates, so this is the one place
                # to refuse what PostgreSQL cannot compare (SQLite would just not match).
                raise BadRequest("the request path contains a NUL byte")
            scope[_PRINCIPAL] = await self.authenticate(
                _bearer(scope), self.limiter, self.refusals.outage
            )
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            raise BodyTooLarge(
                f"the request body ({length} bytes) is over the cap of {self.max_body_bytes}",
                max_body_bytes=self.max_body_bytes,
            )

    async def _direct(
        self,
        route: Route[Any],
        call: Callable[[dict[str, Any]], Response],
        scope: Scope,
        receive: Receive,
    ) -> Response:
        """An agent's hot route (`DIRECT_ROUTES`) without FastAPI's routing, dependency
        solving and middleware layers: about half of poold's CPU per lease request was
        there. The same `call` the bound endpoint runs (`_threaded`), in the same
        limiter; the same refusals for the same errors."""
        try:
            principal_ = scope.get(_PRINCIPAL)
            if not isinstance(principal_, Principal):
                raise Unauthorized("missing bearer token")
            if route.auth == "agent" and principal_.host is None:
                raise Forbidden("this needs an agent credential")
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            kwargs = {"p": principal_, _RAW_BODY: b"".join(chunks)}
            return await anyio.to_thread.run_sync(call, kwargs, limiter=self.limiter)
        except PoolError as err:
            return self.refusals.response(err)
        except RequestValidationError as err:
            return _invalid(self.refusals, err)

    def _route_of(self, scope: Scope) -> Route[Any] | None:
        """The table's route a request is for; None for a 404 or 405 (nothing reads its body)."""
        key = (scope.get("method", ""), scope["path"])
        known = self._static.get(key)
        if known is not None:
            return known
        for route in self.router.routes:
            match, _child = route.matches(scope)
            if match is Match.FULL:
                found = ROUTES.get(getattr(route, "name", ""))
                if found is not None and "{" not in found.path:
                    self._static[key] = found
                return found
        return None

    def _counted(self, receive: Receive) -> Receive:
        seen = 0
        cap = self.max_body_bytes

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise BodyTooLarge(
                        f"the request body is over the cap of {cap} bytes", max_body_bytes=cap
                    )
            return message

        return counted


class _Binder:
    """Binds handlers to the routes of `poold.wire.routes`, by name (subiquity's `bind`).

    A handler that touches the ledger is a plain `def`; the binder wraps it so that
    the body is parsed, the ledger called and the reply rendered to bytes in one
    worker thread, under a limiter as wide as the connection pool: the event loop
    only moves bytes, so a 100,000-item heartbeat does not stall /v1/health. Only
    routes of auth "none" (health, metrics: no ledger) and the long polls of
    `ASYNC_ROUTES` (which wait on the event loop, not in a worker) may have `async def`
    handlers.
    """

    def __init__(self, app: FastAPI, limiter: anyio.CapacityLimiter, outage: _Outage) -> None:
        self.app = app
        self.limiter = limiter
        self.outage = outage
        self.bound: set[str] = set()
        # What `_Gate` runs itself for `DIRECT_ROUTES`: the threaded endpoint's call.
        self.direct: dict[str, Callable[[dict[str, Any]], Response]] = {}

    def __call__(self, fn: F) -> F:
        route = ROUTES.get(fn.__name__)
        if route is None:
            raise RuntimeError(f"handler {fn.__name__} has no route in poold.wire.routes")
        body_param = _check_body(route, fn)
        if inspect.iscoroutinefunction(fn):
            if route.auth != "none" and route.name not in ASYNC_ROUTES:
                raise RuntimeError(
                    f"handler {fn.__name__} is async: ledger work runs in worker threads"
                )
            self.app.add_api_route(
                route.path,
                fn,
                methods=[route.method],
                status_code=route.status_code,
                dependencies=_AUTH[route.auth],
                name=route.name,
            )
        else:
            endpoint = _threaded(route, fn, body_param, self.limiter, self.outage)
            if route.name in DIRECT_ROUTES:
                params = set(inspect.signature(fn).parameters) - {body_param}
                if params != {"p"} or "{" in route.path:
                    raise RuntimeError(f"direct route {route.name} takes more than its body and p")
                self.direct[route.name] = endpoint.poold_call  # type: ignore[attr-defined]
            self.app.add_api_route(
                route.path,
                endpoint,
                methods=[route.method],
                status_code=route.status_code,
                dependencies=_AUTH[route.auth],
                name=route.name,
                response_model=None,  # rendered in the worker thread (`_threaded`)
            )
        self.bound.add(route.name)
        return fn

    def check_complete(self) -> None:
        missing = [name for name in ROUTES if name not in self.bound]
        if missing:
            raise RuntimeError(f"routes without a handler: {', '.join(missing)}")


def _check_body(route: Route[Any], fn: Callable[..., Any]) -> str | None:
    """A handler's body parameter is the model the route table names, or none at all.

    Returns that parameter's name: the binder parses the body into it with the
    table's model, so the handler's annotation and what it receives cannot differ.
    """
    hints = typing.get_type_hints(fn, include_extras=True)
    models = set()
    body_param = None
    for name in inspect.signature(fn).parameters:
        hint = hints.get(name)
        for tp in (hint, *typing.get_args(hint)):
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                if route.query is not None and tp is route.query:
                    continue
                models.add(tp)
                body_param = name
    expected = {route.body} if route.body is not None else set()
    if models != expected:
        raise RuntimeError(f"handler {fn.__name__} takes {models}, its route says {expected}")
    return body_param


def _parse_body(route: Route[Any], raw: bytes) -> BaseModel | None:
    """The body as the route's model, with FastAPI's error shape (a `body` location)."""
    assert route.body is not None
    if route.body_optional and not raw.strip():
        return None  # older clients send no body: the handler applies the defaults
    try:
        return route.body.model_validate_json(raw)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


# One INFO line per administrative change, whatever the route (poold.logs says why);
# these ledger operations log their own outcome (what ended, what was removed) instead.
admin_log = logging.getLogger("poold.admin")
_CHANGES_LOGGED_BY_THE_LEDGER = frozenset({"end_lease", "delete_host"})


def _log_admin_change(route: Route[Any], kwargs: dict[str, Any]) -> None:
    """`admin: update_tenant name=llm-a {"quota_bytes": 68719476736}` after it succeeded."""
    if route.auth != "admin" or route.method == "GET":
        return
    if route.name in _CHANGES_LOGGED_BY_THE_LEDGER:
        return
    words = [f"{k}={v}" for k, v in kwargs.items() if f"{{{k}" in route.path]
    for value in kwargs.values():
        if isinstance(value, BaseModel):
            words.append(value.model_dump_json(exclude_none=True)[:300])
    admin_log.info("admin: %s %s", route.name, " ".join(words))


def _threaded(
    route: Route[Any],
    fn: Callable[..., Any],
    body_param: str | None,
    limiter: anyio.CapacityLimiter,
    outage: _Outage,
) -> Callable[..., Awaitable[Response]]:
    """`fn` as an endpoint: body parsing, the ledger call and rendering in a worker thread."""
    hints = typing.get_type_hints(fn, include_extras=True)
    # Keyword-only throughout: FastAPI matches by name, and the order of defaults is free.
    params = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(fn).parameters.values()
        if p.name != body_param
    ]
    if body_param is not None:
        params.append(
            inspect.Parameter(_RAW_BODY, inspect.Parameter.KEYWORD_ONLY, annotation=RawBody)
        )
    adapter: TypeAdapter[Any] | None = (
        TypeAdapter(route.response) if route.response is not None else None
    )

    def call(kwargs: dict[str, Any]) -> Response:
        if body_param is not None:
            kwargs[body_param] = _parse_body(route, kwargs.pop(_RAW_BODY))
        value = fn(**kwargs)
        outage.reachable()
        _log_admin_change(route, kwargs)
        if isinstance(value, Response):
            return value
        assert adapter is not None, f"{route.name} returns no body"
        return Response(
            adapter.dump_json(value), status_code=route.status_code, media_type="application/json"
        )

    async def endpoint(**kwargs: Any) -> Response:
        return await anyio.to_thread.run_sync(call, kwargs, limiter=limiter)

    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)  # type: ignore[attr-defined]
    endpoint.poold_call = call  # type: ignore[attr-defined]
    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint


def create_app(
    ledger: Ledger, admin_token: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    # /docs and /redoc are FastAPI's pages: they load Swagger UI and ReDoc from a CDN, so
    # they render only where the browser reaches it; /openapi.json is whole without it.
    app = FastAPI(
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
    refusals = _Refusals(pool_metrics.registry)
    limiter = anyio.CapacityLimiter(worker_threads(ledger))
    ledger.listen_for_news()  # other poolds' news for the agents waiting here (PostgreSQL)
    app.state.limiter = limiter
    bind = _Binder(app, limiter, refusals.outage)
    app.add_middleware(
        _Gate,
        router=app.router,
        authenticate=_Authenticator(ledger, admin_token, app.state.auth_cache),
        refusals=refusals,
        limiter=limiter,
        max_body_bytes=max_body_bytes,
        metrics=pool_metrics,
        direct=bind.direct,  # filled as the handlers below are bound
    )

    @app.exception_handler(PoolError)
    async def _pool_error(_req: Request, err: PoolError) -> JSONResponse:
        return refusals.response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_req: Request, err: RequestValidationError) -> JSONResponse:
        return _invalid(refusals, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            return _error(NotFound(f"no such endpoint: {err.detail}"))
        body = {
            "code": "bad_request" if err.status_code < 500 else "internal",
            "message": str(err.detail),
        }
        return JSONResponse(body, status_code=err.status_code)

    # No handler for Exception: Starlette would register it in ServerErrorMiddleware,
    # which re-raises after answering. `_Gate` answers unexpected exceptions instead.

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
            ledger, name, change, p.actor, on_quota_change=delegation.claw_back
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
        out = admin_ops.delete_host(ledger, name, p.actor, force=q.force)
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
                lambda: leases.host_id_of(ledger, host), limiter=limiter
            )
        news, token = await ledger.news.wait(host_id, body.since, body.timeout_s)
        return News(news=news, token=token)

    @bind
    def apply_ops(body: AgentOps, p: Caller) -> list[LeaseOpResult]:
        return leases.apply_ops(ledger, _host_of(p), body.ops, p.actor, request_id=body.request_id)

    @bind
    def confirm_revoked(body: RevokedConfirm, p: Caller) -> list[LeaseOpResult]:
        return admin_ops.confirm_revoked(ledger, _host_of(p), body.lease_ids, p.actor)

    @bind
    def delegate(body: DelegationRequest, p: Caller) -> Delegation:
        return delegation.delegate(ledger, _host_of(p), body, p.actor, delegation_policy())

    # --- leases ----------------------------------------------------------
    @bind
    def grant(req: GrantRequest, p: Caller) -> LeaseOut:
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

    # --- drain (poold/ledger/admin_ops.py) ----------------------------------
    @bind
    def drain_device(uid: str, body: DeviceDrainRequest, p: Caller) -> DrainResult:
        return admin_ops.drain_device(
            ledger,
            uid,
            p.actor,
            deadline_s=body.deadline_s,
            now_=body.now,
            revoke_deadline_s=policy().revoke_deadline_s,
        )

    @bind
    def undrain_device(uid: str, p: Caller) -> DrainResult:
        return admin_ops.undrain_device(ledger, uid, p.actor)

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
    def undrain_host(name: str, p: Caller) -> DrainResult:
        return admin_ops.drain_host(ledger, name, p.actor, draining=False)

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
