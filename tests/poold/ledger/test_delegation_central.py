"""Does a budget leave its own host's central path, and other hosts of its tenant, room?

A central grant asked by the host that holds the tenant's budget spends that budget
(never below what the host granted locally, with an event), so a tenant whose budget
holds its whole quota still gets central grants from that host; racing local grants
never push the quota over. A second host of the tenant is not starved: the first hears
its fair share and asks less, and the second gets the rest (SQLite and PostgreSQL).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from sqlalchemy import select

from poold.errors import QuotaExceeded
from poold.ledger import budget_sizing, delegation, granting, heartbeat, leases, op_batches, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Event, Lease
from poold.wire.admin import TenantUpdate
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp, LocalUse
from poold.wire.delegation import BudgetWant, Delegation, DelegationRequest, ReserveWant
from tests.poold.conftest import UID, MiB, at_once, device, local_grant_op, seed


def _delegate(ledger: Ledger, host: str = "h1", **kw: object) -> Delegation:
    return delegation.delegate(ledger, host, DelegationRequest(**kw), f"agent:{host}")  # type: ignore[arg-type]


def _grant(size_bytes: int = 2 * MiB) -> GrantRequest:
    return GrantRequest(tenant="t1", size_bytes=size_bytes, uid=UID, pid=1, ttl_s=60, activate=True)


def _budget(ledger: Ledger, host_id: int = 1) -> tuple[int, int] | None:
    with ledger.read() as s:
        row = s.execute(
            select(Budget.bytes, Budget.leases).where(Budget.host_id == host_id)
        ).one_or_none()
    return None if row is None else (int(row[0]), int(row[1]))


def _use(ledger: Ledger) -> tuple[int, int]:
    with ledger.write_conn() as conn:
        use = granting.quota_use(conn, 1)
    return use.bytes(), use.leases()


def test_a_central_grant_spends_its_own_hosts_budget_never_past_the_quota(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=16 * MiB, quota_leases=4)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=2 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)],
    )
    assert [(b.bytes, b.leases) for b in d.budgets] == [(16 * MiB, 4)]
    # The reservation is spent by one local lease; the next request goes central.
    assert [
        r.code
        for r in op_batches.apply_ops(ledger, "h1", [local_grant_op(d, "L1", 0, epoch=0)], "a")
    ] == [None]
    lease = leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
    assert lease.reservation_id is None
    # Shrunk by what the grant needed: 2 MiB local + 4 MiB central + 10 MiB budget; the
    # reply says what it spent, so the agent's debit of its view is exactly that.
    assert _budget(ledger) == (12 * MiB, 3)
    assert lease.budget_spent is not None
    assert (lease.budget_spent.bytes, lease.budget_spent.leases) == (4 * MiB, 1)
    assert _use(ledger) == (16 * MiB, 4)
    with ledger.read() as s:
        spent = s.execute(select(Event.detail).where(Event.kind == "budget.spend")).scalars().all()
    assert [(e["spent_bytes"], e["spent_leases"], e["length_bytes"]) for e in spent] == [
        (4 * MiB, 1, 4 * MiB)
    ]
    leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
    leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
    assert _budget(ledger) == (6 * MiB, 1)
    assert _use(ledger) == (16 * MiB, 4)
    # Its one lease is the local lease it holds: never spent, so this is refused, and
    # nothing was spent by the refusal.
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
    assert _budget(ledger) == (6 * MiB, 1)
    # The agent learns the smaller budget from its next heartbeat reply.
    reply = heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")
    assert reply.delegation is not None
    assert [(b.bytes, b.leases) for b in reply.delegation.budgets] == [(6 * MiB, 1)]


def test_a_budget_spent_by_local_grants_is_not_spent_again(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=16 * MiB, quota_leases=16)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=16 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=16 * MiB, leases=16)],
    )
    ops = [local_grant_op(d, f"L{i}", i * 2 * MiB, epoch=i) for i in range(6)]
    assert all(r.code is None for r in op_batches.apply_ops(ledger, "h1", ops, "agent:h1"))
    # 12 MiB granted locally: a central 6 MiB would need 2 MiB more than the budget has.
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h1", _grant(6 * MiB), "agent:h1")
    assert _budget(ledger) == (16 * MiB, 16)
    leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
    assert _budget(ledger) == (12 * MiB, 15)
    assert _use(ledger) == (16 * MiB, 16)


def test_a_grant_says_it_spent_nothing_and_a_replay_says_the_same(ledger: Ledger) -> None:
    """A central grant the quota had room for spent none of the host's budget: its reply
    says [0, 0], so the agent lowers its view by nothing; a retry under the same request
    id gets the first answer, that included."""
    seed(ledger, quota_bytes=1 << 30, quota_leases=100)
    _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    req = _grant(4 * MiB).model_copy(update={"request_id": "r-0001"})
    first = leases.grant(ledger, "h1", req, "agent:h1")
    assert first.budget_spent is not None
    assert (first.budget_spent.bytes, first.budget_spent.leases) == (0, 0)
    assert _budget(ledger) == (64 * MiB, 16)
    again = leases.grant(ledger, "h1", req, "agent:h1")
    assert again == first


def test_central_grants_racing_local_grants_never_exceed_the_quota(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=24 * MiB, quota_leases=64, devices=[device(capacity_bytes=256 * MiB)])
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=24 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=24 * MiB, leases=64)],
    )
    over: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            used = _use(ledger)
            if used[0] > 24 * MiB:
                over.append(used)

    def local() -> object:
        for i in range(12):
            op_batches.apply_ops(
                ledger, "h1", [local_grant_op(d, f"L{i}", i * 2 * MiB, epoch=i)], "agent:h1"
            )
        return None

    def central() -> object:
        for _ in range(8):
            with contextlib.suppress(QuotaExceeded):
                leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
        return None

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        at_once(local, central, central)
    finally:
        stop.set()
        sampler.join()
    assert over == []
    used_bytes, _ = _use(ledger)
    assert used_bytes <= 24 * MiB
    budget = _budget(ledger)
    assert budget is not None
    with ledger.write_conn() as conn:
        use = granting.quota_use(conn, 1)
    # The budget never went under what was granted inside it.
    assert budget[0] >= use.local.get(1, (0, 0))[0]


def test_a_second_host_of_the_tenant_is_not_starved_by_the_first(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=32 * MiB, quota_leases=8)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    d1 = _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    assert [(b.bytes, b.leases, b.share_bytes) for b in d1.budgets] == [(32 * MiB, 8, None)]
    # h2 wants some: it gets none yet (h1 holds it all; only h1 lowers its own budget),
    # but now counts as a host of the tenant.
    assert (
        _delegate(ledger, "h2", budgets=[BudgetWant(tenant="t1", bytes=MiB, leases=1)]).budgets
        == []
    )
    # h1 hears its fair share; asking more keeps what it has, never less than it holds.
    reply = heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")
    assert reply.delegation is not None
    [b1] = reply.delegation.budgets
    assert (b1.bytes, b1.share_bytes, b1.share_leases) == (32 * MiB, 16 * MiB, 4)
    again = _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    assert [(b.bytes, b.leases) for b in again.budgets] == [(32 * MiB, 8)]
    # The delegate reply says the share as the heartbeat's does (from the quota use the
    # budgets were sized on, not read again).
    assert [(b.share_bytes, b.share_leases) for b in again.budgets] == [(16 * MiB, 4)]
    # h1 asks its share (as its agent does on hearing it); h2 then gets the rest.
    _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=16 * MiB, leases=4)])
    d2 = _delegate(ledger, "h2", budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    assert [(b.bytes, b.leases) for b in d2.budgets] == [(16 * MiB, 4)]
    assert _use(ledger) == (32 * MiB, 8)
    # And each host's central grants spend its own budget.
    leases.grant(ledger, "h2", _grant(4 * MiB), "agent:h2")
    leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
    assert _use(ledger) == (32 * MiB, 8)
    # A host that no longer wants the tenant (asks 0) leaves the share to the other.
    _delegate(ledger, "h2", budgets=[BudgetWant(tenant="t1", bytes=0, leases=0)])
    assert _budget(ledger, 2) is None
    alone = _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=32 * MiB, leases=8)])
    assert [(b.bytes, b.share_bytes) for b in alone.budgets] == [(24 * MiB, None)]  # 8 central


# --- local grants poold has not heard of yet (issue 12: the concurrency run's races) ----


def test_a_central_grant_spends_only_past_the_local_use_the_agent_reports(
    ledger: Ledger,
) -> None:
    seed(ledger, quota_bytes=16 * MiB, quota_leases=4)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)],
    )
    assert [(b.bytes, b.leases) for b in d.budgets] == [(16 * MiB, 4)]
    # The agent has granted two 2 MiB leases locally; poold has heard of neither.
    reported = LocalUse(tenant="t1", bytes=4 * MiB, leases=2)
    lease = leases.grant(
        ledger, "h1", _grant(8 * MiB).model_copy(update={"local_use": reported}), "agent:h1"
    )
    assert lease.reservation_id is None
    assert _budget(ledger) == (8 * MiB, 3)  # not below the reported 4 MiB, 2 leases
    with pytest.raises(QuotaExceeded):  # what is left is the agent's own local use
        leases.grant(
            ledger, "h1", _grant(6 * MiB).model_copy(update={"local_use": reported}), "agent:h1"
        )
    assert _budget(ledger) == (8 * MiB, 3)
    # Both commits later: inside the budget left.
    ops = [local_grant_op(d, "L1", 0, epoch=0), local_grant_op(d, "L2", 2 * MiB, epoch=1)]
    assert [r.code for r in op_batches.apply_ops(ledger, "h1", ops, "agent:h1")] == [None, None]
    assert _use(ledger) == (16 * MiB, 4)
    # Another tenant's count says nothing of this one.
    other = LocalUse(tenant="t2", bytes=4 * MiB, leases=2)
    assert other.use_for("t1") is None


def test_a_local_grant_past_a_lowered_budget_is_kept_while_the_quota_has_room(
    ledger: Ledger,
) -> None:
    seed(ledger, quota_bytes=16 * MiB, quota_leases=8)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    assert [(b.bytes, b.leases) for b in d.budgets] == [(4 * MiB, 2)]
    # The agent granted three before hearing that its budget is 2 leases: the third
    # fits the quota, so it is kept.
    ops = [local_grant_op(d, f"L{i}", 2 * MiB * i, epoch=i) for i in range(3)]
    assert [r.code for r in op_batches.apply_ops(ledger, "h1", ops, "agent:h1")] == [None] * 3
    assert _budget(ledger) == (4 * MiB, 2)  # left as it is: the lease counts itself
    assert _use(ledger) == (6 * MiB, 3)
    with ledger.read() as s:
        kept = s.execute(select(Event.detail).where(Event.kind == "budget.overrun")).scalars()
        assert [(e["local_bytes"], e["local_leases"], e["lease_id"]) for e in kept] == [
            (6 * MiB, 3, "L2")
        ]
    # Central leases fill the rest of the quota: a fourth local grant no longer fits it.
    leases.grant(ledger, "h1", _grant(8 * MiB), "agent:h1")
    leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
    assert _use(ledger) == (16 * MiB, 5)
    [result] = op_batches.apply_ops(
        ledger, "h1", [local_grant_op(d, "L3", 6 * MiB, epoch=3)], "agent:h1"
    )
    assert result.code == "budget_exceeded"
    assert _use(ledger) == (16 * MiB, 5)


def test_a_heartbeat_does_not_call_a_lease_it_has_not_heard_of_ended(ledger: Ledger) -> None:
    seed(ledger)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    [ok] = op_batches.apply_ops(ledger, "h1", [local_grant_op(d, "L1", 0, epoch=0)], "agent:h1")
    assert ok.code is None
    leases.end(ledger, "L1", leases.LeaseEvent.RELEASE, "agent:h1", host_name="h1")
    # L2 is a local grant whose local_grant is still queued: not ended. L1 is.
    reply = heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(held=["L1", "L2"]), "agent:h1")
    assert [r.lease_id for r in reply.revocations] == ["L1"]
    [late] = op_batches.apply_ops(
        ledger, "h1", [local_grant_op(d, "L2", 2 * MiB, epoch=1)], "agent:h1"
    )
    assert (late.code, late.state) == (None, "active")


def test_a_quota_cut_leaves_each_host_its_fair_share_first(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=256 * MiB, quota_leases=64)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    d1 = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)],
    )
    _delegate(ledger, "h2", budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=16)])
    # h1 granted one lease poold has not heard of: poold sees no use there at all.
    tenants.update_tenant(
        ledger,
        "t1",
        TenantUpdate(quota_bytes=8 * MiB, quota_leases=4),
        "admin",
        budget_sizing.claw_back,
    )
    assert _budget(ledger, 1) == (4 * MiB, 2) and _budget(ledger, 2) == (4 * MiB, 2)
    [late] = op_batches.apply_ops(ledger, "h1", [local_grant_op(d1, "L1", 0, epoch=0)], "agent:h1")
    assert (late.code, late.state) == (None, "active")


@pytest.mark.parametrize("second", ["L0", "L2"])  # sorting before and after the first
def test_a_batch_grant_may_spend_the_budget_a_lease_released_in_it_freed(
    ledger: Ledger, second: str
) -> None:
    """The agent spends a released local lease's budget at once (agent/local_leases.py):
    one batch may hold a lease's grant and release and, after them, another grant of the
    same tenant on that budget. Applied in the order queued, whatever the lease ids, and
    the release counts: both grants are recorded, the quota never passed."""
    seed(ledger, quota_bytes=4 * MiB, quota_leases=1)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=1)],
    )
    assert [(b.bytes, b.leases) for b in d.budgets] == [(4 * MiB, 1)]
    ops = [
        local_grant_op(d, "L1", 0, epoch=0),
        LeaseOp(lease_id="L1", op="release", reason="holder released"),
        local_grant_op(d, second, 2 * MiB, epoch=1),
    ]
    results = op_batches.apply_ops(ledger, "h1", ops, "agent:h1")
    assert [(r.lease_id, r.code) for r in results] == [("L1", None), ("L1", None), (second, None)]
    assert _use(ledger) == (4 * MiB, 1)  # the budget, which the live lease spends
    with ledger.read() as s:
        states = dict(s.execute(select(Lease.id, Lease.state)).all())
    assert states == {"L1": "released", second: "active"}
