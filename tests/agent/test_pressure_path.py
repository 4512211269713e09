"""Pressure, replica first, end to end (DESIGN.md "Exclusive-copy accounting").

poold's API and ledger, the agent (PooldLink + AgentService behind a real AgentServer
socket), the tenant library (PoolClient, Lease) and two KVStores: poold sees a nearly
full device in a heartbeat, asks (shrink hint) the tenant holding replicas, which learns
it in the reply to its next renewal and drops replicas; the exclusive-only tenant is
asked only once every replica byte has been asked for, and no exclusive block is dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi import FastAPI

from agent.backends.emulated import EmulatedBackend
from agent.client import Lease, PoolClient
from agent.kv import KVStore
from agent.link import PooldLink
from agent.server import AgentServer
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.api.schemas import InventoryDevice, TenantSpec
from tests.conftest import ThreadedServer

KIB = 1 << 10
MIB = 1 << 20
BLOCK_BYTES = 256 * KIB
LEASE_BYTES = 32 * MIB

DEVICE = InventoryDevice(
    uid="h1/emulated:0",
    kind="emulated",
    media="emulated",
    capacity_bytes=2 * LEASE_BYTES,  # two leases fill it: under any watermark
    alignment_bytes=2 * MIB,
    health="ok",
    local_name="memfd",
)


@dataclass
class Stack:
    api: ThreadedServer
    link: PooldLink
    service: AgentService
    tenant: PoolClient


@pytest.fixture
def stack(api: ThreadedServer, admin: PooldClient) -> Iterator[Stack]:
    credential = admin.add_host("h1").credential
    for name in ("rich", "frugal"):
        admin.create_tenant(TenantSpec(name=name, quota_bytes=1 << 30, allowed_uids=[os.getuid()]))
    poold = PooldClient(api.url, credential)
    link = PooldLink(poold, "test")
    link.register([DEVICE])
    service = AgentService("h1", link, {"emulated": EmulatedBackend()})
    sock_dir = Path(tempfile.mkdtemp(prefix="poold-pressure-"))
    with AgentServer(sock_dir / "agent.sock", service) as server:
        server.start_in_thread()
        with PoolClient(server.socket_path, timeout_s=10) as tenant:
            yield Stack(api, link, service, tenant)
    service.close()
    poold.close()
    shutil.rmtree(sock_dir, ignore_errors=True)


def fill(kv: KVStore, replicas: int) -> tuple[set[str], set[str]]:
    """Every slot used: the first ``replicas`` blocks replicas (of GPU), the rest exclusive."""
    data = bytes(BLOCK_BYTES)
    slots = kv.stats().capacity_blocks
    for i in range(slots):
        kv.put(f"b{i}", data, replica_of="gpu" if i < replicas else None)
    assert kv.stats().used_blocks == slots
    keys = {f"b{i}" for i in range(slots)}
    return {k for k in keys if kv.residency(k) == "exclusive"}, {
        k for k in keys if kv.residency(k) != "exclusive"
    }


def test_replica_holder_gives_memory_back_first(stack: Stack) -> None:
    lock = threading.Lock()  # the engine's lock: hints are applied on the renewal thread
    rich: Lease = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False)
    frugal: Lease = stack.tenant.lease(LEASE_BYTES, tenant="frugal", renew=False)
    kv_rich = KVStore.open(rich, block_bytes=BLOCK_BYTES, report_interval_s=3600, lock=lock)
    kv_frugal = KVStore.open(frugal, block_bytes=BLOCK_BYTES, report_interval_s=3600, lock=lock)
    try:
        rich_exclusive, rich_replicas = fill(kv_rich, replicas=32)
        frugal_exclusive, _ = fill(kv_frugal, replicas=0)
        assert kv_rich.replica_bytes == 32 * BLOCK_BYTES and kv_frugal.replica_bytes == 0
        for kv in (kv_rich, kv_frugal):
            assert kv.reporter is not None and kv.reporter.flush()

        # poold: the device is full; only the replica holder is asked, for what is short.
        reply = stack.link.heartbeat()
        assert reply is not None
        hints = {h.lease_id: h for h in reply.shrink}
        assert set(hints) == {rich.lease_id}
        hint = hints[rich.lease_id]
        assert 0 < hint.target_bytes == hint.replica_bytes <= kv_rich.replica_bytes
        assert hint.deadline_at > reply.server_time

        # The frugal tenant's renewal carries nothing; the rich one's carries the hint,
        # and the store's default handler drops replicas (only) and reports at once.
        frugal.renew()
        assert kv_frugal.stats().used_blocks == len(frugal_exclusive)
        replica_before = kv_rich.replica_bytes
        rich.renew()
        freed = replica_before - kv_rich.replica_bytes
        assert freed >= hint.target_bytes
        assert kv_rich.pending_shrink is None
        assert all(kv_rich.residency(k) == "exclusive" for k in rich_exclusive)
        assert kv_rich.replica_bytes > 0  # asked for what was short, not for everything
        # A hint is handed out once.
        rich.renew()
        assert kv_rich.replica_bytes == replica_before - freed

        # The report reached poold with the next heartbeat: no more pressure.
        reply = stack.link.heartbeat()
        assert reply is not None and reply.shrink == []

        # Harder pressure (half the device): every replica byte is asked for before any
        # exclusive byte; the exclusive-only tenant is asked only then, and the default
        # handler drops no exclusive block (what replicas cannot cover is the engine's).
        app = stack.api.server.config.app
        assert isinstance(app, FastAPI)
        app.state.pressure_watermark = 0.5
        reply = stack.link.heartbeat()
        assert reply is not None
        hints = {h.lease_id: h for h in reply.shrink}
        assert hints[rich.lease_id].replica_bytes == kv_rich.replica_bytes
        assert frugal.lease_id in hints and hints[frugal.lease_id].replica_bytes == 0
        rich.renew()
        frugal.renew()
        assert kv_rich.replica_bytes == 0
        assert all(kv_rich.residency(k) == "exclusive" for k in rich_exclusive)
        assert all(kv_frugal.residency(k) == "exclusive" for k in frugal_exclusive)
        assert not any(k in kv_rich for k in rich_replicas)
    finally:
        kv_rich.close()
        kv_frugal.close()


def test_without_a_lock_the_hint_waits_for_the_engine(stack: Stack) -> None:
    rich = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False)
    other = stack.tenant.lease(LEASE_BYTES, tenant="frugal", renew=False)
    kv = KVStore.open(rich, block_bytes=BLOCK_BYTES, report_interval_s=3600)
    kv_other = KVStore.open(other, block_bytes=BLOCK_BYTES, report_interval_s=3600)
    try:
        fill(kv, replicas=16)
        fill(kv_other, replicas=0)
        for store in (kv, kv_other):
            assert store.reporter is not None and store.reporter.flush()
        reply = stack.link.heartbeat()
        assert reply is not None and [h.lease_id for h in reply.shrink] == [rich.lease_id]
        before = kv.replica_bytes
        rich.renew()
        assert kv.pending_shrink is not None and kv.replica_bytes == before  # not on this thread
        target = kv.pending_shrink[0]
        assert kv.apply_shrink() >= target  # the engine's own thread
        assert kv.pending_shrink is None and kv.replica_bytes < before
    finally:
        kv.close()
        kv_other.close()
    assert rich.on_shrink is None  # closing the store unhooks its handler
