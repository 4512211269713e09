"""Do the agent's per-lease routes, which `Gate` serves itself without FastAPI's routing
(poold/api/binding.py `DIRECT_ROUTES`), answer exactly as a bound route would?"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poold.api import binding, gate
from poold.ledger import leases
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.api.conftest import Agent
from tests.poold.conftest import GID, UID, MiB

GRANT = {"tenant": "t1", "size_bytes": 2 * MiB, "uid": UID, "gids": [GID], "pid": 1}


@pytest.fixture
def http(api: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=30) as client:
        yield client


def _post(
    http: httpx.Client, agent: Agent, path: str, body: Any, token: str | None = None
) -> httpx.Response:
    return http.post(
        path,
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={
            "authorization": f"Bearer {token or agent.credential}",
            "content-type": "application/json",
        },
    )


def test_the_hot_routes_are_served_by_the_gate(
    agent: Agent, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[str] = []
    direct = gate.Gate._direct

    async def counted(self: Any, route: Any, *args: Any) -> Any:
        served.append(route.name)
        return await direct(self, route, *args)

    monkeypatch.setattr(gate.Gate, "_direct", counted)
    assert _post(http, agent, "/v1/leases", GRANT).status_code == 201
    assert _post(http, agent, "/v1/agent/ops", {"ops": []}).status_code == 200
    assert http.get("/v1/health").status_code == 200
    assert served == ["grant", "apply_ops"]
    assert {"grant", "apply_ops"} == binding.DIRECT_ROUTES


def test_the_hot_routes_never_enter_fastapis_layers(
    agent: Agent, api: ThreadedServer, http: httpx.Client
) -> None:
    """Served in front of FastAPI (its body limit, telemetry, error middleware and the
    gate inside them): with FastAPI's whole stack broken, they still answer, and
    nothing else does."""
    app = api.server.config.app
    app.middleware_stack = None  # built at the next request that reaches FastAPI

    def broken() -> Any:
        raise RuntimeError("FastAPI's stack was entered")

    app.build_middleware_stack = broken
    assert _post(http, agent, "/v1/leases", GRANT).status_code == 201
    assert _post(http, agent, "/v1/agent/ops", {"ops": []}).status_code == 200
    assert http.get("/v1/health").status_code == 500  # uvicorn's answer to the raise


def test_grant_and_release_answer_as_before(agent: Agent, http: httpx.Client) -> None:
    resp = _post(http, agent, "/v1/leases", {**GRANT, "request_id": "r-1", "activate": True})
    assert resp.status_code == 201, resp.text
    lease = resp.json()
    assert lease["state"] == "active" and lease["length_bytes"] == 2 * MiB
    again = _post(http, agent, "/v1/leases", {**GRANT, "request_id": "r-1", "activate": True})
    assert again.status_code == 201 and again.json()["id"] == lease["id"]
    ops = _post(http, agent, "/v1/agent/ops", {"ops": [{"lease_id": lease["id"], "op": "release"}]})
    assert ops.status_code == 200, ops.text
    assert [(r["lease_id"], r["state"]) for r in ops.json()] == [(lease["id"], "released")]
    metrics = http.get("/metrics").text
    assert 'poold_http_requests_total{route="grant",status="201"} 2.0' in metrics
    assert 'poold_http_requests_total{route="apply_ops",status="200"} 1.0' in metrics


def test_a_chunked_body_is_read_whole(agent: Agent, http: httpx.Client) -> None:
    raw = json.dumps(GRANT).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    resp = http.post(
        "/v1/leases",
        content=chunks(),
        headers={"authorization": f"Bearer {agent.credential}"},
    )
    assert resp.status_code == 201, resp.text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({**GRANT, "size_bytes": 0}, 400, "invalid_size"),
        (b"{not json", 400, "bad_request"),
        ({**GRANT, "surprise": 1}, 400, "bad_request"),
        ({**GRANT, "tenant": "nobody"}, 404, "unknown_tenant"),
        ({**GRANT, "size_bytes": 1 << 40}, 507, "no_capacity"),
    ],
)
def test_refusals_keep_their_codes(
    agent: Agent, http: httpx.Client, body: Any, status: int, code: str
) -> None:
    resp = _post(http, agent, "/v1/leases", body)
    assert (resp.status_code, resp.json()["code"]) == (status, code), resp.text


def test_the_admin_token_may_not_grant(agent: Agent, http: httpx.Client) -> None:
    for path, body in (("/v1/leases", GRANT), ("/v1/agent/ops", {"ops": []})):
        resp = _post(http, agent, path, body, token=ADMIN_TOKEN)
        assert (resp.status_code, resp.json()["code"]) == (403, "forbidden"), resp.text


def test_a_crash_is_500_and_keeps_the_connection(
    agent: Agent, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any, **_kw: Any) -> Any:
        raise RuntimeError("a bug in the ledger")

    monkeypatch.setattr(leases, "grant", broken)
    first = _post(http, agent, "/v1/leases", GRANT)
    assert (first.status_code, first.json()["code"]) == (500, "internal")
    ok = http.get("/v1/health")
    assert ok.status_code == 200
    addr = [r.extensions["network_stream"].get_extra_info("client_addr") for r in (first, ok)]
    assert addr[0] == addr[1]


def test_no_token_is_401_before_the_body(http: httpx.Client) -> None:
    resp = http.post("/v1/leases", content=b"{}")
    assert (resp.status_code, resp.json()["code"]) == (401, "unauthorized")
