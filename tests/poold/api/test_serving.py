"""How poold serves: ledger work off the event loop, 500s that keep the connection, the gate.

The gate (poold/api/gate.py `Gate`) authenticates from the headers and caps the body
before FastAPI reads it; these tests use a real uvicorn on loopback, as the API tests do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.pool import QueuePool

from poold.api import binding, gate
from poold.api.app import create_app, worker_threads
from poold.errors import LedgerUnavailable
from poold.ledger import heartbeat as ledger_heartbeat
from poold.ledger import tenants
from poold.ledger.db import Ledger
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.api.conftest import Agent, Raw

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _client_addr(resp: httpx.Response) -> Any:
    """The local address of the connection that carried `resp` (one per TCP connection)."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")


def test_a_500_keeps_the_keep_alive_connection(
    raw: Raw, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_ledger: Ledger) -> Any:
        raise RuntimeError("a bug in the ledger")

    monkeypatch.setattr(tenants, "list_tenants", broken)
    caplog.set_level(logging.DEBUG, logger="poold.api")
    first = raw.request("GET", "/v1/tenants")
    assert first.status_code == 500
    assert first.json()["code"] == "internal"
    again = raw.request("GET", "/v1/tenants")
    assert again.status_code == 500
    ok = raw.request("GET", "/v1/health")
    assert ok.status_code == 200
    # One connection carried all three: the 500s did not make uvicorn drop it.
    assert _client_addr(first) == _client_addr(again) == _client_addr(ok)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, [r.getMessage() for r in errors]
    assert all("RuntimeError" in r.getMessage() for r in errors)
    # The traceback once per type per minute: the second line carries none.
    assert errors[0].exc_info is not None and errors[1].exc_info is None


def test_ledger_unavailable_is_503_with_retry_after_and_logged_once_per_outage(
    raw: Raw, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = tenants.list_tenants
    down = True

    def flaky(ledger: Ledger) -> Any:
        if down:
            raise LedgerUnavailable("connection refused")
        return real(ledger)

    monkeypatch.setattr(tenants, "list_tenants", flaky)
    caplog.set_level(logging.INFO, logger="poold.api")
    for _ in range(3):
        resp = raw.request("GET", "/v1/tenants")
        assert resp.status_code == 503
        assert resp.json()["code"] == "ledger_unavailable"
        assert int(resp.headers["retry-after"]) >= 1
    down = False
    assert raw.request("GET", "/v1/tenants").status_code == 200
    assert raw.request("GET", "/v1/tenants").status_code == 200
    lines = [r for r in caplog.records if r.name == "poold.api"]
    warnings = [r for r in lines if r.levelno == logging.WARNING]
    recovered = [r for r in lines if "reachable again" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in lines]
    assert len(recovered) == 1 and recovered[0].levelno == logging.INFO
    assert "3 request(s)" in recovered[0].getMessage()


def test_health_answers_while_every_worker_is_busy_in_the_ledger(
    agent: Agent, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heartbeats stuck in the ledger hold worker threads, never the event loop."""
    inside = threading.Semaphore(0)
    release = threading.Event()
    real = ledger_heartbeat.receive_heartbeat

    def slow(*args: Any, **kwargs: Any) -> Any:
        inside.release()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger_heartbeat, "receive_heartbeat", slow)
    url = str(raw.http.base_url)
    headers = {"authorization": f"Bearer {agent.credential}"}
    beats = [
        threading.Thread(
            target=httpx.post,
            args=(f"{url}/v1/agent/heartbeat",),
            kwargs={"json": {"renewals": []}, "headers": headers, "timeout": 30},
        )
        for _ in range(4)
    ]
    for t in beats:
        t.start()
    try:
        for _ in beats:
            assert inside.acquire(timeout=10), "the heartbeats never reached the ledger"
        # Four requests are inside the ledger at once (one at a time before), and the
        # loop is free: health and a request that needs no ledger both answer.
        assert raw.request("GET", "/v1/health", token=None).status_code == 200
        assert raw.request("GET", "/v1/status", token="wrong").status_code == 401
    finally:
        release.set()
        for t in beats:
            t.join(30)


def test_health_answers_during_a_100000_item_heartbeat(agent: Agent, raw: Raw) -> None:
    """The big body is parsed, applied and its reply rendered off the loop."""
    items = [{"lease_id": f"unknown-{i:06d}", "ttl_s": 60} for i in range(100_000)]
    done = threading.Event()
    reply: list[httpx.Response] = []

    def beat() -> None:
        try:
            reply.append(
                httpx.post(
                    f"{raw.http.base_url}/v1/agent/heartbeat",
                    json={"renewals": items},
                    headers={"authorization": f"Bearer {agent.credential}"},
                    timeout=300,
                )
            )
        finally:
            done.set()

    t = threading.Thread(target=beat)
    t.start()
    answered_during = 0
    with httpx.Client(base_url=str(raw.http.base_url), timeout=60) as health:
        while not done.is_set():
            if health.get("/v1/health").status_code == 200 and not done.is_set():
                answered_during += 1
            done.wait(0.02)
    t.join()
    assert reply and reply[0].status_code == 200, reply
    assert len(reply[0].json()["renewed"]) == 100_000
    # Before, the loop was held for the whole heartbeat: no health answer in between.
    # A count, not a latency: a loaded machine slows both sides alike.
    assert answered_during >= 3


# --- the gate: authentication and the body cap before the body is read ----------------


@pytest.fixture
def capped(ledger: Ledger) -> Iterator[ThreadedServer]:
    """An API whose body cap is 64 KiB."""
    server = ThreadedServer(ledger)
    server.server.config.app = create_app(ledger, ADMIN_TOKEN, max_body_bytes=64 * 1024)
    with server:
        yield server


def test_unauthenticated_body_is_refused_before_it_is_parsed(raw: Raw) -> None:
    # Not JSON at all: a 401, not a 400, because the body was never looked at.
    for token in (None, "pa1.nobody.forged"):
        resp = raw.request("POST", "/v1/leases", token=token, content=b"{not json" * 1000)
        assert resp.status_code == 401, resp.text
        assert resp.json()["code"] == "unauthorized"
    # A NUL in the path is still refused before authentication is looked up.
    assert raw.request("GET", "/v1/leases/a%00b").json()["code"] == "bad_request"


def test_body_over_the_cap_is_413(capped: ThreadedServer, agent: Agent) -> None:
    big = b'{"renewals": [' + b" " * (80 * 1024) + b"]}"
    with httpx.Client(base_url=capped.url, timeout=30) as http:
        resp = http.post("/v1/tenants", content=big, headers=ADMIN)
        assert resp.status_code == 413, resp.text
        assert resp.json()["code"] == "body_too_large"
        assert resp.json()["detail"] == {"max_body_bytes": 64 * 1024}

        # Chunked, no Content-Length: counted as it arrives and stopped at the cap.
        def chunks() -> Iterator[bytes]:
            for _ in range(20):
                yield b" " * 8192

        resp = http.post("/v1/tenants", content=chunks(), headers=ADMIN)
        assert resp.status_code == 413, resp.text
        assert resp.json()["code"] == "body_too_large"
        # Under the cap, everything as before, on the same server.
        resp = http.post(
            "/v1/tenants", json={"name": "capped", "quota_bytes": 1 << 20}, headers=ADMIN
        )
        assert resp.status_code == 201, resp.text
        assert http.get("/v1/health").status_code == 200


def test_unauthenticated_oversized_body_is_401(capped: ThreadedServer) -> None:
    with httpx.Client(base_url=capped.url, timeout=30) as http:
        resp = http.post("/v1/leases", content=b" " * (1 << 20))
        assert resp.status_code == 401
        assert resp.json()["code"] == "unauthorized"


def test_worker_threads_match_the_connection_pool(ledger: Ledger) -> None:
    pool = ledger.engine.pool
    assert isinstance(pool, QueuePool)
    assert worker_threads(ledger) == pool.size() + 10  # SQLAlchemy's default overflow
    small = Ledger(ledger.url, pool_size=2, max_overflow=1)
    try:
        assert worker_threads(small) == 3
    finally:
        small.dispose()


def test_async_handler_for_a_ledger_route_is_refused(ledger: Ledger) -> None:
    app = create_app(ledger, ADMIN_TOKEN)
    binder = binding.Binder(app, app.state.limiter, gate.Outage())

    async def list_tenants() -> list[Any]:
        return []

    with pytest.raises(RuntimeError, match="async"):
        binder(list_tenants)
