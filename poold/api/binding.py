"""Handlers bound to the routes of `poold.wire.routes` by name (subiquity's `bind`): each
handler's body parameter checked against the table, the body parsed, the ledger called
and the reply rendered in one worker thread, under a limiter as wide as the pool.
"""

from __future__ import annotations

import inspect
import logging
import time
import typing
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter

from poold.api import sliced
from poold.api.gate import AUTH_DEPENDENCIES, Outage, Principal
from poold.wire.routes import (
    ROUTES,
    Route,
)

log = logging.getLogger("poold.api")

F = TypeVar("F", bound=Callable[..., Any])


# Authenticated routes whose handlers are `async def`: they wait (a long poll) and do
# no ledger work on the event loop.
ASYNC_ROUTES = frozenset({"wait_news"})
# The agent's per-lease routes, which `Gate` serves itself (`Gate._direct`): a body,
# the caller, one ledger call, no path or query parameters.
DIRECT_ROUTES = frozenset({"grant", "apply_ops"})


async def _read_body(request: Request) -> bytes:
    """The raw body, read on the event loop (cheap); parsing it is the worker thread's job."""
    return await request.body()


RawBody = Annotated[bytes, Depends(_read_body)]
_RAW_BODY = "raw_body"


class Binder:
    """Binds handlers to the routes of `poold.wire.routes`, by name (subiquity's `bind`).

    A handler that touches the ledger is a plain `def`; the binder wraps it so that
    the body is parsed, the ledger called and the reply rendered to bytes in one
    worker thread, under a limiter as wide as the connection pool: the event loop
    only moves bytes, so a 100,000-item heartbeat does not stall /v1/health. Only
    routes of auth "none" (health, metrics: no ledger) and the long polls of
    `ASYNC_ROUTES` (which wait on the event loop, not in a worker) may have `async def`
    handlers.
    """

    def __init__(
        self,
        app: FastAPI,
        limiter: anyio.CapacityLimiter,
        outage: Outage,
        on_cpu: Callable[[str, float], None] | None = None,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.outage = outage
        self.on_cpu = on_cpu  # each threaded request's worker CPU, by route name
        self.bound: set[str] = set()
        # What `Gate` runs itself for `DIRECT_ROUTES`: the threaded endpoint's call.
        self.direct: dict[str, Callable[[Principal, bytes], Response]] = {}

    def __call__(self, fn: F) -> F:
        route = ROUTES.get(fn.__name__)
        if route is None:
            raise RuntimeError(f"handler {fn.__name__} has no route in poold.wire.routes")
        body_param = _check_body(route, fn)
        endpoint: Callable[..., Any] = fn
        extra: dict[str, Any] = {}
        if inspect.iscoroutinefunction(fn):
            if route.auth != "none" and route.name not in ASYNC_ROUTES:
                raise RuntimeError(
                    f"handler {fn.__name__} is async: ledger work runs in worker threads"
                )
        else:
            endpoint = _threaded(route, fn, body_param, self.limiter, self.outage, self.on_cpu)
            extra["response_model"] = None  # rendered in the worker thread (`_threaded`)
            if route.name in DIRECT_ROUTES:
                params = set(inspect.signature(fn).parameters) - {body_param}
                if params != {"p"} or "{" in route.path:
                    raise RuntimeError(f"direct route {route.name} takes more than its body and p")
                self.direct[route.name] = _direct_call(endpoint.poold_call)  # type: ignore[attr-defined]
        self.app.add_api_route(
            route.path,
            endpoint,
            methods=[route.method],
            status_code=route.status_code,
            dependencies=AUTH_DEPENDENCIES[route.auth],
            name=route.name,
            **extra,
        )
        self.bound.add(route.name)
        return fn

    def check_complete(self) -> None:
        missing = [name for name in ROUTES if name not in self.bound]
        if missing:
            raise RuntimeError(f"routes without a handler: {', '.join(missing)}")


def _direct_call(
    call: Callable[[dict[str, Any]], Response],
) -> Callable[[Principal, bytes], Response]:
    """The threaded endpoint's call as `Gate` runs it for a direct route: the caller, the body."""

    def direct(p: Principal, raw: bytes) -> Response:
        return call({"p": p, _RAW_BODY: raw})

    return direct


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
        return sliced.validate_json(route.body, raw)
    except sliced.BodyInvalid as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors]
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
    outage: Outage,
    on_cpu: Callable[[str, float], None] | None = None,
) -> Callable[..., Awaitable[Response]]:
    """`fn` as an endpoint: body parsing, the ledger call and rendering in a worker thread
    (whose CPU time, refusals included, goes to ``on_cpu``)."""
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
        start = time.thread_time()
        try:
            return work(kwargs)
        finally:
            if on_cpu is not None:
                on_cpu(route.name, time.thread_time() - start)

    def work(kwargs: dict[str, Any]) -> Response:
        if body_param is not None:
            kwargs[body_param] = _parse_body(route, kwargs.pop(_RAW_BODY))
        value = fn(**kwargs)
        outage.reachable()
        _log_admin_change(route, kwargs)
        if isinstance(value, Response):
            return value
        assert adapter is not None, f"{route.name} returns no body"
        return Response(
            sliced.dump_json(adapter, value),
            status_code=route.status_code,
            media_type="application/json",
        )

    async def endpoint(**kwargs: Any) -> Response:
        return await anyio.to_thread.run_sync(call, kwargs, limiter=limiter)

    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)  # type: ignore[attr-defined]
    endpoint.poold_call = call  # type: ignore[attr-defined]
    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint
