"""Admission when the pool is full: wait up to `wait_s` (FIFO on the agent) or fail at once.

poold's API and ledger, the agent (PooldLink + AgentService behind a real AgentServer
socket) and tenant libraries (PoolClient), one client per waiting request (a client's
calls are serialised). One emulated device holds two 32 MiB leases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.admission import BUDGETS_RETRY_S, Admission
from agent.client import Lease, PoolClient
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.errors import NoCapacity, PoolError, QuotaExceeded
from poold.wire.agent import GrantRequest
from tests.agent.conftest import emulated_device, linked_agent, serving
from tests.conftest import ThreadedServer

MIB = 1 << 20
LEASE_BYTES = 32 * MIB

DEVICE = emulated_device(2 * LEASE_BYTES)


@dataclass
class Stack:
    service: AgentService
    socket_path: Path
    holder: PoolClient
    clients: list[PoolClient] = field(default_factory=list)

    def client(self) -> PoolClient:
        c = PoolClient(self.socket_path, timeout_s=10)
        self.clients.append(c)
        return c


@pytest.fixture
def stack(api: ThreadedServer, admin: PooldClient) -> Iterator[Stack]:
    with (
        linked_agent(api.url, admin, DEVICE, ["holder", "waiter"]) as agent,
        serving(agent.service) as socket_path,
        PoolClient(socket_path, timeout_s=10) as holder,
    ):
        s = Stack(agent.service, socket_path, holder)
        yield s
        for c in s.clients:
            c.close()


class Waiter:
    """A lease request with wait_s, on its own client and thread."""

    def __init__(self, stack: Stack, size_bytes: int, wait_s: float, served: list[str]) -> None:
        self.client = stack.client()
        self.lease: Lease | None = None
        self.error: PoolError | None = None
        self.elapsed_s = 0.0

        def run() -> None:
            start = time.monotonic()
            try:
                self.lease = self.client.lease(
                    size_bytes, tenant="waiter", renew=False, wait_s=wait_s
                )
                served.append(self.lease.lease_id)
            except PoolError as err:
                self.error = err
            self.elapsed_s = time.monotonic() - start

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 15) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()


def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def waiting(stack: Stack) -> int:
    return stack.service.admission.waiting()


def fill(stack: Stack) -> list[Lease]:
    return [stack.holder.lease(LEASE_BYTES, tenant="holder", renew=False) for _ in range(2)]


def test_full_pool_fails_at_once_or_waits_for_a_release(stack: Stack) -> None:
    first, second = fill(stack)
    tenant = stack.client()

    # wait_s=0: no_capacity at once, naming what is free and where.
    start = time.monotonic()
    with pytest.raises(NoCapacity) as refused:
        tenant.lease(LEASE_BYTES, tenant="waiter", renew=False)
    assert time.monotonic() - start < 2
    assert refused.value.detail["largest_free_bytes"] == 0
    # Keyed by poold's device id (not the uid) today: see the ledger's NoCapacity.
    assert list(refused.value.detail["free_by_device"].values()) == [0]
    assert "largest free extent is 0 bytes" in refused.value.message

    # wait_s: served as soon as the holder releases, well before the wait ends.
    served: list[str] = []
    w = Waiter(stack, LEASE_BYTES, wait_s=15, served=served)
    until(lambda: waiting(stack) == 1)
    time.sleep(0.2)
    assert w.lease is None and w.error is None
    first.release()
    w.join()
    assert w.error is None and w.lease is not None
    assert w.elapsed_s < 5
    assert w.lease.length_bytes == LEASE_BYTES
    assert waiting(stack) == 0
    second.release()


def test_waiters_are_served_in_arrival_order(stack: Stack) -> None:
    first, second = fill(stack)
    served: list[str] = []
    w1 = Waiter(stack, LEASE_BYTES, wait_s=15, served=served)
    until(lambda: waiting(stack) == 1)
    w2 = Waiter(stack, LEASE_BYTES, wait_s=15, served=served)
    until(lambda: waiting(stack) == 2)

    first.release()
    until(lambda: len(served) == 1)
    assert w1.lease is not None and served == [w1.lease.lease_id]
    time.sleep(0.3)
    assert w2.lease is None and w2.error is None and waiting(stack) == 1

    second.release()
    w1.join()
    w2.join()
    assert w2.lease is not None and served == [w1.lease.lease_id, w2.lease.lease_id]


def test_a_later_smaller_request_never_overtakes(stack: Stack) -> None:
    first, second = fill(stack)
    served: list[str] = []
    big = Waiter(stack, 2 * LEASE_BYTES, wait_s=15, served=served)
    until(lambda: waiting(stack) == 1)
    small = Waiter(stack, LEASE_BYTES, wait_s=2, served=served)
    until(lambda: waiting(stack) == 2)

    # Room for the small one, not the big one: the small one must not take it.
    first.release()
    time.sleep(0.5)
    assert served == [] and waiting(stack) == 2

    second.release()
    big.join()
    assert big.lease is not None and served == [big.lease.lease_id]
    small.join()
    # Its wait ran out behind the big one, which then took the whole device.
    assert isinstance(small.error, NoCapacity) and small.lease is None
    assert list(small.error.detail["free_by_device"].values()) == [0]
    assert 1.5 < small.elapsed_s < 5
    assert waiting(stack) == 0


def test_a_waiting_request_is_served_by_a_store_giving_memory_back(stack: Stack) -> None:
    """Pool full of one tenant's KV stores (replicas in them); a request waits; poold's
    pressure asks the replica holder, whose store shrinks its lease; the waiter is served
    from the bytes given back, with nothing released."""
    from agent.kv import KVStore

    lock = threading.Lock()
    holders = [
        stack.holder.lease(LEASE_BYTES, tenant="holder", ttl_s=1, shrinkable=True) for _ in range(2)
    ]
    stores = [
        KVStore.open(lease, block_bytes=256 << 10, report_interval_s=0.1, lock=lock)
        for lease in holders
    ]
    try:
        block = bytes(256 << 10)
        exclusive: list[set[str]] = []
        for store in stores:
            with lock:
                for i in range(store.stats().capacity_blocks):
                    store.put(f"b{i}", block, replica_of="gpu" if i % 2 else None)
                exclusive.append({k for k in map(str, store) if store.residency(k) == "exclusive"})
        stack.service.link.start(0.1)  # heartbeats carry the waiting bytes to poold
        served: list[str] = []
        w = Waiter(stack, 8 * MIB, wait_s=20, served=served)
        w.join(timeout_s=20)
        assert w.error is None and w.lease is not None, w.error
        assert w.lease.length_bytes == 8 * MIB
        # Room came from shrinking, not from a release; no exclusive block was dropped.
        assert all(not lease.released for lease in holders)
        assert sum(lease.length_bytes for lease in holders) <= 2 * LEASE_BYTES - 8 * MIB
        with lock:
            for store, keys in zip(stores, exclusive, strict=True):
                assert all(store.residency(k) == "exclusive" for k in keys)
        w.lease.release()
    finally:
        stack.service.link.stop()
        for store in stores:
            store.close()
        for lease in holders:
            lease.release()


# --- in flight: what concurrent lease requests may make together ----------------------


def test_in_flight_bytes_bound_what_is_made_together() -> None:
    from agent.admission import InFlight, InFlightLimits
    from poold.errors import InFlightLimit

    gib = 1 << 30
    budget = InFlight(
        InFlightLimits(max_bytes=2 * gib, max_bytes_per_uid=gib, max_requests_per_uid=2, wait_s=0.2)
    )
    with budget.making(1000, gib):
        # The uid's budget is spent: its next request waits, then is refused, retryably.
        start = time.monotonic()
        with pytest.raises(InFlightLimit) as refused, budget.making(1000, 1):
            pass
        assert 0.15 < time.monotonic() - start < 2
        assert refused.value.detail["limit"] == "bytes_per_uid"
        with budget.making(1001, gib):  # another uid fits the host's budget
            with pytest.raises(InFlightLimit) as host, budget.making(1002, 1):
                pass
            assert host.value.detail["limit"] == "bytes"
            assert budget.bytes_in_flight() == 2 * gib
    assert budget.bytes_in_flight() == 0
    # A lone request larger than every budget still runs: nothing else is being made.
    with budget.making(1000, 8 * gib):
        assert budget.bytes_in_flight(1000) == 8 * gib
    # What the host has free counts too, against what others are making.
    with budget.making(1000, gib // 2):
        with (
            pytest.raises(InFlightLimit),
            budget.making(1001, gib // 2, available=lambda: gib // 2),
        ):
            pass
        with budget.making(1001, gib // 4, available=lambda: gib):
            pass


def test_in_flight_requests_per_uid_wait_for_a_slot() -> None:
    from agent.admission import InFlight, InFlightLimits
    from poold.errors import InFlightLimit

    budget = InFlight(InFlightLimits(max_requests_per_uid=2, wait_s=5))
    with budget.request(7), budget.request(7):
        with pytest.raises(InFlightLimit) as refused, budget.request(7, wait_s=0.1):
            pass
        assert refused.value.detail["limit"] == "requests_per_uid"
        with budget.request(8):  # other uids are not held up
            pass
        # A slot freed while one waits is taken by the waiter.
        got = threading.Event()

        def waiter() -> None:
            with budget.request(7):
                got.set()

        thread = threading.Thread(target=waiter)
        outer = budget._requests  # the table the waiter waits on
        thread.start()
        time.sleep(0.2)
        assert not got.is_set() and outer[7] == 2
    thread.join(5)
    assert got.is_set() and budget.requests_in_flight(7) == 0


def test_a_refusal_held_by_other_hosts_budgets_is_tried_again_within_the_wait() -> None:
    """poold keeps room beside the budgets once it refused for them (held_by_budgets):
    the request tries again within its wait, outside the capacity queue; any other
    quota_exceeded, or no wait, is the answer at once."""
    calls: list[float] = []
    granted = object()

    def grant(refusals: int, held_by_budgets: bool) -> Callable[[GrantRequest], object]:
        def call(_req: GrantRequest) -> object:
            calls.append(time.monotonic())
            if len(calls) <= refusals:
                raise QuotaExceeded(
                    "quota", **({"held_by_budgets": True} if held_by_budgets else {})
                )
            return granted

        return call

    req = GrantRequest(size_bytes=LEASE_BYTES, uid=1000, pid=1)
    assert Admission(grant(2, True)).grant(req, 5.0) is granted  # type: ignore[arg-type]
    assert len(calls) == 3 and calls[-1] - calls[0] >= 3 * BUDGETS_RETRY_S * 0.9  # doubling
    for refusals, flag, wait_s in ((1, False, 5.0), (1, True, 0.0)):
        calls.clear()
        with pytest.raises(QuotaExceeded):
            Admission(grant(refusals, flag)).grant(req, wait_s)  # type: ignore[arg-type]
        assert len(calls) == 1
    calls.clear()
    started = time.monotonic()
    with pytest.raises(QuotaExceeded):  # still refused when the wait runs out
        Admission(grant(100, True)).grant(req, 0.6)  # type: ignore[arg-type]
    assert 0.5 < time.monotonic() - started < 2.0
