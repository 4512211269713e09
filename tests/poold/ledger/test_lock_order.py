"""Do the ledger's writers lock shared rows in one order? On PostgreSQL.

The hold pushes every active lease of a silent host in one transaction; a release
batch of the same host ends some of them in another. Each used to lock the rows in
its own order (the UPDATE's scan order, the outbox order), and PostgreSQL broke the
cycle by aborting one, which reached the agent as `internal`. Now both lock in lease
id order, and a deadlock that still happens is retried inside the ledger: the race,
run many times with the batch in reverse id order, never reaches either caller.
"""

from __future__ import annotations

import functools
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import select, text

from poold.ledger import delegation, leases, op_batches, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Host, Lease
from poold.ledger.reaper import Reaper, ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, LeaseOp
from poold.wire.delegation import BudgetWant, DelegationRequest, ReserveWant
from tests.poold.conftest import UID, MiB, at_once, device, local_grant_op, seed

pytestmark = pytest.mark.postgres

ITERATIONS = 200
LEASES = 24


def test_hold_and_release_batch_never_fail(ledger: Ledger) -> None:
    if ledger.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: it cannot deadlock")
    seed(ledger, devices=[device(capacity_bytes=1 << 40)], quota_bytes=1 << 45, quota_leases=10**6)
    with ledger.read() as s:
        host_id = int(s.scalar(select(Host.id)) or 0)
    reaper = Reaper(ledger, ReaperPolicy())
    req = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, ttl_s=60, activate=True)
    for iteration in range(ITERATIONS):
        ids = [leases.grant(ledger, "h1", req, "agent:h1").id for _ in range(LEASES)]
        # Release every other lease, highest id first: the opposite of the hold's order.
        ops = [LeaseOp(lease_id=x, op="release") for x in sorted(ids, reverse=True)[::2]]
        try:
            _, released = at_once(
                lambda: reaper.hold_host(host_id, utcnow() + timedelta(hours=1)),
                functools.partial(op_batches.apply_ops, ledger, "h1", ops, "agent:h1"),
            )
        except AssertionError as exc:
            raise AssertionError(f"iteration {iteration}: {exc}") from None
        assert [getattr(r, "code", None) for r in released] == [None] * len(ops)
    with ledger.read() as s:
        live = s.scalar(
            select(Lease.id).where(Lease.state == "active", Lease.expires_at < utcnow()).limit(1)
        )
    assert live is None


def _deadlocks(ledger: Ledger) -> int:
    """Deadlocks PostgreSQL has broken in this database (its statistics, flushed first)."""
    time.sleep(1.2)  # a backend's pending statistics reach shared memory within a second
    with ledger.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            ).scalar_one()
        )


TENANTS = ("t1", "t2", "t3")
ROUNDS = 40


def test_local_commits_of_two_hosts_and_central_grants_take_one_lock_order(
    ledger: Ledger,
) -> None:
    """Two hosts' op batches, each granting locally to the same tenants (in opposite lease
    id order) and releasing a central lease of its device, beside central grants to those
    tenants on the same devices: the batches lock their tenants by name after their
    leases, and lock no device (freeing moves no generation), while a grant locks device
    then tenant. No deadlock is even detected (and retried) by PostgreSQL; every op and
    grant succeeds."""
    if ledger.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: it cannot deadlock")
    seed(ledger, devices=[device(capacity_bytes=1 << 40)], tenant=None)
    seed(ledger, host="h2", devices=[device("dev-1", capacity_bytes=1 << 40)], tenant=None)
    with ledger.write() as session:
        for name in TENANTS:
            tenants.create(
                session,
                TenantSpec(name=name, quota_bytes=1 << 39, quota_leases=10**6, allowed_uids=[UID]),
                "test",
            )
    wants = [BudgetWant(tenant=t, bytes=1 << 36, leases=100_000) for t in TENANTS]
    held = {
        h: delegation.delegate(
            ledger,
            h,
            DelegationRequest(reserve=[ReserveWant(bytes=1 << 36)], budgets=wants),
            f"agent:{h}",
        )
        for h in ("h1", "h2")
    }

    def central(host: str, tenant: str) -> str:
        req = GrantRequest(
            tenant=tenant, size_bytes=2 * MiB, uid=UID, pid=1, ttl_s=60, activate=True
        )
        return leases.grant(ledger, host, req, f"agent:{host}").id

    before = _deadlocks(ledger)
    for i in range(ROUNDS):
        batches = {}
        for host, order in (("h1", TENANTS), ("h2", TENANTS[::-1])):
            # Lease ids sort in `order`: the old code swapped the tenants in that order.
            grants = [
                local_grant_op(
                    held[host],
                    f"{host}-{i:03d}-{k}",
                    (i * 3 + k) * 2 * MiB,
                    epoch=i * 3 + k,
                    tenant=t,
                )
                for k, t in enumerate(order)
            ]
            freed = LeaseOp(lease_id=central(host, order[0]), op="release")
            batches[host] = [freed, *grants]
        results = at_once(
            functools.partial(op_batches.apply_ops, ledger, "h1", batches["h1"], "agent:h1"),
            functools.partial(op_batches.apply_ops, ledger, "h2", batches["h2"], "agent:h2"),
            functools.partial(central, "h1", "t3"),
            functools.partial(central, "h2", "t1"),
        )
        for answered in results[:2]:
            assert [r.code for r in answered] == [None] * 4, (i, answered)
    assert _deadlocks(ledger) == before


def test_a_long_batch_is_not_starved_by_central_grants_of_its_tenant(ledger: Ledger) -> None:
    """Central grants of a tenant swap its generation many times a second; a batch of
    many local grants for that tenant holds the tenant's row from its start, so the
    grants wait for it rather than make it lose its swap again and again
    (`generation_conflict` after 16 reruns)."""
    if ledger.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: nothing runs beside a batch")
    seed(ledger, devices=[device(capacity_bytes=1 << 40)], quota_bytes=1 << 39, quota_leases=10**6)
    seed(ledger, host="h2", devices=[device("dev-1", capacity_bytes=1 << 40)], tenant=None)
    held = delegation.delegate(
        ledger,
        "h2",
        DelegationRequest(
            reserve=[ReserveWant(bytes=1 << 36)],
            budgets=[BudgetWant(tenant="t1", bytes=1 << 36, leases=100_000)],
        ),
        "agent:h2",
    )
    stop = threading.Event()
    req = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, ttl_s=60, activate=True)

    def grants() -> int:
        n = 0
        while not stop.is_set():
            leases.grant(ledger, "h1", req, "agent:h1")
            n += 1
        return n

    def batches() -> None:
        try:
            for b in range(8):
                ops = [
                    local_grant_op(
                        held, f"B{b:02d}-{k:03d}", (b * 60 + k) * 2 * MiB, epoch=b * 60 + k
                    )
                    for k in range(60)
                ]
                answered = op_batches.apply_ops(ledger, "h2", ops, "agent:h2")
                assert [r.code for r in answered] == [None] * len(ops)
        finally:
            stop.set()

    granted, granted_too, _ = at_once(grants, grants, batches)
    assert granted + granted_too > 0


def test_a_delegate_waits_for_a_batch_holding_its_tenant_instead_of_rerunning(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op batch holds the row of a tenant it grants to until it commits, and swaps its
    generation. A delegate changing that tenant's budget meanwhile reads the tenant under
    its row lock (name order, as the batch): it waits for the batch and then swaps the
    generation the batch left, instead of reading the old one, losing its swap at the
    batch's commit and running the whole delegate again."""
    if ledger.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: nothing runs beside a delegate")
    seed(ledger, devices=[device(capacity_bytes=1 << 40)], quota_bytes=1 << 39, quota_leases=10**6)
    runs = 0
    once = delegation._delegate_once

    def counted(*args: object, **kw: object) -> object:
        nonlocal runs
        runs += 1
        return once(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(delegation, "_delegate_once", counted)
    want = DelegationRequest(budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    with ledger.engine.connect() as batch:
        # What a batch granting to t1 holds from its first statement to its commit.
        batch.execute(text("UPDATE tenants SET generation = generation + 1 WHERE name = 't1'"))
        asked = threading.Thread(target=delegation.delegate, args=(ledger, "h1", want, "agent:h1"))
        asked.start()
        time.sleep(0.5)  # the delegate is waiting for the row now
        batch.commit()
    asked.join(30)
    assert not asked.is_alive()
    assert runs == 1
    with ledger.read() as s:
        assert s.scalar(select(Budget.bytes)) == 64 * MiB
