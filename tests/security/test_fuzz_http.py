"""A fuzz of poold's HTTP API: malformed requests to every route of the table, with no
token, garbage tokens, an agent credential and the admin token, plus raw bytes that are
not HTTP at all. Each is refused with a stable code (never a 5xx, never a traceback in
poold's log), nothing in the ledger changes, and poold stays up.

Every JSON object sent carries a field no wire model has (`__fuzz__`): the models
forbid unknown fields, so no fuzzed body can be a valid request, whatever else it
holds; path parameters are drawn so that they never name what exists. A quick variant
runs by default; the slow one sends 10,000 requests.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from poold import errors, procs
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.routes import ROUTES
from tests.poold.conftest import MiB
from tests.security.fuzzvalues import FuzzValues

SEED = int(os.environ.get("POOLD_FUZZ_SEED", "2026"))
TABLES = ("tenants", "hosts", "devices", "device_paths", "leases", "quarantine")
KNOWN_CODES = set(errors._BY_CODE)  # every stable code poold may send


class Poold:
    def __init__(self, work: Path) -> None:
        self.state = work / "poold"
        self.port = procs.free_port()
        self.child = procs.start_poold(self.state, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = procs.admin_client(self.state, self.port)
        self.admin_token = (self.state / "admin.token").read_text().strip()
        self.agent_token = self.admin.add_host("fuzz-host").credential
        self.admin.create_tenant(
            TenantSpec(name="t1", quota_bytes=64 * MiB, quota_leases=8, allowed_uids=[0])
        )

    def rows(self) -> dict[str, list[tuple[Any, ...]]]:
        engine = create_engine(f"sqlite:///{self.state / 'ledger.db'}")
        try:
            with engine.connect() as conn:
                return {
                    t: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {t} ORDER BY 1"))]
                    for t in TABLES
                }
        finally:
            engine.dispose()


@pytest.fixture
def poold(tmp_path: Path) -> Iterator[Poold]:
    p = Poold(tmp_path)
    try:
        yield p
    finally:
        p.admin.close()
        p.child.stop()


# Beyond the common scalars: strings that mean something to poold, and timestamps.
_value = FuzzValues(
    scalars=(
        lambda rng: rng.choice(["", "\x00", "x" * 5000, "../../etc/passwd", "t1", "2MiB", "64gb"]),
        lambda rng: rng.choice(["2026-12-01T00:00:00Z", "yesterday", "1e309"]),
    ),
    obj=lambda rng, depth: _object(rng, [], depth + 1),
)


def _object(rng: random.Random, fields: list[str], depth: int = 0) -> dict[str, Any]:
    """Some of a model's fields with random values, and always the forbidden one."""
    out: dict[str, Any] = {f: _value(rng, depth) for f in fields if rng.random() < 0.6}
    out["__fuzz__"] = _value(rng, depth + 1) if depth < 3 else 1
    return out


def _param(rng: random.Random) -> str:
    """A path parameter that names nothing in the ledger (never t1 or fuzz-host)."""
    return rng.choice(
        [
            "nope",
            "a" * rng.choice([1, 64, 65, 300, 5000]),
            "\x00",
            "..",
            "%00",
            "x/y/z",
            "ünïcödé",
            " ",
            "00000000-0000-0000-0000-000000000000",
            str(rng.randrange(1 << 62)),
        ]
    )


def _request(rng: random.Random, poold: Poold) -> dict[str, Any]:
    route = rng.choice(list(ROUTES.values()))
    params = {name: _param(rng) for name in route.path_params}
    try:
        path = route.url(**params)
    except Exception:
        path = route.path
    if rng.random() < 0.05:
        path = rng.choice(["/", "/v1", "/v1/nope", "/v2/leases", "/metrics/x", "/%ff"])
    method = route.method if rng.random() < 0.9 else rng.choice(["PUT", "PATCH", "TRACE", "GET"])
    token = rng.choice(
        [None, "", "Bearer", "garbage", "pt1.agent.x", poold.agent_token, poold.admin_token]
    )
    headers: dict[str, str] = {}
    if token is not None:
        value = (f"Bearer {token}" if rng.random() < 0.9 else token).strip()
        if value:  # httpx sends no empty or space-padded header value
            headers["authorization"] = value
    content: bytes | None = None
    kind = rng.randrange(10)
    fields = list(route.body.model_fields) if route.body is not None else []
    if kind <= 5:
        content = json.dumps(_object(rng, fields)).encode()
    elif kind == 6:
        content = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif kind == 7:
        depth = rng.choice([100, 5000])
        content = b"[" * depth + b"]" * depth
    elif kind == 8:
        content = json.dumps([_object(rng, fields)]).encode()
    if content is not None:
        headers["content-type"] = rng.choice(["application/json", "text/plain", "x/y"])
    query = {}
    if route.query is not None and rng.random() < 0.5:
        query = {name: str(_value(rng)) for name in route.query.model_fields}
        query["__fuzz__"] = "1"
    # A request the fuzz cannot make invalid: a route without a body model (audit, say;
    # unknown query parameters are ignored, as HTTP clients expect) may answer 2xx.
    may_succeed = route.body is None and method == route.method
    return {
        "method": method,
        "url": path,
        "headers": headers,
        "content": content,
        "params": query,
        "may_succeed": may_succeed,
    }


RAW = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/tenants HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{",
    b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    b"GET /v1/health HTTP/1.1\r\n" + b"H: v\r\n" * 5000 + b"\r\n",
]


def _raw(poold: Poold, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", poold.port), timeout=10) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # poold hung up on it: that is an answer too


def run_fuzz(poold: Poold, requests: int) -> Counter[str]:
    rng = random.Random(SEED)  # noqa: S311  # reproducible, not secret
    before = poold.rows()
    seen: Counter[str] = Counter()
    bad: list[str] = []
    with httpx.Client(base_url=poold.url, timeout=30) as http:
        for i in range(requests):
            req = _request(rng, poold)
            may_succeed = req.pop("may_succeed")
            if i % 97 == 0:
                _raw(poold, rng.choice(RAW))
            resp = http.request(**req)
            if resp.status_code < 400 and not may_succeed and req["method"] != "GET":
                bad.append(f"{req['method']} {req['url']} took a fuzzed body: {resp.status_code}")
            if resp.status_code >= 500:
                bad.append(f"{req['method']} {req['url']}: {resp.status_code} {resp.text[:200]}")
            if resp.status_code >= 400:
                try:
                    code = resp.json().get("code")
                except ValueError:
                    code = None
                if code not in KNOWN_CODES:
                    bad.append(f"{req['method']} {req['url']}: no stable code: {resp.text[:200]}")
                seen[str(code)] += 1
            else:
                seen["ok"] += 1
    assert bad == [], "\n".join(bad[:20])
    assert httpx.get(f"{poold.url}/v1/health", timeout=10).status_code == 200
    assert poold.child.proc.poll() is None
    assert poold.rows() == before
    log = poold.child.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    return seen


def test_fuzz_the_http_api_quick(poold: Poold) -> None:
    seen = run_fuzz(poold, 1_000)
    assert seen["bad_request"] > 100  # the bodies were read and refused, not just 401s


@pytest.mark.slow
def test_fuzz_the_http_api_long(poold: Poold) -> None:
    run_fuzz(poold, 10_000)


def test_fuzzing_through_the_typed_client_is_refused_too(poold: Poold) -> None:
    """The typed client with a bad credential: the one-line refusal, not a crash."""
    with PooldClient(poold.url, "pt1.agent.nope") as bad, pytest.raises(errors.Unauthorized):
        bad.list_leases()
