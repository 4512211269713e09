"""Hostile: one agent credential must not rewrite, or place on, another host's device.

A real `poold serve` process, two hosts with their own agent credentials, real HTTP
heartbeats: host X sends host Y's device uid (all reserved, critical, new media) and
later only Y's device. poold refuses the item (`device_not_bound`), Y's free bytes and
health stay as Y reported them, X's grants never land on Y's device, and the refusal
is logged once, not per heartbeat. A shared CXL device takes X only after
`poolctl devices allow-host`, and drops it again with `disallow-host`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from poold import procs
from poold.api.client import PooldClient
from poold.errors import NoCapacity
from poold.wire.admin import DeviceStatus, TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, HeartbeatReply, InventoryDevice

MiB = 1 << 20
X, Y = "host-x", "host-y"
Y_DEVICE = f"emulated:{Y}"  # how agent/inventory.py names a host's emulated memory
SHARED = "cxl:ram:serials=41,42:ways=2:gran=4096:size=134217728"


def emulated(uid: str, **kw: object) -> InventoryDevice:
    fields: dict[str, object] = {
        "uid": uid,
        "kind": "emulated",
        "media": "emulated",
        "capacity_bytes": 64 * MiB,
        "alignment_bytes": 2 * MiB,
        "health": "ok",
        "local_name": "memfd",
    }
    fields.update(kw)
    return InventoryDevice.model_validate(fields)


def hostile(uid: str) -> InventoryDevice:
    return emulated(
        uid,
        capacity_bytes=64 * MiB,
        health="critical",
        media="hbm",
        health_reasons=["rewritten by host-x"],
        reserved_extents=[(0, 64 * MiB)],
        local_name="stolen",
    )


@dataclass
class Pool:
    state_dir: Path
    port: int
    child: procs.Child
    admin: PooldClient
    x: PooldClient
    y: PooldClient

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def device(self, uid: str) -> DeviceStatus:
        return self.admin.show_device(uid)

    def poolctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        token = self.state_dir / "admin.token"
        argv = [sys.executable, "-m", "cli", "--url", self.url, "--token-file", str(token)]
        return subprocess.run(
            [*argv, *args], capture_output=True, text=True, timeout=60, check=False
        )


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    state_dir = tmp_path / "poold"
    port = procs.free_port()
    child = procs.start_poold(state_dir, port)
    try:
        admin = procs.admin_client(state_dir, port)
        x_cred = admin.add_host(X).credential
        y_cred = admin.add_host(Y).credential
        admin.create_tenant(TenantSpec(name="t", quota_bytes=1 << 30, allowed_uids=[1000]))
        url = f"http://127.0.0.1:{port}"
        with PooldClient(url, x_cred) as x, PooldClient(url, y_cred) as y:
            yield Pool(state_dir, port, child, admin, x, y)
        admin.close()
    finally:
        child.stop()


def send(client: PooldClient, *items: InventoryDevice, digest: str = "d1") -> HeartbeatReply:
    return client.heartbeat(Heartbeat(inventory=list(items), inventory_digest=digest))


def refused(reply: HeartbeatReply) -> list[tuple[str | None, str]]:
    return [(e.device_uid, e.code) for e in reply.inventory_errors]


def grant(client: PooldClient) -> str:
    """The uid of the device a 2 MiB grant of this host lands on."""
    req = GrantRequest(tenant="t", size_bytes=2 * MiB, uid=1000, pid=1, activate=True)
    return client.grant(req).device_uid


def test_x_cannot_rewrite_or_place_on_ys_device(pool: Pool) -> None:
    pool.y.register(Heartbeat(agent_version="test", inventory=[emulated(Y_DEVICE)]))
    pool.x.register(Heartbeat(agent_version="test", inventory=[emulated(f"emulated:{X}")]))
    before = pool.device(Y_DEVICE)
    assert (before.free_bytes, before.health, before.hosts) == (64 * MiB, "ok", [Y])

    # X lists Y's device next to its own, three heartbeats running.
    for n in range(3):
        reply = send(pool.x, emulated(f"emulated:{X}"), hostile(Y_DEVICE), digest=f"x{n}")
        assert refused(reply) == [(Y_DEVICE, "device_not_bound")]
        assert "host-x" in reply.inventory_errors[0].message
    after = pool.device(Y_DEVICE)
    assert (after.free_bytes, after.health, after.media) == (64 * MiB, "ok", "emulated")
    assert (after.reserved_bytes, after.hosts, after.local_names) == (0, [Y], ["memfd"])
    assert after.health_reasons == [] and after.capacity_bytes == 64 * MiB
    assert pool.device(f"emulated:{X}").hosts == [X]  # the rest of X's report counted

    # X lists only Y's device: its own goes missing, and none of its grants reach Y's.
    assert refused(send(pool.x, hostile(Y_DEVICE), digest="x-only-y")) == [
        (Y_DEVICE, "device_not_bound")
    ]
    for _ in range(3):
        with pytest.raises(NoCapacity):
            grant(pool.x)
    assert [lease.device_uid for lease in pool.admin.list_leases(host=X)] == []
    # Y's tenants are served from Y's device as before.
    assert grant(pool.y) == Y_DEVICE
    assert pool.device(Y_DEVICE).free_bytes == 62 * MiB

    # Logged once per (host, device), not per heartbeat.
    log = (pool.state_dir.parent / f"poold-{pool.port}.log").read_text()
    assert log.count(f"may not report device '{Y_DEVICE}'") == 1, log


def test_shared_device_takes_a_second_head_only_when_allowed(pool: Pool) -> None:
    cxl = emulated(SHARED, kind="devdax", media="ddr5", memdev_serials=[41, 42])
    assert refused(send(pool.y, cxl.model_copy(update={"local_name": "dax_region0"}))) == []
    x_head = cxl.model_copy(update={"local_name": "dax_region3"})
    assert refused(send(pool.x, x_head)) == [(SHARED, "device_not_bound")]
    assert pool.device(SHARED).hosts == [Y]
    with pytest.raises(NoCapacity):
        grant(pool.x)

    out = pool.poolctl("devices", "allow-host", SHARED, X, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"uid": SHARED, "scope": "shared", "hosts": [X, Y]}
    # Same inventory digest as before: poold asks for the inventory again, then takes it.
    assert pool.x.heartbeat(Heartbeat(inventory_digest="d1")).want_inventory
    assert refused(send(pool.x, x_head)) == []
    assert pool.device(SHARED).hosts == [X, Y]
    assert grant(pool.x) == SHARED

    out = pool.poolctl("devices", "disallow-host", SHARED, X)
    assert out.returncode == 0, out.stderr
    assert f"{SHARED} (shared): may be reported by {Y}" in out.stdout
    assert pool.device(SHARED).hosts == [Y]
    with pytest.raises(NoCapacity):
        grant(pool.x)
    assert refused(send(pool.x, x_head, digest="d2")) == [(SHARED, "device_not_bound")]

    # A host-scoped device never gets a second host; the refusal is a stable code.
    send(pool.y, emulated(Y_DEVICE), cxl)
    out = pool.poolctl("devices", "allow-host", Y_DEVICE, X)
    assert out.returncode != 0 and "device_host_scoped" in out.stderr + out.stdout
