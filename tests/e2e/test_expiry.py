"""Expiry against a real `poold serve` whose reaper runs, and the poold-down rule.

The agent side is played over poold's HTTP API (register, grant, heartbeat),
so the test decides exactly which renewals arrive and when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from poold import procs
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice, Renewal

MiB = 1 << 20
REAPER_ENV = {
    "POOLD_REAP_INTERVAL_S": "0.1",
    "POOLD_EXPIRY_GRACE_S": "0.5",
    "POOLD_ACTIVATION_DEADLINE_S": "1",
    "POOLD_HOST_SILENT_AFTER_S": "3",
}


@dataclass
class Poold:
    state_dir: Path
    port: int
    child: procs.Child
    agent: PooldClient

    def start_again(self) -> None:
        self.child = procs.start_poold(self.state_dir, self.port)

    def events(self, lease_id: str) -> list[tuple[str, str, str | None]]:
        engine = create_engine(f"sqlite:///{self.state_dir / 'ledger.db'}")
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT kind, actor, reason FROM events WHERE lease_id = :id ORDER BY id"),
                    {"id": lease_id},
                )
                return [tuple(r) for r in rows]  # type: ignore[misc]
        finally:
            engine.dispose()


@pytest.fixture
def poold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Poold]:
    for key, value in REAPER_ENV.items():
        monkeypatch.setenv(key, value)  # the poold child inherits them
    state_dir = tmp_path / "poold"
    port = procs.free_port()
    child = procs.start_poold(state_dir, port)
    server = Poold(state_dir, port, child, None)  # type: ignore[arg-type]
    try:
        with procs.admin_client(state_dir, port) as admin:
            credential = admin.add_host("x-host").credential
            admin.create_tenant(TenantSpec(name="t", quota_bytes=1 << 30, allowed_uids=[1000]))
        with PooldClient(f"http://127.0.0.1:{port}", credential) as agent:
            agent.register(
                Heartbeat(
                    inventory=[
                        InventoryDevice(uid="x-host/emu", kind="emulated", capacity_bytes=64 * MiB)
                    ]
                )
            )
            server.agent = agent
            yield server
    finally:
        server.child.stop()


def grant(agent: PooldClient, ttl_s: int, activate: bool = True) -> str:
    return agent.grant(
        GrantRequest(size_bytes=4 * MiB, uid=1000, pid=1, ttl_s=ttl_s, activate=activate)
    ).id


def wait_state(p: Poold, lease_id: str, want: str, timeout_s: float) -> float:
    with procs.admin_client(p.state_dir, p.port) as admin:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if admin.show_lease(lease_id).state == want:
                return time.monotonic()
            time.sleep(0.05)
        raise AssertionError(f"lease {lease_id} not {want} within {timeout_s}s")


def test_lease_expires_and_is_reclaimed_on_time(poold: Poold) -> None:
    stop = threading.Event()

    def beat() -> None:  # an agent whose tenant stopped renewing: heartbeats, no renewals
        while not stop.wait(0.1):
            poold.agent.heartbeat(Heartbeat())

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        granted = time.monotonic()
        lease_id = grant(poold.agent, ttl_s=1)
        stale = grant(poold.agent, ttl_s=60, activate=False)
        expired_at = wait_state(poold, lease_id, "expired", 5) - granted
        reclaimed_at = wait_state(poold, lease_id, "reclaimed", 5) - granted
        wait_state(poold, stale, "aborted", 5)
    finally:
        stop.set()
        beating.join()
    # ttl 1 s, reaper every 0.1 s, heartbeats every 0.1 s; grace 0.5 s after expiry.
    # Never early; the upper bounds leave room for a loaded 2-core CI machine.
    assert 0.95 <= expired_at <= 4.0
    assert 1.45 <= reclaimed_at <= 5.0
    kinds = poold.events(lease_id)
    assert [k for k, _, _ in kinds] == [
        "lease.grant",
        "lease.activate",
        "lease.expire",
        "lease.reclaim",
    ]
    assert {actor for k, actor, _ in kinds[2:]} == {"poold:reaper"}
    assert poold.events(stale)[-1][:2] == ("lease.abort", "poold:reaper")


def test_lease_survives_poold_outage(poold: Poold) -> None:
    """poold is killed for longer than the ttl; the agent's held renewal lands after."""
    lease_id = grant(poold.agent, ttl_s=2)
    poold.agent.heartbeat(Heartbeat(renewals=[Renewal(lease_id=lease_id, ttl_s=2)]))
    poold.child.kill()
    time.sleep(3)  # the lease's expiry passes while poold is down
    poold.start_again()
    reply = poold.agent.heartbeat(Heartbeat(renewals=[Renewal(lease_id=lease_id, ttl_s=2)]))
    assert reply.renewed[0].code is None, reply.renewed[0].message
    time.sleep(0.5)  # several reaper passes
    assert poold.agent.show_lease(lease_id).state == "active"
    assert [k for k, _, _ in poold.events(lease_id)] == ["lease.grant", "lease.activate"]
