"""Pressure, replica first, end to end (DESIGN.md "Exclusive-copy accounting").

poold's API and ledger, the agent (PooldLink + AgentService behind a real AgentServer
socket), the tenant library (PoolClient, Lease) and two KVStores: poold sees a nearly
full device in a heartbeat, asks (shrink hint) the tenant holding replicas, which learns
it in the reply to its next renewal, drops replicas and shrinks its lease (ftruncate of
the memfd), so the ledger has the bytes free again; the exclusive-only tenant is asked
only once every replica byte has been asked for. A holder that does not give back by
the deadline is revoked.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from fastapi import FastAPI

from agent.client import PoolClient
from agent.kv import KVStore
from agent.link import PooldLink
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.errors import InvalidSize, LeaseNotActive, NotShrinkable
from poold.ledger.db import Ledger
from poold.ledger.models import Event
from poold.ledger.models import Lease as LeaseRow
from poold.ledger.reaper import Reaper, ReaperPolicy
from tests.agent.conftest import emulated_device, linked_agent, serving
from tests.conftest import ThreadedServer

KIB = 1 << 10
MIB = 1 << 20
BLOCK_BYTES = 256 * KIB
LEASE_BYTES = 32 * MIB

DEVICE = emulated_device(2 * LEASE_BYTES)  # two leases fill it: under any watermark


@dataclass
class Stack:
    api: ThreadedServer
    link: PooldLink
    service: AgentService
    tenant: PoolClient
    ledger: Ledger

    def row(self, lease_id: str) -> LeaseRow:
        with self.ledger.read() as s:
            row = s.get(LeaseRow, lease_id)
            assert row is not None
            s.expunge(row)
            return row


@pytest.fixture
def stack(api: ThreadedServer, admin: PooldClient, ledger: Ledger) -> Iterator[Stack]:
    with (
        linked_agent(api.url, admin, DEVICE, ["rich", "frugal"]) as agent,
        serving(agent.service) as socket_path,
        # events=False: these tests follow the renewal path (the fallback for clients
        # without a session); tests/e2e/test_sessions.py has the pushed events.
        PoolClient(socket_path, timeout_s=10, events=False) as tenant,
    ):
        yield Stack(api, agent.link, agent.service, tenant, ledger)


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
    rich = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False, shrinkable=True)
    frugal = stack.tenant.lease(LEASE_BYTES, tenant="frugal", renew=False, shrinkable=True)
    assert rich.shrinkable and frugal.shrinkable
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
        asked = stack.row(rich.lease_id)
        assert asked.shrink_wanted_bytes == hint.target_bytes
        assert asked.shrink_deadline_at == hint.deadline_at

        # The frugal tenant's renewal carries nothing; the rich one's carries the hint:
        # the store drops replicas and shrinks the lease, all under the engine's lock.
        frugal.renew()
        assert kv_frugal.stats().used_blocks == len(frugal_exclusive)
        replica_before = kv_rich.replica_bytes
        rich.renew()
        assert kv_rich.pending_shrink is None
        assert rich.length_bytes <= LEASE_BYTES - hint.target_bytes
        assert rich.length_bytes % DEVICE.alignment_bytes == 0
        assert kv_rich.stats().leased_bytes == rich.length_bytes
        assert kv_rich.replica_bytes < replica_before
        assert all(kv_rich.residency(k) == "exclusive" for k in rich_exclusive)
        assert kv_rich.replica_bytes > 0  # asked for what was short, not for everything
        # Every block left is intact after the move into the smaller lease.
        for key in kv_rich:
            view = kv_rich.get(key)
            assert view is not None and view.nbytes == BLOCK_BYTES
        # The memfd itself is smaller: the pages are back with the kernel.
        assert os.fstat(rich.fd).st_size == rich.length_bytes

        # The shrink reached the ledger (outbox): the bytes are free, the request is met.
        stack.link.flush()
        row = stack.row(rich.lease_id)
        assert row.length_bytes == rich.length_bytes
        assert row.shrink_wanted_bytes is None and row.shrink_deadline_at is None
        with stack.ledger.read() as s:
            kinds = [e.kind for e in s.query(Event).filter(Event.lease_id == rich.lease_id)]
        assert "lease.shrink" in kinds
        reply = stack.link.heartbeat()
        assert reply is not None and reply.shrink == []

        # Harder pressure (half the device): every replica byte is asked for before any
        # exclusive byte; the exclusive-only tenant is asked only then.
        app = stack.api.server.config.app
        assert isinstance(app, FastAPI)
        app.state.pressure_watermark = 0.5
        reply = stack.link.heartbeat()
        assert reply is not None
        hints = {h.lease_id: h for h in reply.shrink}
        assert hints[rich.lease_id].replica_bytes == kv_rich.replica_bytes
        assert frugal.lease_id in hints and hints[frugal.lease_id].replica_bytes == 0
        rich.renew()
        assert kv_rich.replica_bytes == 0
        assert not any(k in kv_rich for k in rich_replicas)
        frugal.renew()
        assert frugal.length_bytes < LEASE_BYTES
        stack.link.flush()
        reply = stack.link.heartbeat()
        assert reply is not None and reply.shrink == []
        with stack.ledger.read() as s:
            leased = sum(
                r.length_bytes for r in s.query(LeaseRow).filter(LeaseRow.state == "active")
            )
        assert leased <= DEVICE.capacity_bytes // 2
    finally:
        kv_rich.close()
        kv_frugal.close()


def test_without_a_lock_the_hint_waits_for_the_engine(stack: Stack) -> None:
    rich = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False, shrinkable=True)
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
        assert rich.length_bytes <= LEASE_BYTES - target
    finally:
        kv.close()
        kv_other.close()
    assert rich.on_shrink is None  # closing the store unhooks its handler


def test_a_holder_that_does_not_give_back_is_revoked_at_the_deadline(stack: Stack) -> None:
    """Dropping replicas inside a lease that cannot shrink (sealed) frees nothing for the
    pool: the request stands, with the deadline of the first ask, and then poold revokes."""
    revoked: list[str] = []
    rich = stack.tenant.lease(
        LEASE_BYTES,
        tenant="rich",
        renew=False,
        on_revoke=lambda lease, _: revoked.append(lease.lease_id),
    )
    other = stack.tenant.lease(LEASE_BYTES, tenant="frugal", renew=False)
    assert not rich.shrinkable
    kv = KVStore.open(rich, block_bytes=BLOCK_BYTES, report_interval_s=3600)
    kv_other = KVStore.open(other, block_bytes=BLOCK_BYTES, report_interval_s=3600)
    try:
        fill(kv, replicas=16)
        fill(kv_other, replicas=0)
        for store in (kv, kv_other):
            assert store.reporter is not None and store.reporter.flush()
        first = stack.link.heartbeat()
        assert first is not None and [h.lease_id for h in first.shrink] == [rich.lease_id]
        rich.renew()
        assert kv.apply_shrink() > 0  # replicas dropped inside the lease
        assert rich.length_bytes == LEASE_BYTES
        assert kv.reporter is not None
        kv.reporter.flush()
        # Still short: asked again (now for its slack), same deadline.
        again = stack.link.heartbeat()
        assert again is not None
        still = {h.lease_id: h for h in again.shrink}
        assert still[rich.lease_id].deadline_at == first.shrink[0].deadline_at
        # Before the deadline the reaper leaves it; after it, it revokes.
        reaper = Reaper(stack.ledger, ReaperPolicy())
        deadline = first.shrink[0].deadline_at
        assert reaper.run_once(now=deadline - timedelta(microseconds=1)).revoked == []
        assert reaper.run_once(now=deadline).revoked == [rich.lease_id]
        assert stack.row(rich.lease_id).state == "revoking"
        # The other lease, asked one heartbeat later, has a deadline of its own.
        if other.lease_id in still:
            assert still[other.lease_id].deadline_at > deadline
        assert stack.row(other.lease_id).state == "active"
        # The revocation reaches the agent in the next heartbeat, the tenant on renew.
        stack.link.heartbeat()
        rich.renew()
        assert revoked == [rich.lease_id]
    finally:
        kv.close()
        kv_other.close()


def test_shrink_through_the_socket(stack: Stack) -> None:
    """Lease.shrink: the memfd is cut down, the ledger follows; refusals are coded."""
    lease = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False, shrinkable=True)
    sealed = stack.tenant.lease(4 * MIB, tenant="frugal", renew=False)
    mapping = lease.mmap()
    try:
        mapping[:4] = b"keep"
        # Rounded up to the device alignment (2 MiB).
        assert lease.shrink(5 * MIB) == 6 * MIB
        assert os.fstat(lease.fd).st_size == 6 * MIB == lease.length_bytes
        assert mapping[:4] == b"keep"  # the head is untouched
        stack.link.flush()
        assert stack.row(lease.lease_id).length_bytes == 6 * MIB
        with pytest.raises(InvalidSize):
            lease.shrink(6 * MIB)  # gives nothing back
        with pytest.raises(NotShrinkable):
            sealed.shrink(2 * MIB)
        assert os.fstat(sealed.fd).st_size == 4 * MIB
        # A store on a sealed lease cannot give back.
        with (
            KVStore.open(sealed, block_bytes=BLOCK_BYTES, report=False) as kv,
            pytest.raises(RuntimeError, match="not shrinkable"),
        ):
            kv.give_back(2 * MIB)
    finally:
        mapping.close()
    lease_id = lease.lease_id
    lease.release()
    with pytest.raises(LeaseNotActive):
        stack.tenant.shrink(lease_id, 2 * MIB)
    sealed.release()


def test_a_lease_that_cannot_shrink_in_place_is_relet_smaller(stack: Stack) -> None:
    """devdax's way (here on a sealed memfd): release, lease smaller, put the blocks back."""
    lock = threading.Lock()
    rich = stack.tenant.lease(LEASE_BYTES, tenant="rich", renew=False, labels={"engine": "kv"})
    other = stack.tenant.lease(LEASE_BYTES, tenant="frugal", renew=False)
    kv = KVStore.open(rich, block_bytes=BLOCK_BYTES, report_interval_s=3600, lock=lock, relet=True)
    kv_other = KVStore.open(other, block_bytes=BLOCK_BYTES, report_interval_s=3600)
    try:
        exclusive, replicas = fill(kv, replicas=32)
        data = {k: bytes(kv.get(k) or b"") for k in exclusive}
        fill(kv_other, replicas=0)
        for store in (kv, kv_other):
            assert store.reporter is not None and store.reporter.flush()
        reply = stack.link.heartbeat()
        assert reply is not None
        [hint] = reply.shrink
        assert hint.lease_id == rich.lease_id
        rich.renew()  # the hint: the store relets under the engine's lock
        new = kv.lease
        assert new is not None and new.lease_id != rich.lease_id
        assert rich.released
        assert new.length_bytes <= LEASE_BYTES - hint.target_bytes
        assert new.labels == {"engine": "kv"} and new.tenant == "rich"
        assert kv.lease_id == new.lease_id and kv.epoch == new.epoch
        # Replicas went first; every exclusive block is back, byte for byte.
        assert all(bytes(kv.get(k) or b"") == data[k] for k in exclusive)
        assert kv.replica_bytes < 32 * BLOCK_BYTES
        assert sum(1 for k in replicas if k in kv) == kv.replica_blocks
        # The ledger: the old lease released, the new one smaller; pressure met.
        stack.link.flush()
        assert stack.row(rich.lease_id).state == "released"
        assert stack.row(new.lease_id).length_bytes == new.length_bytes
        assert kv.reporter is not None and kv.reporter.sent > 0  # relet reported at once
        reply = stack.link.heartbeat()
        assert reply is not None and reply.shrink == []
        assert stack.row(new.lease_id).reported_at is not None
    finally:
        kv.close()
        kv_other.close()
        if kv.lease is not None:
            kv.lease.release()


def test_a_renewal_in_flight_with_a_revocation_still_tells_the_deadline(stack: Stack) -> None:
    """The heartbeat reply that carries a revocation also refuses the renewal queued for
    the same lease: the holder must hear the deadline (on_revoke), not lose the lease."""
    from poold.ledger import admin_ops

    revoked: list[str] = []
    lost: list[str] = []
    lease = stack.tenant.lease(
        4 * MIB,
        tenant="rich",
        renew=False,
        on_revoke=lambda le, _: revoked.append(le.lease_id),
        on_lost=lambda le: lost.append(le.lease_id),
    )
    lease.renew()  # queued on the agent for the next heartbeat
    admin_ops.revoke_lease(stack.ledger, lease.lease_id, "test", "admin:test", deadline_s=30)
    reply = stack.link.heartbeat()
    assert reply is not None
    assert [r.code for r in reply.renewed if r.lease_id == lease.lease_id] == ["lease_not_active"]
    assert [r.lease_id for r in reply.revocations] == [lease.lease_id]
    lease.renew()
    assert revoked == [lease.lease_id] and lost == []
    assert lease.revoke_deadline_at is not None
    lease.release()
