"""Does one batch of local grants check each against what the grants before it in the
same batch spent? (poold/ledger/local_commit.py reads the tenant, reservation, budget and
local use once per batch: SQLite and PostgreSQL.)"""

from __future__ import annotations

from sqlalchemy import func, select

from poold.ledger import budget_sizing, delegation, op_batches, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Event, Lease, Tenant
from poold.wire.admin import TenantUpdate
from poold.wire.agent import LeaseOp
from poold.wire.delegation import BudgetWant, Delegation, DelegationRequest, ReserveWant
from tests.poold.conftest import MiB, at_once, device, local_grant_op, seed


def _ops(ledger: Ledger, ops: list[LeaseOp]) -> list[tuple[str | None, str | None]]:
    return [(r.state, r.code) for r in op_batches.apply_ops(ledger, "h1", ops, "agent:h1")]


def _generation(ledger: Ledger) -> int:
    with ledger.read() as s:
        return int(s.scalar(select(Tenant.generation).where(Tenant.name == "t1")) or 0)


def _delegated(ledger: Ledger, *, reserve: int, budget: int, leases: int) -> Delegation:
    """Host h1's delegation: one reservation, and a budget of tenant t1."""
    return delegation.delegate(
        ledger,
        "h1",
        DelegationRequest(
            reserve=[ReserveWant(bytes=reserve)],
            budgets=[BudgetWant(tenant="t1", bytes=budget, leases=leases)],
        ),
        "agent:h1",
    )


def test_a_batch_spends_the_budget_grant_by_grant_and_frees_before_it_grants(
    ledger: Ledger,
) -> None:
    # The quota is the budget: a grant past the budget cannot be kept as an overrun.
    seed(ledger, quota_bytes=6 * MiB, quota_leases=3)
    d = _delegated(ledger, reserve=16 * MiB, budget=6 * MiB, leases=3)
    before = _generation(ledger)
    first = [local_grant_op(d, f"L{i}", i * 2 * MiB, epoch=i) for i in range(5)]
    assert _ops(ledger, first) == [("active", None)] * 3 + [(None, "budget_exceeded")] * 2
    assert _generation(ledger) == before + 1  # one swap for the batch's grants
    with ledger.read() as s:
        live = s.scalars(select(Lease.id).where(Lease.state == "active").order_by(Lease.id))
        assert list(live) == ["L0", "L1", "L2"]
        assert s.scalar(select(func.count()).select_from(Event)) >= 6
    # A release in the batch frees its budget for the batch's grants (they go after it),
    # and the second grant meets the budget the first spent.
    second = [
        local_grant_op(d, "L5", 5 * 2 * MiB, epoch=5),
        LeaseOp(lease_id="L0", op="release", reason="released"),
        local_grant_op(d, "L6", 6 * 2 * MiB, epoch=6),
    ]
    assert _ops(ledger, second) == [("active", None), ("released", None), (None, "budget_exceeded")]
    # A replay of the whole batch answers the same and changes nothing.
    assert _ops(ledger, second)[0] == ("active", None)
    with ledger.read() as s:
        live = s.scalars(select(Lease.id).where(Lease.state == "active").order_by(Lease.id))
        assert list(live) == ["L1", "L2", "L5"]


def test_budget_a_quota_cut_could_not_claw_back_is_not_spent_again_once_freed(
    ledger: Ledger,
) -> None:
    """A cut below what the tenant already holds takes its budget below that local use
    (poold/ledger/budget_sizing.py `claw_back`), so that once those leases end the freed
    budget is not granted into again: that would take the tenant's real holdings back
    over its new quota (seen in the 4-agent delegation run)."""
    seed(ledger, quota_bytes=64 * MiB, quota_leases=32)
    d = _delegated(ledger, reserve=32 * MiB, budget=16 * MiB, leases=8)
    held = [local_grant_op(d, f"L{i}", i * 2 * MiB, epoch=i) for i in range(8)]
    assert _ops(ledger, held) == [("active", None)] * 8
    tenants.update_tenant(
        ledger,
        "t1",
        TenantUpdate(quota_bytes=8 * MiB, quota_leases=4),
        "admin",
        budget_sizing.claw_back,
    )
    with ledger.read() as s:  # below what is held: the agent may not grant into it
        assert list(s.execute(select(Budget.bytes, Budget.leases))) == [(8 * MiB, 4)]
    freed = [LeaseOp(lease_id=f"L{i}", op="release", reason="released") for i in range(6)]
    assert _ops(ledger, freed) == [("released", None)] * 6
    # 2 leases (4 MiB) held against a quota of 4 leases (8 MiB): two more fit, not six.
    again = [local_grant_op(d, f"M{i}", i * 2 * MiB, epoch=8 + i) for i in range(6)]
    assert _ops(ledger, again) == [("active", None)] * 2 + [(None, "budget_exceeded")] * 4
    with ledger.read() as s:
        live = s.execute(
            select(func.count(), func.sum(Lease.length_bytes)).where(Lease.state == "active")
        ).one()
        assert tuple(live) == (4, 8 * MiB)
        assert list(s.execute(select(Budget.bytes, Budget.leases))) == [(8 * MiB, 4)]


def test_a_lease_granted_and_released_in_one_batch_is_recorded_as_two_batches_would(
    ledger: Ledger,
) -> None:
    """The batch reads its grants' rows once and an op on a lease it just inserted reads
    no row: the result, the lease row and the events are those of two batches. A grant
    sent twice in one batch is recorded once (the second is a replay), and one sent with
    other fields is refused."""
    seed(ledger, quota_bytes=64 * MiB, quota_leases=10)
    d = _delegated(ledger, reserve=16 * MiB, budget=16 * MiB, leases=8)
    ops = [
        local_grant_op(d, "A", 0, epoch=0),
        LeaseOp(lease_id="A", op="release", reason="released"),
        local_grant_op(d, "B", 2 * MiB, epoch=1),
        local_grant_op(d, "B", 2 * MiB, epoch=1),
        local_grant_op(d, "B", 4 * MiB, epoch=1),
        local_grant_op(d, "C", 4 * MiB, epoch=2),
    ]
    got = _ops(ledger, ops)
    assert got[:4] == [("active", None), ("released", None), ("active", None), ("active", None)]
    assert got[4] == (None, "local_grant_mismatch")
    assert got[5] == ("active", None)
    with ledger.read() as s:
        rows = {x.id: x for x in s.execute(select(Lease.id, Lease.state, Lease.ended_at))}
        assert {k: v.state for k, v in rows.items()} == {
            "A": "released",
            "B": "active",
            "C": "active",
        }
        assert rows["A"].ended_at is not None
        kinds = s.scalars(select(Event.kind).where(Event.lease_id == "A").order_by(Event.id))
        assert list(kinds) == ["lease.grant", "lease.activate", "lease.release"]
        kinds = s.scalars(select(Event.kind).where(Event.lease_id == "B").order_by(Event.id))
        assert list(kinds) == ["lease.grant", "lease.activate"]  # recorded once


def test_a_lease_shrunk_then_released_in_one_batch_frees_only_what_it_held(
    ledger: Ledger,
) -> None:
    """Found by review: the batch's copy of a lease it granted kept its length across a
    shrink, so its release then freed the bytes the shrink had already freed, and later
    grants of the batch passed a budget (here the quota) they exceeded."""
    seed(ledger, quota_bytes=6 * MiB, quota_leases=10)
    d = _delegated(ledger, reserve=16 * MiB, budget=6 * MiB, leases=10)
    ops = [
        local_grant_op(d, "S", 0, length=4 * MiB, epoch=0),
        LeaseOp(lease_id="S", op="shrink", length_bytes=2 * MiB, reason="gave back"),
        LeaseOp(lease_id="S", op="release", reason="released"),
        local_grant_op(d, "X", 4 * MiB, length=4 * MiB, epoch=1),
        local_grant_op(d, "Y", 8 * MiB, length=4 * MiB, epoch=2),
    ]
    got = _ops(ledger, ops)
    assert got[:4] == [("active", None)] * 2 + [("released", None), ("active", None)]
    assert got[4] == (None, "budget_exceeded")
    with ledger.read() as s:
        live = s.execute(select(Lease.id, Lease.length_bytes).where(Lease.state == "active"))
        assert sorted(live) == [("X", 4 * MiB)]


def test_an_overlapping_local_grant_is_refused_alone_the_rest_of_its_batch_kept(
    ledger: Ledger,
) -> None:
    """On PostgreSQL a batch's first attempt leaves the overlap check to the exclusion
    constraint; the constraint refusing the batch runs it again checking each grant. Either
    way: the overlapping grant alone is refused, with nothing of it written."""
    seed(ledger)
    d = _delegated(ledger, reserve=16 * MiB, budget=16 * MiB, leases=8)
    assert _ops(ledger, [local_grant_op(d, "A", 0)]) == [("active", None)]
    batch = [
        local_grant_op(d, "B", 2 * MiB, epoch=1),
        local_grant_op(d, "C", 0, epoch=2),  # overlaps A
        local_grant_op(d, "D", 4 * MiB, epoch=3),
        local_grant_op(d, "E", 4 * MiB, epoch=4),  # overlaps D, granted in this batch
    ]
    assert _ops(ledger, batch) == [
        ("active", None),
        (None, "lease_overlap"),
        ("active", None),
        (None, "lease_overlap"),
    ]
    with ledger.read() as s:
        assert sorted(s.scalars(select(Lease.id))) == ["A", "B", "D"]
        kinds = s.execute(select(Event.lease_id, Event.kind).where(Event.lease_id.is_not(None)))
        by_lease: dict[str, list[str]] = {}
        for lease_id, kind in kinds:
            by_lease.setdefault(lease_id, []).append(kind)
    assert by_lease == {lid: ["lease.grant", "lease.activate"] for lid in ("A", "B", "D")}


def test_one_local_grant_committed_by_two_batches_at_once_is_recorded_once(
    ledger: Ledger,
) -> None:
    """An agent that resends an outbox batch through another poold while the first is still
    running: two transactions commit the same local grant at once. One records it, the
    other answers it as a replay (no duplicate key, no overlap refusal)."""
    seed(
        ledger, devices=[device(capacity_bytes=4096 * MiB)], quota_leases=1000, quota_bytes=1 << 40
    )
    d = _delegated(ledger, reserve=512 * MiB, budget=512 * MiB, leases=500)
    for i in range(40):
        ops = [local_grant_op(d, f"R{i}", i * 2 * MiB, epoch=i)]
        first, second = at_once(
            lambda ops=ops: _ops(ledger, ops), lambda ops=ops: _ops(ledger, ops)
        )
        assert first == second == [("active", None)], i
    with ledger.read() as s:
        assert s.scalar(select(func.count()).select_from(Lease)) == 40
        grants = s.scalar(select(func.count()).where(Event.kind == "lease.grant"))
    assert grants == 40
