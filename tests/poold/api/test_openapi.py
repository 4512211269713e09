"""/openapi.json against poold's real answers: error shapes, bodies, security, /docs.

Each refusal below is provoked for real over HTTP and its body validated against the
schema the document gives for that operation and status; so are a few successes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from poold.api.client import PooldClient
from poold.ledger.db import Ledger
from poold.wire.routes import ROUTES
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.api.conftest import Agent, Raw
from tests.poold.conftest import GID, UID, MiB

GRANT = {"tenant": "t1", "size_bytes": 3 * MiB, "uid": UID, "gids": [GID], "pid": 4242}


@pytest.fixture
def spec(raw: Raw) -> dict[str, Any]:
    resp = raw.request("GET", "/openapi.json", token=None)
    assert resp.status_code == 200
    return dict(resp.json())


def operation(spec: dict[str, Any], route_name: str) -> dict[str, Any]:
    for methods in spec["paths"].values():
        for op in methods.values():
            if op.get("operationId") == route_name:
                return dict(op)
    raise AssertionError(f"no operation {route_name}")


def check(spec: dict[str, Any], route_name: str, resp: httpx.Response) -> None:
    """The reply's status is documented for the route, and its body fits that schema."""
    responses = operation(spec, route_name)["responses"]
    status = str(resp.status_code)
    assert status in responses, f"{route_name} answered {status}, documented {sorted(responses)}"
    content = responses[status].get("content")
    if content is None:
        assert not resp.content
        return
    schema = content["application/json"]["schema"]
    document = {"components": spec["components"], **schema}
    registry: Registry[Any] = Registry().with_resource(
        "", Resource.from_contents(document, default_specification=DRAFT202012)
    )
    errors = sorted(
        Draft202012Validator(document, registry=registry).iter_errors(resp.json()), key=str
    )
    assert not errors, f"{route_name} {status}: {[e.message for e in errors[:3]]}"


def test_no_validation_error_shape_and_every_route_is_an_operation(spec: dict[str, Any]) -> None:
    text = str(spec)
    assert "HTTPValidationError" not in text and "'422'" not in text
    for name, route in ROUTES.items():
        op = operation(spec, name)
        statuses = set(op["responses"])
        assert str(route.status_code) in statuses
        assert "500" in statuses
        if route.body is not None:
            assert op["requestBody"]["content"]["application/json"]["schema"]
            assert "413" in statuses and "400" in statuses


def test_bearer_security_on_every_authenticated_route(spec: dict[str, Any]) -> None:
    scheme = spec["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for name, route in ROUTES.items():
        op = operation(spec, name)
        if route.auth == "none":
            assert op["security"] == [], name
        else:
            assert op["security"] == [{"bearer": []}], name
            assert {"401", "403"} <= set(op["responses"]), name


def test_real_refusals_have_the_documented_shape(
    spec: dict[str, Any], raw: Raw, agent: Agent, admin: PooldClient
) -> None:
    refusals = [
        ("create_tenant", raw.request("POST", "/v1/tenants", json={"quota_bytes": "many"})),
        (
            "create_tenant",
            raw.request("POST", "/v1/tenants", json={"name": "t1", "quota_bytes": 1}),
        ),
        ("list_tenants", raw.request("GET", "/v1/tenants", token=None)),
        ("list_tenants", raw.request("GET", "/v1/tenants", token="pt1.nobody")),
        ("list_tenants", raw.request("GET", "/v1/tenants", token=agent.credential)),
        ("get_tenant", raw.request("GET", "/v1/tenants/nobody")),
        ("show_lease", raw.request("GET", "/v1/leases/no-such-lease")),
        ("list_leases", raw.request("GET", "/v1/leases?limit=0")),
        ("grant", raw.request("POST", "/v1/leases", json=GRANT)),  # admin token: 403
        (
            "grant",
            raw.request(
                "POST", "/v1/leases", token=agent.credential, json={**GRANT, "size_bytes": -1}
            ),
        ),
        (
            "grant",
            raw.request(
                "POST", "/v1/leases", token=agent.credential, json={**GRANT, "size_bytes": 60 * MiB}
            ),
        ),
        (
            "grant",
            raw.request(
                "POST", "/v1/leases", token=agent.credential, json={**GRANT, "tenant": "x"}
            ),
        ),
    ]
    seen = {}
    for name, resp in refusals:
        assert resp.status_code >= 400, (name, resp.status_code, resp.text)
        body = resp.json()
        assert set(body) <= {"code", "message", "detail"} and {"code", "message"} <= set(body)
        check(spec, name, resp)
        seen[resp.status_code] = body["code"]
    assert {400, 401, 403, 404, 409} <= set(seen), seen


def test_real_successes_have_the_documented_shape(
    spec: dict[str, Any], raw: Raw, agent: Agent
) -> None:
    granted = raw.request("POST", "/v1/leases", token=agent.credential, json=GRANT)
    check(spec, "grant", granted)
    lease_id = granted.json()["id"]
    check(spec, "show_lease", raw.request("GET", f"/v1/leases/{lease_id}"))
    check(spec, "list_tenants", raw.request("GET", "/v1/tenants"))
    check(spec, "status", raw.request("GET", "/v1/status"))
    check(spec, "list_hosts", raw.request("GET", "/v1/hosts"))
    check(
        spec,
        "heartbeat",
        raw.request(
            "POST", "/v1/agent/heartbeat", token=agent.credential, json={"agent_version": "t"}
        ),
    )
    check(
        spec,
        "release",
        raw.request(
            "POST", f"/v1/leases/{lease_id}/release", token=agent.credential, json={"reason": ""}
        ),
    )
    check(spec, "health", raw.request("GET", "/v1/health", token=None))


@pytest.fixture
def unreachable(tmp_path: Path) -> Iterator[ThreadedServer]:
    """poold over a ledger whose SQLite file cannot be opened: every ledger route is 503."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'gone' / 'ledger.db'}")
    with ThreadedServer(ledger) as server:
        yield server
    ledger.dispose()


def test_ledger_unavailable_has_the_documented_shape(
    spec: dict[str, Any], unreachable: ThreadedServer
) -> None:
    resp = httpx.get(
        f"{unreachable.url}/v1/tenants",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert resp.status_code == 503 and resp.json()["code"] == "ledger_unavailable"
    check(spec, "list_tenants", resp)
    assert "Retry-After" in operation(spec, "list_tenants")["responses"]["503"]["headers"]


def test_docs_and_redoc_are_served(raw: Raw) -> None:
    for path in ("/docs", "/redoc"):
        resp = raw.request("GET", path, token=None)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"].startswith("text/html")
        assert "/openapi.json" in resp.text
