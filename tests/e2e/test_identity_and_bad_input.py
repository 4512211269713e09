"""Who may lease, and what bad input does: stable codes, agent and poold stay up, ledger untouched.

Identity is SO_PEERCRED: a child that drops to uid `nobody` is seen as
nobody whatever it claims.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from agent.client import PoolClient
from poold.errors import PoolError
from tests.e2e.conftest import NOBODY, Cluster

LEDGER_TABLES = ("tenants", "devices", "device_paths", "leases", "events", "quarantine")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def as_nobody(fn: Callable[[], Any]) -> Any:
    """Run fn in a forked child that became `nobody`; return its result or error code."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            try:
                out = {"ok": fn()}
            except PoolError as err:
                out = {"code": err.code, "message": err.message}
            os.write(w, json.dumps(out, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def code_of(fn: Callable[[], Any]) -> str:
    with pytest.raises(PoolError) as info:
        fn()
    return info.value.code


def assert_up_and_unchanged(c: Cluster, before: dict[str, Any]) -> None:
    assert c.agent.alive() and c.poold.alive()
    with PoolClient(c.socket_path) as client:
        assert client.hello().host == "e2e-host"
    assert c.ledger_rows(*LEDGER_TABLES) == before


@needs_root
def test_nobody_leases_for_its_own_tenant_only(cluster: Cluster) -> None:
    sock = cluster.socket_path

    def lease_default() -> Any:
        with PoolClient(sock) as client, client.lease(2 << 20, renew=False) as lease:
            return {"uid": client.hello().peer_uid, "lease": lease.lease_id}

    out = as_nobody(lease_default)
    assert "ok" in out, out
    assert out["ok"]["uid"] == NOBODY.pw_uid
    assert cluster.admin.show_lease(out["ok"]["lease"]).tenant == "nobodies"
    # Its release reaches poold through the agent's outbox: settled before the snapshot
    # (it bumps the device's generation in the ledger).
    deadline = time.monotonic() + 10
    while cluster.admin.show_lease(out["ok"]["lease"]).state != "released":
        assert time.monotonic() < deadline, cluster.admin.show_lease(out["ok"]["lease"])
        time.sleep(0.05)

    before = cluster.ledger_rows(*LEDGER_TABLES)

    def claim_alpha() -> Any:
        with PoolClient(sock) as client:
            return client.lease(2 << 20, tenant="alpha", renew=False).lease_id

    assert as_nobody(claim_alpha)["code"] == "not_owner"
    assert_up_and_unchanged(cluster, before)


@needs_root
def test_nobody_cannot_touch_roots_lease(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as client, client.lease(2 << 20) as lease:
        before = cluster.ledger_rows(*LEDGER_TABLES)
        lease_id = lease.lease_id

        def renew_foreign() -> Any:
            with PoolClient(cluster.socket_path) as c2:
                return c2.renew(lease_id)

        def release_foreign() -> Any:
            with PoolClient(cluster.socket_path) as c2:
                return c2.release(lease_id)

        assert as_nobody(renew_foreign)["code"] == "not_owner"
        assert as_nobody(release_foreign)["code"] == "not_owner"
        assert_up_and_unchanged(cluster, before)
        assert cluster.admin.show_lease(lease_id).state == "active"


def raw_exchange(sock_path: str, payload: bytes) -> dict[str, Any] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(payload)
        head = b""
        while len(head) < 4:
            chunk = s.recv(4 - len(head))
            if not chunk:
                return None
            head += chunk
        (length,) = struct.unpack(">I", head)
        body = b""
        while len(body) < length:
            chunk = s.recv(length - len(body))
            if not chunk:
                break
            body += chunk
        return dict(json.loads(body))


def frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    return struct.pack(">I", len(body)) + body


def test_bad_input_gets_codes_and_changes_nothing(cluster: Cluster) -> None:
    c = cluster
    sock = str(c.socket_path)
    with PoolClient(c.socket_path) as client:
        # Something to be foreign about, released before the snapshot.
        gone = client.lease(2 << 20, renew=False)
        gone.release()
        deadline = time.monotonic() + 10
        while c.admin.show_lease(gone.lease_id).state != "released":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = c.ledger_rows(*LEDGER_TABLES)

        # Frames the protocol refuses.
        reply = raw_exchange(sock, struct.pack(">I", 10 << 20) + b"{")
        assert reply is not None and reply["error"]["code"] == "frame_too_large"
        assert raw_exchange(sock, frame(b"{not json"))["error"]["code"] == "bad_request"  # type: ignore[index]
        assert raw_exchange(sock, frame([1, 2]))["error"]["code"] == "bad_request"  # type: ignore[index]
        assert (
            raw_exchange(sock, frame({"op": "nope", "args": {}}))["error"]["code"] == "bad_request"
        )  # type: ignore[index]
        bad_size = {"op": "lease", "args": {"size_bytes": "lots"}}
        assert raw_exchange(sock, frame(bad_size))["error"]["code"] in (
            "bad_request",
            "invalid_size",
        )  # type: ignore[index]

        # Sizes.
        for size in (0, -1, 1 << 60):
            assert code_of(lambda s=size: client.lease(s, renew=False)) in (
                "invalid_size",
                "bad_request",
            )
        # Unknown tenant (the same not_owner as a foreign one: no oracle of names); quota.
        assert code_of(lambda: client.lease(2 << 20, tenant="ghost", renew=False)) == "not_owner"
        assert code_of(lambda: client.lease(200 << 20, renew=False)) == "quota_exceeded"
        c.admin.update_tenant(
            "alpha",
            __import__("poold.wire.admin", fromlist=["TenantUpdate"]).TenantUpdate(
                quota_bytes=1 << 40
            ),
        )
        before = c.ledger_rows(*LEDGER_TABLES)
        assert code_of(lambda: client.lease(300 << 20, renew=False)) == "no_capacity"
        # Leases that are not (or no longer) yours.
        assert code_of(lambda: client.renew(str(uuid.uuid4()))) == "unknown_lease"
        assert code_of(lambda: client.renew(gone.lease_id)) == "lease_not_active"
        assert code_of(lambda: client.release(gone.lease_id)) == "lease_not_active"
    assert_up_and_unchanged(c, before)


def test_agent_credential_cannot_act_as_admin(cluster: Cluster) -> None:
    from poold.api.client import PooldClient

    cred = (cluster.work / "agent.credential").read_text().strip()
    with PooldClient(cluster.url, cred) as agent_client:
        assert code_of(agent_client.list_tenants) == "forbidden"
    with PooldClient(cluster.url, "pt1.admin.wrong") as anon:
        assert code_of(anon.status) == "unauthorized"
