"""What every request of poold's API passes before a handler: who is calling, whether the
body may be read, and how a refusal or a crash leaves (DESIGN.md "Scale"; STYLE.md, errors
carry stable codes).

`Gate` is pure ASGI around FastAPI: it authenticates from the headers before any byte of
the body is read, caps the body, serves the agent's hot routes itself and answers an
unexpected exception 500 without dropping the connection. `Refusals` counts and logs
every `PoolError` that leaves; `Outage` logs a ledger outage once, not per request.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poold.api.metrics import UNMATCHED_ROUTE, PooldMetrics
from poold.errors import (
    BadRequest,
    BodyTooLarge,
    Forbidden,
    InvalidSize,
    LedgerUnavailable,
    PoolError,
    Unauthorized,
)
from poold.ledger import hosts
from poold.ledger.db import Ledger
from poold.logs import RefusalLog
from poold.wire.routes import (
    ROUTES,
    Auth,
    Route,
)

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
# DEFAULT_MAX_BODY_BYTES (poold.settings, 48 MiB): the biggest legitimate request is the
# heartbeat of a host holding 100,000 leases: 100,000 renewals, reports and held leases
# (one holder each) are 41.6 MB of JSON (the renewals alone 6.3 MB). The cap is a little
# above; a bigger body is refused from its Content-Length, or as soon as a chunked one
# passes the cap.
# Requests doing ledger work at once when the engine's pool sets no bound (NullPool).
RETRY_AFTER_S = 1  # what a 503 ledger_unavailable tells the caller to wait
CRASH_TRACEBACK_EVERY_S = 60.0

# Where the gate leaves the authenticated caller for the `principal` dependency.
_PRINCIPAL = "poold.principal"


async def principal(request: Request) -> Principal:
    """The caller `Gate` authenticated before any byte of the body was read."""
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


AUTH_DEPENDENCIES: dict[Auth, list[Any]] = {
    "none": [],
    "admin": [Depends(_admin)],
    "agent": [Depends(_agent)],
    "any": [Depends(principal)],
}


def error_response(err: PoolError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.http_status, headers=headers)


def invalid_response(refusals: Refusals, err: RequestValidationError) -> JSONResponse:
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
    return error_response(cls(f"invalid request: {problems}"))


class Outage:
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


def _caller(scope: Scope | None) -> str:
    """Who a refusal was for, as a log reads it: the host, the administrator, or (not
    authenticated) the address it came from."""
    if scope is None:
        return "?"
    found = scope.get(_PRINCIPAL)
    if isinstance(found, Principal):
        return "admin" if found.admin else f"host {found.host}"
    client = scope.get("client")
    return f"from {client[0]}" if client else "?"


class Refusals:
    """How a `PoolError` leaves: counted by code, logged (an outage once, a caller's
    repeated refusal once per minute: `RefusalLog`), with its status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = Counter(
            "poold_api_errors_total", "API errors by code", ["code"], registry=registry
        )
        for code in ("internal", "ledger_unavailable"):  # alerts see them from the start, at 0
            self.total.labels(code)
        self.outage = Outage()
        self._tracebacks: dict[str, float] = {}  # exception type -> when one was last logged
        self.log = RefusalLog(log)

    def response(self, err: PoolError, scope: Scope | None = None) -> JSONResponse:
        self.total.labels(err.code).inc()
        if isinstance(err, LedgerUnavailable):
            self.outage.failed(err)
            return error_response(err, {"Retry-After": str(RETRY_AFTER_S)})
        self.log.refused(err, _caller(scope))
        return error_response(err)

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


class Authenticator:
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
        self, token: str, limiter: anyio.CapacityLimiter, outage: Outage
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


# The table's routes without path parameters, by (method, path).
_STATIC_ROUTES: dict[tuple[str, str], Route[Any]] = {
    (route.method, route.path): route for route in ROUTES.values() if "{" not in route.path
}


class Gate:
    """What every request passes before FastAPI reads a byte of its body, and the net under it.

    Pure ASGI, just inside Starlette's ServerErrorMiddleware, and in front of all of
    FastAPI for the routes it serves itself (poold/api/app.py `PooldApp`): (1) for a
    route whose table `auth` is not "none", the bearer token is checked from the
    headers alone, so an unauthenticated body is never read (uvicorn discards what the
    client still sends, 64 KiB at a time); (2) a Content-Length past the cap is a 413
    unread, and a chunked body is counted and stopped at the cap; (3) an unexpected
    exception is answered 500 here, without re-raising: Starlette's
    ServerErrorMiddleware would re-raise it after answering, and uvicorn would then
    drop the keep-alive connection.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        router: APIRouter,
        authenticate: Authenticator,
        refusals: Refusals,
        limiter: anyio.CapacityLimiter,
        max_body_bytes: int,
        metrics: PooldMetrics,
        direct: dict[str, Callable[[Principal, bytes], Response]],
    ) -> None:
        self.app = app
        self.router = router
        self.authenticate = authenticate
        self.refusals = refusals
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.direct = direct

    def serves_directly(self, scope: Scope) -> bool:
        """Whether this request is for a route the gate serves itself (no FastAPI). Those
        have no path parameters, so the table answers by method and path alone: no
        request pays a scan of the routes for this question."""
        if scope["type"] != "http":
            return False
        route = _STATIC_ROUTES.get((scope.get("method", ""), scope["path"]))
        return route is not None and route.name in self.direct

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
                await self.refusals.response(err, scope)(scope, receive, send_tracked)
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
        call: Callable[[Principal, bytes], Response],
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
            return await anyio.to_thread.run_sync(
                call, principal_, b"".join(chunks), limiter=self.limiter
            )
        except PoolError as err:
            return self.refusals.response(err, scope)
        except RequestValidationError as err:
            return invalid_response(self.refusals, err)

    def _route_of(self, scope: Scope) -> Route[Any] | None:
        """The table's route a request is for; None for a 404 or 405 (nothing reads its body).

        A route without path parameters is found by method and path (`_STATIC_ROUTES`);
        only the others cost a scan of every route."""
        found = _STATIC_ROUTES.get((scope.get("method", ""), scope["path"]))
        if found is not None:
            return found
        for route in self.router.routes:
            match, _child = route.matches(scope)
            if match is Match.FULL:
                return ROUTES.get(getattr(route, "name", ""))
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
