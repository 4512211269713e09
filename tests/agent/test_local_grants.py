"""The agent service granting inside its delegation with poold unreachable: the lease is
journalled (the append-only grant log) and queued as a local_grant op before its fd
leaves; a restarted agent queues again every op poold has not applied, in order; past
the TTL local grants stop with delegation_expired; what the agent exports about it."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import protocol as p
from agent.backends.emulated import EmulatedBackend
from agent.delegation import DelegatedCapacity
from agent.journal import Journal
from agent.link import PooldLink
from agent.local_grants import LocalGrants
from agent.metrics import start_metrics_server
from agent.peer import Peer
from agent.service import AgentService
from poold.api.client import PooldClient
from poold.errors import DelegationExpired, PoolError
from poold.wire.agent import GrantReply, GrantRequest
from poold.wire.delegation import Budget, Delegation, Reservation
from tests.agent.conftest import emulated_device, linked_agent
from tests.conftest import ThreadedServer

MiB = 1 << 20


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def delegation(ttl_s: float = 600, length: int = 64 * MiB) -> Delegation:
    now = datetime.now(UTC)
    return Delegation(
        server_time=now,
        reservations=[
            Reservation(
                id="r1",
                device_uid="emulated:h1",
                kind="emulated",
                media="emulated",
                health="ok",
                alignment_bytes=2 * MiB,
                offset_bytes=0,
                length_bytes=length,
                epoch_base=1000,
                expires_at=now + timedelta(seconds=ttl_s),
            )
        ],
        budgets=[
            Budget(
                tenant="t",
                bytes=1 << 30,
                leases=1000,
                allowed_uids=[os.getuid()],
                expires_at=now + timedelta(seconds=ttl_s),
            )
        ],
    )


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[object]:
    made: list[tuple[AgentService, PooldClient]] = []
    url = f"http://127.0.0.1:{_closed_port()}"

    def make() -> AgentService:
        client = PooldClient(url, "x" * 32, timeout_s=0.2)
        link = PooldLink(client, "test", grant_patience_s=0.3)
        service = AgentService("h1", link, {"emulated": EmulatedBackend()})  # type: ignore[dict-item]
        service.journal = Journal(tmp_path / "state" / "journal.db")
        made.append((service, client))
        return service

    yield make
    for service, client in made:
        service.close()
        client.close()


PEER = Peer(connection_id=1, pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


def lease(service: AgentService, size_bytes: int, tenant: str) -> p.LeaseResult:
    """A lease served as the socket server serves one: the reply's fd sent, and the
    agent's copy of it closed (the tenant here keeps none)."""
    result, fd = service.lease(PEER, p.LeaseArgs(size_bytes=size_bytes, tenant=tenant))
    assert os.fstat(fd).st_size == result.length_bytes
    service.fd_sent(PEER, fd)
    return result


def test_local_grants_are_journalled_queued_and_requeued_after_a_restart(make_service) -> None:  # type: ignore[no-untyped-def]
    service: AgentService = make_service()
    service.adopt()
    service.delegation.replace(delegation())
    results = [lease(service, 2 * MiB, "t") for _ in range(3)]
    assert [r.epoch for r in results] == [1000, 1001, 1002]
    assert len({r.offset_bytes for r in results}) == 3
    service.release(PEER, p.ReleaseArgs(lease_id=results[0].lease_id))
    ops = [(op.op, op.lease_id) for op in service.link.ops.queued()]
    assert ops == [("local_grant", r.lease_id) for r in results] + [
        ("release", results[0].lease_id)
    ]
    # The released lease's budget is free once its release is queued (the outbox sends
    # the tenant's ops in order); its extent stays taken until poold has applied it.
    assert service.delegation.capacity.budget_used("t") == (4 * MiB, 2)
    assert service.delegation.capacity.free_reserved_bytes() == 58 * MiB
    service.close()

    again: AgentService = make_service()
    adopted, _orphaned = again.adopt()  # the holder (this process) lives
    assert adopted == 2
    replayed = [(op.op, op.lease_id) for op in again.link.ops.queued()]
    assert replayed == ops  # everything poold has not applied, in the same order
    assert {r.id for r in again.delegation.capacity.reservations()} == {"r1"}
    # The replayed release frees the budget again, not the extent.
    assert again.delegation.capacity.budget_used("t") == (4 * MiB, 2)
    assert again.delegation.capacity.free_reserved_bytes() == 58 * MiB
    # The journalled delegation is held again: a lease still fits, with a fresh epoch
    # on a free extent.
    result = lease(again, 2 * MiB, "t")
    assert result.epoch == 1003
    assert result.offset_bytes not in {r.offset_bytes for r in results}
    # poold applying them (as a flush would tell): the released extent is free, and
    # the log forgets what it needs no longer.
    again.delegation.on_delivered(list(again.link.ops.queued()))
    assert again.delegation.capacity.budget_used("t") == (6 * MiB, 3)
    assert again.journal is not None
    assert again.journal.local.state.pending == []


def test_past_the_ttl_local_grants_stop_with_delegation_expired(make_service) -> None:  # type: ignore[no-untyped-def]
    service: AgentService = make_service()
    service.adopt()
    service.delegation.replace(delegation(ttl_s=0.5))
    result = lease(service, 2 * MiB, "t")
    time.sleep(0.6)
    started = time.monotonic()
    with pytest.raises(DelegationExpired) as err:
        lease(service, 2 * MiB, "t")
    assert err.value.code == "delegation_expired"
    assert time.monotonic() - started < 5
    # The lease granted before the TTL is still held and still queued for poold.
    assert result.lease_id in service.held
    # (the failed central attempt carried it, and put it back in line)
    assert service.link.outbox_size() == 1
    assert service.link.queued_lease_ids() == {result.lease_id}


def test_a_local_grant_poold_refuses_at_commit_is_taken_back_and_the_tenant_told(
    api: ThreadedServer, admin: PooldClient
) -> None:
    """A delegation poold does not know (its reservation gone: a restored ledger, a
    reaped host): every local grant in it is refused at commit. The ledger has no row of
    such a lease, so no heartbeat would ever end it; the agent ends it at once, whether
    the refusal comes in a batch's answer or riding on a central grant."""
    with linked_agent(api.url, admin, emulated_device(256 * MiB), ["t"]) as linked:
        service, link = linked.service, linked.link
        service.delegation.replace(delegation())
        first = lease(service, 2 * MiB, "t")
        second = lease(service, 2 * MiB, "t")
        assert {op.op for op in link.ops.queued()} == {"local_grant"}
        told: list[tuple[str, str]] = []
        service.revocations.tell = lambda held, event: told.append(  # type: ignore[method-assign]
            (event.lease_id, getattr(event, "reason", ""))
        )
        link.flush()  # both refused in the batch's answer
        assert link.outbox_size() == 0
        for refused in (first, second):
            assert service.held.get(refused.lease_id) is None
            with pytest.raises(PoolError):
                service.renew(PEER, p.RenewArgs(lease_id=refused.lease_id))
        assert sorted(told) == sorted((x.lease_id, p.LOST_ENDED) for x in (first, second))
        assert service.delegation.capacity.budget_used("t") == (0, 0)
        # Riding on a central grant of its tenant (a lease the delegation cannot hold).
        third = lease(service, 2 * MiB, "t")
        central = lease(service, 96 * MiB, "t")
        assert service.held.get(third.lease_id) is None
        assert service.held.get(central.lease_id) is not None
        assert admin.show_lease(central.lease_id).state == "active"
        assert (third.lease_id, p.LOST_ENDED) in told


def test_a_central_grant_carries_its_tenants_ops_and_leaves_other_local_ones_to_the_flush(
    api: ThreadedServer, admin: PooldClient
) -> None:
    """A release queued before a central grant rides on it (its bytes and quota free in
    time): a central lease's, or a local lease's of the grant's own tenant (at its quota,
    releasing a local lease is what makes room). Other tenants' local leases' ops do not:
    they free nothing the grant can use, and riding on every central grant made each a
    batch of a few ops in poold."""
    with linked_agent(api.url, admin, emulated_device(256 * MiB), ["t", "u"]) as linked:
        service, link, client = linked.service, linked.link, linked.client
        service.delegation.replace(delegation())  # a budget of t only: u's leases go central
        carried: list[list[tuple[str, str]]] = []
        counted: list[tuple[int, int] | None] = []  # the local use each grant told poold
        grant = client.grant

        def granting(req: GrantRequest, **kw: Any) -> GrantReply:
            carried.append([(op.op, op.lease_id) for op in req.pending])
            use = req.local_use
            counted.append(None if use is None else (use.bytes, use.leases))
            return grant(req, **kw)

        client.grant = granting  # type: ignore[method-assign]
        local = lease(service, 2 * MiB, "t")
        big = lease(service, 8 * MiB, "u")
        service.release(PEER, p.ReleaseArgs(lease_id=local.lease_id))
        service.release(PEER, p.ReleaseArgs(lease_id=big.lease_id))
        again = lease(service, 8 * MiB, "u")
        assert carried == [[], [("release", big.lease_id)]]
        assert admin.show_lease(big.lease_id).state == "released"
        assert admin.show_lease(again.lease_id).state == "active"
        t_ops = [("local_grant", local.lease_id), ("release", local.lease_id)]
        assert [(op.op, op.lease_id) for op in link.ops.queued()] == t_ops
        # A central grant of t itself (larger than its reservation) takes them along.
        lease(service, 96 * MiB, "t")
        assert carried[-1] == t_ops
        assert link.outbox_size() == 0
        # The released local lease rode, applied before the grant: not counted as t's
        # local use (poold may spend the budget it held).
        assert counted[-1] == (0, 0)
        # Released, its ops on their way in a batch when t's next central grant leaves:
        # they cannot ride, so the count keeps the lease (poold leaves its commit room
        # in the budget the grant may spend, instead of refusing it when it lands).
        second = lease(service, 2 * MiB, "t")
        service.release(PEER, p.ReleaseArgs(lease_id=second.lease_id))
        on_its_way = link.ops.next_batch(link._tenant_of(), fresh=True)
        assert on_its_way is not None
        lease(service, 96 * MiB, "t")
        assert carried[-1] == [] and counted[-1] == (2 * MiB, 1)
        link.ops.put_back(on_its_way[0])
        link.flush()  # (this delegation is made up: poold refuses its commits)
        assert link.outbox_size() == 0


def test_grant_paths_reserved_bytes_and_uncommitted_leases_are_exported(make_service) -> None:  # type: ignore[no-untyped-def]
    """What an operator reads to see why leases go to poold: the attempts by path and
    reason, the reserved and free bytes, the local leases poold has not applied yet."""
    service: AgentService = make_service()
    service.adopt()
    served = start_metrics_server(service, "127.0.0.1", 0)

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{served.url}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def attempts(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], reason: str) -> float:
        path = "local" if reason == "" else "central"
        return m[("pool_agent_grant_attempts_total", (("path", path), ("reason", reason)))]

    try:
        before = scrape()
        # Exported from the start, every reason at zero; no reservation held, no TTL.
        assert attempts(before, "") == 0 and attempts(before, "no_room") == 0
        assert before[("pool_agent_reserved_bytes", ())] == 0
        assert ("pool_agent_delegation_expires_in_seconds", ()) not in before
        with pytest.raises(PoolError):  # nothing delegated yet, and poold is down
            lease(service, 2 * MiB, "t")
        service.delegation.replace(delegation())
        lease(service, 2 * MiB, "t")
        with pytest.raises(PoolError):  # no budget for u here: poold's to answer
            lease(service, 2 * MiB, "u")
        with pytest.raises(PoolError):  # larger than the reservation
            lease(service, 128 * MiB, "t")
        after = scrape()
        assert attempts(after, "no_reservation") == 1
        assert attempts(after, "") == 1
        assert attempts(after, "no_budget") == 1
        assert attempts(after, "no_room") == 1
        assert attempts(after, "budget_bytes") == 0
        assert after[("pool_agent_reserved_bytes", ())] == 64 * MiB
        assert after[("pool_agent_reserved_free_bytes", ())] == 62 * MiB
        assert after[("pool_agent_local_leases_uncommitted", ())] == 1
        assert 590 < after[("pool_agent_delegation_expires_in_seconds", ())] <= 600
    finally:
        served.close()


def test_a_recall_waits_for_the_first_step_that_starts_after_it() -> None:
    """A step already running may have read its wants before the recall: the request
    waits for the next one to end; with no step coming it gives up in time and the
    recall is forgotten."""

    class Link:
        local: object = None
        on_delegation: object = None

        def __init__(self) -> None:
            self.woken = threading.Event()

        def wake_delegation(self) -> None:
            self.woken.set()

    d = DelegatedCapacity("h1")
    link = Link()
    grants = LocalGrants(d, link, held=None)  # type: ignore[arg-type]
    running = threading.Event()
    release = threading.Event()
    steps: list[str] = []

    def one_step() -> None:
        running.set()
        release.wait(5)
        steps.append("step")

    grants._step = one_step  # type: ignore[method-assign]
    first = threading.Thread(target=grants.step)
    first.start()
    assert running.wait(5)  # a step is running: the recall must not count its end
    started = time.monotonic()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(grants._after_next_step(5.0)))
    waiter.start()
    assert link.woken.wait(5)
    release.set()
    first.join(5)
    time.sleep(0.2)
    assert result == []  # the running step ended; the next has not
    grants.step()  # the delegation loop's next step
    waiter.join(5)
    assert result == [True] and steps == ["step", "step"]
    assert time.monotonic() - started < 5
    # No step comes: it gives up after its time.
    t0 = time.monotonic()
    assert grants._after_next_step(0.3) is False
    assert 0.25 < time.monotonic() - t0 < 2
