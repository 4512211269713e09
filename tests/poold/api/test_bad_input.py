"""Bad input: a stable error code, a server that stays up, and a ledger left untouched."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from poold.ledger import tenants
from poold.ledger.db import Ledger
from poold.wire.admin import TenantUpdate
from poold.wire.agent import GrantRequest
from tests.conftest import ADMIN_TOKEN
from tests.poold.api.conftest import Agent, Raw
from tests.poold.conftest import GID, UID, MiB, snapshot

PiB = 1 << 50
GOOD_GRANT: dict[str, Any] = {"tenant": "t1", "size_bytes": 2 * MiB, "uid": UID, "pid": 7}


def assert_error_body(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) in ({"code", "message"}, {"code", "message", "detail"}), body
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"]
    if "detail" in body:
        assert isinstance(body["detail"], dict)
    return body


def refused(
    ledger: Ledger,
    raw: Raw,
    send: Callable[[], httpx.Response],
    status: int,
    code: str,
) -> dict[str, Any]:
    """`send` fails with `code`, changes no row, and the next request is served."""
    before = snapshot(ledger)
    body = assert_error_body(send(), status, code)
    assert raw.request("GET", "/v1/health").json()["status"] == "ok"
    assert raw.request("GET", "/v1/status").status_code == 200
    assert snapshot(ledger) == before
    return body


def grant_body(**kw: Any) -> dict[str, Any]:
    return {**GOOD_GRANT, **kw}


# (name, method, path, json or raw bytes, status, code); all sent with the agent's token.
AGENT_CASES: list[tuple[str, str, str, Any, int, str]] = [
    ("malformed json", "POST", "/v1/leases", b'{"size_bytes": ', 400, "bad_request"),
    ("not an object", "POST", "/v1/leases", b"[1, 2, 3]", 400, "bad_request"),
    ("empty body", "POST", "/v1/leases", b"", 400, "bad_request"),
    ("utf-8 garbage", "POST", "/v1/leases", b"\xff\xfe{", 400, "bad_request"),
    ("size as text", "POST", "/v1/leases", grant_body(size_bytes="lots"), 400, "invalid_size"),
    ("size as float", "POST", "/v1/leases", grant_body(size_bytes=1.5), 400, "invalid_size"),
    ("size zero", "POST", "/v1/leases", grant_body(size_bytes=0), 400, "invalid_size"),
    ("size negative", "POST", "/v1/leases", grant_body(size_bytes=-4096), 400, "invalid_size"),
    ("size > 1 PiB", "POST", "/v1/leases", grant_body(size_bytes=PiB + 1), 400, "invalid_size"),
    ("size 2**64", "POST", "/v1/leases", grant_body(size_bytes=1 << 64), 400, "invalid_size"),
    (
        "size missing",
        "POST",
        "/v1/leases",
        {"tenant": "t1", "uid": UID, "pid": 1},
        400,
        "invalid_size",
    ),
    ("uid as text", "POST", "/v1/leases", grant_body(uid="root"), 400, "bad_request"),
    ("uid negative", "POST", "/v1/leases", grant_body(uid=-1), 400, "bad_request"),
    ("pid huge", "POST", "/v1/leases", grant_body(pid=1 << 70), 400, "bad_request"),
    ("uid past int32", "POST", "/v1/leases", grant_body(uid=(1 << 31) + 5), 400, "bad_request"),
    ("gids not a list", "POST", "/v1/leases", grant_body(gids=5), 400, "bad_request"),
    ("ttl zero", "POST", "/v1/leases", grant_body(ttl_s=0), 400, "bad_request"),
    ("ttl absurd", "POST", "/v1/leases", grant_body(ttl_s=10**9), 400, "bad_request"),
    ("unknown field", "POST", "/v1/leases", grant_body(sizee=1), 400, "bad_request"),
    ("bad tenant name", "POST", "/v1/leases", grant_body(tenant="../etc"), 400, "bad_request"),
    ("labels not strings", "POST", "/v1/leases", grant_body(labels={"a": [1]}), 400, "bad_request"),
    ("unknown tenant", "POST", "/v1/leases", grant_body(tenant="nobody"), 404, "unknown_tenant"),
    ("uid not allowed", "POST", "/v1/leases", grant_body(uid=UID + 1), 403, "not_owner"),
    ("gid not allowed", "POST", "/v1/leases", grant_body(uid=1, gids=[GID + 1]), 403, "not_owner"),
    ("no capacity", "POST", "/v1/leases", grant_body(size_bytes=128 * MiB), 507, "no_capacity"),
    (
        "quota exceeded",
        "POST",
        "/v1/leases",
        grant_body(size_bytes=48 * MiB),
        409,
        "quota_exceeded",
    ),
    ("no such media", "POST", "/v1/leases", grant_body(media="hbm"), 507, "no_capacity"),
    ("renew random id", "POST", "/v1/leases/nope/renew", {}, 404, "unknown_lease"),
    ("release random id", "POST", "/v1/leases/nope/release", {}, 404, "unknown_lease"),
    ("activate random id", "POST", "/v1/leases/nope/activate", None, 404, "unknown_lease"),
    ("show random id", "GET", "/v1/leases/nope", None, 404, "unknown_lease"),
    ("renew ttl negative", "POST", "/v1/leases/nope/renew", {"ttl_s": -1}, 400, "bad_request"),
    (
        "reason too long",
        "POST",
        "/v1/leases/nope/release",
        {"reason": "x" * 5000},
        400,
        "bad_request",
    ),
    ("ops not a list", "POST", "/v1/agent/ops", {"ops": "release"}, 400, "bad_request"),
    (
        "op unknown",
        "POST",
        "/v1/agent/ops",
        {"ops": [{"lease_id": "x", "op": "eat"}]},
        400,
        "bad_request",
    ),
    ("register no inventory", "POST", "/v1/agent/register", {}, 400, "bad_request"),
    (
        "inventory negative capacity",
        "POST",
        "/v1/agent/register",
        {"inventory": [{"uid": "d", "kind": "emulated", "capacity_bytes": -1}]},
        400,
        "bad_request",
    ),
    (
        "inventory unknown kind",
        "POST",
        "/v1/agent/register",
        {"inventory": [{"uid": "d", "kind": "floppy", "capacity_bytes": 1}]},
        400,
        "bad_request",
    ),
    (
        "inventory absurd numa node",
        "POST",
        "/v1/agent/register",
        {
            "inventory": [
                {"uid": "d", "kind": "emulated", "capacity_bytes": 1, "numa_node": 1 << 40}
            ]
        },
        400,
        "bad_request",
    ),
    (
        "inventory capacity past int64",
        "POST",
        "/v1/agent/register",
        {"inventory": [{"uid": "d", "kind": "emulated", "capacity_bytes": 1 << 64}]},
        400,
        "bad_request",
    ),
    ("unknown endpoint", "GET", "/v1/nothing", None, 404, "not_found"),
    ("wrong method", "DELETE", "/v1/leases", None, 405, "bad_request"),
]


def _send(raw: Raw, token: str, method: str, path: str, payload: Any) -> httpx.Response:
    if isinstance(payload, bytes):
        return raw.request(method, path, token=token, content=payload)
    return raw.request(method, path, token=token, json=payload)


def _run_cases(
    ledger: Ledger, raw: Raw, token: str, cases: list[tuple[str, str, str, Any, int, str]]
) -> None:
    # One server and database for the whole table keeps the suite fast; each
    # case still checks code, body shape, liveness and an unchanged ledger.
    failures = []
    for name, method, path, payload, status, code in cases:
        try:
            send = functools.partial(_send, raw, token, method, path, payload)
            refused(ledger, raw, send, status, code)
        except AssertionError as exc:
            failures.append(f"{name}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_agent_bad_input(ledger: Ledger, raw: Raw, agent: Agent) -> None:
    _run_cases(ledger, raw, agent.credential, AGENT_CASES)
    # And a good request still works afterwards.
    resp = raw.request("POST", "/v1/leases", token=agent.credential, json=GOOD_GRANT)
    assert resp.status_code == 201, resp.text


ADMIN_CASES: list[tuple[str, str, str, Any, int, str]] = [
    ("tenant malformed json", "POST", "/v1/tenants", b"{name:", 400, "bad_request"),
    (
        "tenant quota as text",
        "POST",
        "/v1/tenants",
        {"name": "a", "quota_bytes": "1G"},
        400,
        "bad_request",
    ),
    (
        "tenant quota negative",
        "POST",
        "/v1/tenants",
        {"name": "a", "quota_bytes": -1},
        400,
        "bad_request",
    ),
    (
        "tenant quota absurd",
        "POST",
        "/v1/tenants",
        {"name": "a", "quota_bytes": 1 << 63},
        400,
        "bad_request",
    ),
    (
        "tenant lease quota beyond int32",
        "POST",
        "/v1/tenants",
        {"name": "a", "quota_bytes": 1, "quota_leases": 1 << 31},
        400,
        "bad_request",
    ),
    (
        "tenant bad name",
        "POST",
        "/v1/tenants",
        {"name": "a b", "quota_bytes": 1},
        400,
        "bad_request",
    ),
    (
        "tenant uid absurd",
        "POST",
        "/v1/tenants",
        {"name": "a", "quota_bytes": 1, "allowed_uids": [1 << 40]},
        400,
        "bad_request",
    ),
    (
        "tenant duplicate",
        "POST",
        "/v1/tenants",
        {"name": "t1", "quota_bytes": 1},
        409,
        "already_exists",
    ),
    ("get unknown tenant", "GET", "/v1/tenants/nobody", None, 404, "unknown_tenant"),
    (
        "patch unknown tenant",
        "PATCH",
        "/v1/tenants/nobody",
        {"quota_bytes": 1},
        404,
        "unknown_tenant",
    ),
    ("patch wrong type", "PATCH", "/v1/tenants/t1", {"quota_leases": "many"}, 400, "bad_request"),
    ("delete unknown tenant", "DELETE", "/v1/tenants/nobody", None, 404, "unknown_tenant"),
    ("host bad name", "POST", "/v1/hosts", {"name": "-x"}, 400, "bad_request"),
    ("host duplicate", "POST", "/v1/hosts", {"name": "h1"}, 409, "already_exists"),
    ("list limit zero", "GET", "/v1/leases?limit=0", None, 400, "bad_request"),
    ("list limit text", "GET", "/v1/leases?limit=all", None, 400, "bad_request"),
    ("nul in lease id", "GET", "/v1/leases/a%00b", None, 400, "bad_request"),
    ("nul in tenant name", "GET", "/v1/tenants/a%00b", None, 400, "bad_request"),
]


def test_admin_bad_input(ledger: Ledger, raw: Raw, agent: Agent) -> None:
    _run_cases(ledger, raw, ADMIN_TOKEN, ADMIN_CASES)


# --- cases that need a lease first -------------------------------------------------


def _grant(raw: Raw, agent: Agent, **kw: Any) -> dict[str, Any]:
    resp = raw.request("POST", "/v1/leases", token=agent.credential, json=grant_body(**kw))
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


FOREIGN_OPS = [
    ("POST", "/renew", {}),
    ("POST", "/release", {}),
    ("POST", "/activate", None),
    ("POST", "/abort", {}),
    ("GET", "", None),
]


def test_foreign_lease_is_not_owner(
    ledger: Ledger, raw: Raw, agent: Agent, other_agent: Agent
) -> None:
    lease = _grant(raw, agent)
    for method, suffix, payload in FOREIGN_OPS:
        path = f"/v1/leases/{lease['id']}{suffix}"
        send = functools.partial(_send, raw, other_agent.credential, method, path, payload)
        body = refused(ledger, raw, send, 403, "not_owner")
        assert body["detail"] == {"lease_id": lease["id"]}, (method, suffix)


def test_foreign_lease_in_ops_is_refused_per_op(
    ledger: Ledger, raw: Raw, agent: Agent, other_agent: Agent
) -> None:
    lease = _grant(raw, agent)
    before = snapshot(ledger)
    resp = raw.request(
        "POST",
        "/v1/agent/ops",
        token=other_agent.credential,
        json={"ops": [{"lease_id": lease["id"], "op": "release"}]},
    )
    assert resp.status_code == 200
    assert resp.json()[0]["code"] == "not_owner"
    assert snapshot(ledger) == before


def test_holder_op_after_release_is_lease_not_active(
    ledger: Ledger, raw: Raw, agent: Agent
) -> None:
    lease = _grant(raw, agent, activate=True)
    path = f"/v1/leases/{lease['id']}"
    assert (
        raw.request("POST", f"{path}/release", token=agent.credential, json={}).status_code == 200
    )
    for op in ("renew", "release", "activate"):
        send = functools.partial(_send, raw, agent.credential, "POST", f"{path}/{op}", {})
        body = refused(ledger, raw, send, 409, "lease_not_active")
        assert body["detail"] == {"state": "released"}, op


def test_quota_exceeded_by_lease_count(ledger: Ledger, raw: Raw, agent: Agent) -> None:
    for _ in range(8):
        _grant(raw, agent, size_bytes=1)
    body = refused(
        ledger,
        raw,
        lambda: raw.request("POST", "/v1/leases", token=agent.credential, json=GOOD_GRANT),
        409,
        "quota_exceeded",
    )
    assert body["detail"] == {"quota_leases": 8, "live_leases": 8}


def test_no_capacity_reports_largest_free(ledger: Ledger, raw: Raw, agent: Agent) -> None:
    # Within the quota (one over it is refused quota_exceeded before it is placed).
    tenants.update_tenant(ledger, "t1", TenantUpdate(quota_bytes=128 * MiB), "test")
    _grant(raw, agent, size_bytes=30 * MiB)
    body = refused(
        ledger,
        raw,
        lambda: raw.request(
            "POST", "/v1/leases", token=agent.credential, json=grant_body(size_bytes=36 * MiB)
        ),
        507,
        "no_capacity",
    )
    assert body["detail"]["largest_free_bytes"] == 34 * MiB


def test_typed_client_raises_the_server_error(agent: Agent) -> None:
    from poold.errors import NotOwner, UnknownLease, UnknownTenant

    with pytest.raises(UnknownTenant):
        agent.client.grant(GrantRequest(tenant="zz", size_bytes=1, uid=UID, pid=1))
    with pytest.raises(NotOwner):
        agent.client.grant(GrantRequest(tenant="t1", size_bytes=1, uid=4, pid=1))
    with pytest.raises(UnknownLease):
        agent.client.renew("nope")
