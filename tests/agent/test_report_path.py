"""Exclusive-copy accounting end to end: a KV store's counts reach poold's accounting.

A real `KVStore` on the lease's memfd, its `Reporter`, the agent service's `report`
operation, the link's heartbeat, poold's API and ledger: only the socket between
tenant and agent is skipped (the service is called with the peer the server would
have read off the connection).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import protocol as p
from agent.kv import KVStore
from agent.kv_report import Reporter
from agent.peer import Peer
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.errors import LeaseNotActive, NotOwner
from poold.wire.agent import Heartbeat, LeaseReport, Renewal
from tests.agent.conftest import LinkedAgent, emulated_device, linked_agent
from tests.conftest import ThreadedServer, free_port

KIB = 1 << 10
MIB = 1 << 20
LEASE_BYTES = 8 * MIB
BLOCK_BYTES = 256 * KIB
PEER = Peer(connection_id=1, pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
STRANGER = Peer(connection_id=2, pid=1, uid=os.getuid() + 1, gid=os.getgid() + 1)

DEVICE = emulated_device(64 * MIB)


Agent = LinkedAgent


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient) -> Iterator[Agent]:
    with linked_agent(api.url, admin, DEVICE, ["t"]) as linked:
        yield linked


@dataclass
class Held:
    lease_id: str
    mm: mmap.mmap


def hold(service: AgentService) -> Held:
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=LEASE_BYTES))
    mm = mmap.mmap(fd, result.length_bytes, flags=mmap.MAP_SHARED)
    service.fd_sent(PEER, fd)  # as the socket server does once the reply left
    return Held(result.lease_id, mm)


def reporter(service: AgentService, store: KVStore) -> Reporter:
    """The tenant library's reporter, with `Lease.report` swapped for the service call."""

    def report(**counts: int) -> bool:
        args = p.ReportArgs(lease_id=store.lease_id, **counts)
        return service.report(PEER, args).accepted

    return Reporter(store, report, min_interval_s=0)


# --- accounting matches the store's ground truth ------------------------------------

KEYS = st.integers(0, 47)  # more keys than slots (8 MiB / 256 KiB): LRU eviction happens
WHERE = st.sampled_from(["gpu", "dram", "host:peer"])
LEASE = st.integers(0, 1)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), LEASE, KEYS, st.integers(1, BLOCK_BYTES), st.none() | WHERE),
        st.tuples(st.just("get"), LEASE, KEYS),
        st.tuples(st.just("mark_replica"), LEASE, KEYS, WHERE),
        st.tuples(st.just("mark_exclusive"), LEASE, KEYS),
        st.tuples(st.just("delete"), LEASE, KEYS),
        st.tuples(st.just("drop_replicas"), LEASE, st.integers(0, 4 * BLOCK_BYTES)),
        st.tuples(st.just("shrink"), LEASE, st.integers(0, 4 * BLOCK_BYTES)),
    ),
    max_size=60,
)
DATA = memoryview(bytes(range(256)) * (BLOCK_BYTES // 256))


def apply(store: KVStore, op: tuple[object, ...]) -> None:
    name, _lease, *args = op
    if name == "put":
        key, size, where = args
        assert isinstance(size, int) and isinstance(key, int)
        store.put(key, DATA[:size], replica_of=where if isinstance(where, str) else None)
    elif name == "get":
        store.get(args[0])  # type: ignore[arg-type]
    elif name == "mark_replica":
        store.mark_replica(args[0], where=str(args[1]))  # type: ignore[arg-type]
    elif name == "mark_exclusive":
        store.mark_exclusive(args[0])  # type: ignore[arg-type]
    elif name == "delete":
        store.delete(args[0])  # type: ignore[arg-type]
    elif name == "drop_replicas":
        store.drop_replicas(args[0])  # type: ignore[arg-type]
    else:
        store.shrink(args[0])  # type: ignore[arg-type]


def test_accounting_matches_the_stores_ground_truth(agent: Agent, admin: PooldClient) -> None:
    held = [hold(agent.service), hold(agent.service)]

    # Function-scoped fixtures are shared by the examples on purpose: every example
    # opens fresh (empty) stores on the same two leases, and poold keeps only the
    # latest report, so nothing carries over from one example to the next.
    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(ops=OPS)
    def run(ops: list[tuple[object, ...]]) -> None:
        stores = [
            KVStore(h.mm, h.lease_id, 1, block_bytes=BLOCK_BYTES, recover=False) for h in held
        ]
        try:
            for op in ops:
                apply(stores[int(op[1])], op)  # type: ignore[call-overload]
            for store in stores:
                assert reporter(agent.service, store).flush()
            reply = agent.link.heartbeat()
            assert reply is not None and reply.report_errors == []

            truth = [store.stats() for store in stores]
            for h, stats in zip(held, truth, strict=True):
                lease = admin.show_lease(h.lease_id)
                assert (lease.exclusive_bytes, lease.replica_bytes) == (
                    stats.exclusive_bytes,
                    stats.replica_bytes,
                )
            report = admin.accounting("tenant")
            (group,) = report.groups
            assert group == report.pool.model_copy(update={"group": "t"})
            pool = report.pool
            assert pool.leases == pool.reported_leases == 2
            assert pool.leased_bytes == sum(s.leased_bytes for s in truth) == 2 * LEASE_BYTES
            assert pool.used_bytes == sum(s.used_bytes for s in truth)
            assert pool.exclusive_bytes == sum(s.exclusive_bytes for s in truth)
            assert pool.replica_bytes == sum(s.replica_bytes for s in truth)
            assert pool.exclusive_blocks == sum(s.exclusive_blocks for s in truth)
            assert pool.replica_blocks == sum(s.replica_blocks for s in truth)
            assert pool.exclusive_ratio == pytest.approx(
                sum(s.exclusive_bytes for s in truth) / (2 * LEASE_BYTES)
            )
        finally:
            for store in stores:
                store.close()

    try:
        run()
    finally:
        for h in held:
            h.mm.close()


# --- refusals ------------------------------------------------------------------------


def counts(used: int = 4 * MIB, exclusive: int = 3 * MIB, replica: int = MIB) -> dict[str, int]:
    return {"used_bytes": used, "exclusive_bytes": exclusive, "replica_bytes": replica}


def test_a_foreign_lease_is_refused_by_the_agent(agent: Agent) -> None:
    h = hold(agent.service)
    with pytest.raises(NotOwner):
        agent.service.report(STRANGER, p.ReportArgs(lease_id=h.lease_id, **counts()))
    assert agent.service.take_reports() == []  # nothing queued for poold
    h.mm.close()


def test_a_report_after_release_is_refused_and_a_pending_one_dropped(
    agent: Agent, admin: PooldClient
) -> None:
    h = hold(agent.service)
    h.mm.close()
    assert agent.service.report(PEER, p.ReportArgs(lease_id=h.lease_id, **counts())).accepted
    agent.service.release(PEER, p.ReleaseArgs(lease_id=h.lease_id))
    with pytest.raises(LeaseNotActive):
        agent.service.report(PEER, p.ReportArgs(lease_id=h.lease_id, **counts()))
    # The report accepted before the release never reaches poold.
    assert agent.service.take_reports() == []
    agent.link.flush()
    assert agent.link.heartbeat() is not None
    lease = admin.show_lease(h.lease_id)
    assert lease.state == "released" and lease.exclusive_bytes == 0


def test_poold_refuses_per_item_and_still_applies_the_heartbeat(
    api: ThreadedServer, agent: Agent, admin: PooldClient
) -> None:
    """Reports for another host's lease, an ended lease, an unknown id, or counts that
    cannot be true, are refused one by one; renewals and good reports still apply."""
    mine, ended = hold(agent.service), hold(agent.service)
    agent.service.release(PEER, p.ReleaseArgs(lease_id=ended.lease_id))
    agent.link.flush()
    other = admin.add_host("h2").credential
    with PooldClient(api.url, other) as h2:
        h2.register(Heartbeat(inventory=[DEVICE.model_copy(update={"uid": "h2/emulated:0"})]))
        before = admin.show_lease(mine.lease_id).expires_at
        reply = agent.client.heartbeat(
            Heartbeat(
                inventory_digest=None,
                renewals=[Renewal(lease_id=mine.lease_id, ttl_s=600)],
                reports=[
                    LeaseReport(lease_id=mine.lease_id, **counts()),
                    LeaseReport(lease_id=ended.lease_id, **counts()),
                    LeaseReport(lease_id="no-such-lease", **counts()),
                    LeaseReport(lease_id=mine.lease_id, **counts()),  # latest of a lease wins
                ],
            )
        )
        stolen = h2.heartbeat(
            Heartbeat(reports=[LeaseReport(lease_id=mine.lease_id, **counts(8 * MIB, 8 * MIB, 0))])
        )
        bad = agent.client.heartbeat(
            Heartbeat(
                reports=[
                    LeaseReport(lease_id=mine.lease_id, **counts(MIB, MIB, MIB)),
                    LeaseReport(lease_id=mine.lease_id + "x", **counts()),
                ]
            )
        )
        too_big = agent.client.heartbeat(
            Heartbeat(reports=[LeaseReport(lease_id=mine.lease_id, **counts(16 * MIB, 0, 0))])
        )
    codes = {e.lease_id: e.code for e in reply.report_errors}
    assert codes == {ended.lease_id: "lease_not_active", "no-such-lease": "unknown_lease"}
    assert reply.renewed[0].code is None and reply.renewed[0].expires_at is not None
    assert reply.renewed[0].expires_at > before
    assert [(e.lease_id, e.code) for e in stolen.report_errors] == [(mine.lease_id, "not_owner")]
    assert {e.code for e in bad.report_errors} == {"bad_request", "unknown_lease"}
    assert [e.code for e in too_big.report_errors] == ["bad_request"]
    lease = admin.show_lease(mine.lease_id)
    assert (lease.exclusive_bytes, lease.replica_bytes) == (3 * MIB, MIB)
    assert admin.show_lease(ended.lease_id).exclusive_bytes == 0
    pool = admin.accounting("host").pool
    assert (pool.used_bytes, pool.exclusive_bytes, pool.reported_leases) == (4 * MIB, 3 * MIB, 1)
    mine.mm.close()
    ended.mm.close()


def test_reports_wait_out_an_unreachable_poold(agent: Agent, admin: PooldClient) -> None:
    h = hold(agent.service)
    h.mm.close()
    agent.service.report(PEER, p.ReportArgs(lease_id=h.lease_id, **counts()))
    good = agent.link.client
    agent.link.client = PooldClient(f"http://127.0.0.1:{free_port()}", "x", timeout_s=1)
    try:
        assert agent.link.heartbeat() is None
    finally:
        agent.link.client.close()
        agent.link.client = good
    assert admin.show_lease(h.lease_id).exclusive_bytes == 0
    # A newer report of the same lease replaces the one that waited.
    agent.service.report(PEER, p.ReportArgs(lease_id=h.lease_id, **counts(2 * MIB, MIB, MIB)))
    reply = agent.link.heartbeat()
    assert reply is not None and reply.report_errors == []
    lease = admin.show_lease(h.lease_id)
    assert (lease.exclusive_bytes, lease.replica_bytes) == (MIB, MIB)
