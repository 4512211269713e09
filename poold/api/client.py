"""How poolctl and the agent call poold: a typed httpx client over `poold.wire.routes`.

Each method is one route of the table, under the route's name; paths, methods,
bodies and response types come from the table, never from here. Errors come back
as the `PoolError` subclass the server raised (matched by code); a poold that
cannot be reached is `poold_unreachable`, and so is a URL where something else
answers (a reply that is not poold's, whatever the route: `not_poold`).

Several poold URLs (DESIGN.md "Scale": processes sharing one database) make one
client. A call goes to the URL that answered last (sticky); a transport error
moves it to the next, and when none answers the next call starts one further on,
so a dead poold is not asked first forever. An HTTP answer, whatever its status,
is poold's answer and is not retried elsewhere, with one exception: 503
``ledger_unavailable`` is tried once on the next URL (the other process may still
hold good database connections), never more, since they share the database and
hammering it helps nobody. A request that may have reached a poold (the reply was
lost or timed out) is sent again elsewhere only when repeating it is harmless:
reads, heartbeats, renewals, and grants and op batches that carry a request id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from poold.errors import LedgerUnavailable, PooldUnreachable, PoolError, from_wire
from poold.wire import routes
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
    LeaseOp,
    LeaseOpResult,
    News,
    NewsWait,
    RenewRequest,
    RevokedConfirm,
)
from poold.wire.common import EndRequest, LeaseOut
from poold.wire.delegation import Delegation, DelegationRequest
from poold.wire.routes import AccountingQuery, AuditQuery, HostDeleteQuery, LeaseQuery, Route

R = TypeVar("R")

log = logging.getLogger("poold.client")

AUDIT_TIMEOUT_S = 600.0  # an audit of a large ledger takes seconds, not the default 10

# Routes that change nothing when repeated, so a request that may have reached one
# poold is sent again to another: a heartbeat (or registration) and a renewal set the
# same state from a later now. Reads are replayable by their method; grants and op
# batches only when they name themselves with a request id (see `_replayable`).
_REPLAYABLE_ROUTES = frozenset({"register", "heartbeat", "renew", "wait_news", "activate"})

# Transport errors raised before the request left this process: no poold saw it, so
# any request may go to the next URL.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _replayable(route: Route[Any], body: BaseModel | None) -> bool:
    """May this request be sent again to another poold after a reply that never came?"""
    if route.method == "GET" or route.name in _REPLAYABLE_ROUTES:
        return True
    # A repeated request id gets the first answer (poold remembers recent ids per host).
    return body is not None and getattr(body, "request_id", None) is not None


def not_poold(
    base_url: str, resp: httpx.Response, request: str, invalid: ValidationError | None = None
) -> PooldUnreachable:
    """A reply that is not poold's: whoever answers at `base_url` is not poold (for us).

    `poold_unreachable`, since poold is not reached there: a wrong --url or POOLD_URL
    (an agent's metrics port, another web server) is the usual cause.
    """
    ctype = resp.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    what = f"HTTP {resp.status_code} {ctype}"
    if invalid is not None and ctype == "application/json":
        what += " of another shape (another version of poold?)"
    return PooldUnreachable(
        f"{base_url} does not answer as poold: {what} to {request}",
        url=base_url,
        status=resp.status_code,
        content_type=ctype,
    )


def failover_order(count: int, current: int) -> list[int]:
    """The URL indices one call tries: the sticky one first, then the rest in turn."""
    return [(current + k) % count for k in range(count)]


class PooldClient:
    """One caller's connection to poold: one URL, or several poold processes in turn."""

    def __init__(
        self, base_url: str | Sequence[str], token: str, *, timeout_s: float = 10.0
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("PooldClient needs at least one poold URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self._https = [
            httpx.Client(
                base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=timeout_s
            )
            for url in self.urls
        ]
        self._lock = threading.Lock()
        self._current = 0  # the URL that answered last: every call tries it first

    @property
    def base_url(self) -> str:
        """The poold URL calls go to first now (the one that answered last)."""
        return self.urls[self._current]

    def close(self) -> None:
        for http in self._https:
            http.close()

    def __enter__(self) -> PooldClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _stick(self, index: int) -> None:
        with self._lock:
            before, self._current = self._current, index
        if before != index:
            log.info("calls go to poold at %s now (was %s)", self.urls[index], self.urls[before])

    def _send(
        self,
        route: Route[R],
        body: BaseModel | None = None,
        query: BaseModel | None = None,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        **path: str,
    ) -> R:
        """One call of `route`: its path filled in, `body` as JSON, `query` as parameters.

        ``deadline`` (time.monotonic()) bounds the whole call, failovers included.
        """
        replayable = _replayable(route, body)
        url = route.url(**path)
        params = query.model_dump(mode="json", exclude_none=True) if query else None
        content = body.model_dump_json() if body is not None else None
        headers = {"content-type": "application/json"} if body is not None else None
        order = failover_order(len(self.urls), self._current)
        unreachable: list[str] = []
        busy_ledger: PoolError | None = None  # a 503 ledger_unavailable already seen
        for index in order:
            timeout = timeout_s if timeout_s is not None else self.timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    break
            try:
                resp = self._https[index].request(
                    route.method,
                    url,
                    params=params,
                    content=content,
                    headers=headers,
                    timeout=timeout,
                )
            except httpx.TransportError as exc:
                unreachable.append(f"{self.urls[index]}: {exc or type(exc).__name__}")
                if busy_ledger is not None:
                    break  # the one try past a ledger_unavailable is spent
                if not replayable and not isinstance(exc, _NEVER_SENT):
                    # It may have been applied there: repeating it elsewhere could do it twice.
                    break
                continue
            error = self._error(resp, self.urls[index])
            if isinstance(error, LedgerUnavailable) and busy_ledger is None and index != order[-1]:
                busy_ledger = error  # one other poold, once: they share the database
                continue
            self._stick(index)
            if error is not None:
                raise error
            if route.response is str:
                return resp.text  # type: ignore[return-value]  # R is str for a text route
            try:
                return route.parse_json(resp.content)
            except ValidationError as exc:
                # Not poold's reply (another program at that URL, or another version of
                # poold): said as such, never as pydantic's text under bad_request.
                raise not_poold(self.urls[index], resp, f"{route.method} {url}", exc) from None
        if busy_ledger is not None:
            raise busy_ledger
        if len(self.urls) > 1 and unreachable:
            # Nobody answered: the next call starts one further on, so a dead poold is
            # not the first one asked forever.
            with self._lock:
                self._current = (order[0] + 1) % len(self.urls)
        where = "; ".join(unreachable) or "no time left to try"
        raise PooldUnreachable(f"cannot reach poold at {where}")

    @staticmethod
    def _error(resp: httpx.Response, base_url: str) -> PoolError | None:
        """The PoolError an HTTP answer carries (None for a success).

        poold refuses with a JSON ``{"code", "message"}`` body; any other error answer
        comes from something else at that URL (a proxy, another program): `not_poold`.
        """
        if resp.status_code < 400:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("code"), str):
            detail = data.get("detail")
            return from_wire(
                data["code"],
                str(data.get("message", "")),
                detail if isinstance(detail, dict) else None,
            )
        return not_poold(base_url, resp, f"{resp.request.method} {resp.request.url.path}")

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

    def delete_host(self, name: str, *, force: bool = False) -> HostDeleted:
        """Delete a host (`host_busy` while it holds live leases, unless ``force``)."""
        return self._send(routes.delete_host, query=HostDeleteQuery(force=force), name=name)

    def register(self, beat: Heartbeat) -> HeartbeatReply:
        return self._send(routes.register, beat)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        return self._send(routes.heartbeat, beat)

    def wait_news(self, since: str | None = None, timeout_s: float = 25.0) -> News:
        """Wait (a long poll) until poold has news for this host or ``timeout_s`` passes."""
        return self._send(
            routes.wait_news,
            NewsWait(since=since, timeout_s=timeout_s),
            timeout_s=timeout_s + self.timeout_s,
        )

    def apply_ops(
        self, ops: list[LeaseOp], *, request_id: str | None = None
    ) -> list[LeaseOpResult]:
        """One op batch; with a ``request_id`` a retry of it gets the first answer."""
        return self._send(routes.apply_ops, AgentOps(ops=ops, request_id=request_id))

    def confirm_revoked(self, lease_ids: list[str]) -> list[LeaseOpResult]:
        """The agent's side: these revoked leases are torn down (revoking → reclaimed)."""
        return self._send(routes.confirm_revoked, RevokedConfirm(lease_ids=lease_ids))

    def delegate(self, req: DelegationRequest) -> Delegation:
        """Refill or give back the host's delegation; what it holds now."""
        return self._send(routes.delegate, req)

    # leases
    def grant(self, req: GrantRequest, *, deadline: float | None = None) -> GrantReply:
        """A central grant; ``deadline`` (time.monotonic()) bounds it, failovers included."""
        return self._send(routes.grant, req, deadline=deadline)

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

    def end_lease(self, lease_id: str, reason: str = "ended by administrator") -> LeaseEnded:
        """End a lease at once, whatever its live state (poold/ledger/admin_ops.end_lease)."""
        return self._send(routes.end_lease, LeaseEndRequest(reason=reason), lease_id=lease_id)

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

    # which hosts may report a device
    def allow_device_host(self, uid: str, host: str) -> DeviceHosts:
        return self._send(routes.allow_device_host, uid=uid, host=host)

    def disallow_device_host(self, uid: str, host: str) -> DeviceHosts:
        return self._send(routes.disallow_device_host, uid=uid, host=host)

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
