"""The agent's own view of what it may spend, without poold: a central grant lowers the
tenant's budget view before it leaves and no reply that left poold earlier raises it
back; a smaller budget asked for caps the view at once; a fair share caps what is asked;
a reservation poold stops listing is given back once empty, and a given-back one never
comes back from a stale reply; after one is asked back, that media is not refilled."""

from __future__ import annotations

from agent.delegation import RECALL_COOLDOWN_S, DelegatedCapacity
from agent.refill import RefillPolicy
from tests.agent.test_delegation import (
    Clock,
    MiB,
    ask,
    budget,
    delegation,
    reservation,
)


def _capacity(clock: Clock, **kw: object) -> DelegatedCapacity:
    return DelegatedCapacity("h1", clock=clock, **kw)  # type: ignore[arg-type]


def test_a_central_grant_lowers_the_view_until_a_later_reply_says_it() -> None:
    clock = Clock()
    d = _capacity(clock)
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=8 * MiB, leases=4)]), sent_at=1.0
    )
    assert d.budget_view("kv") == (8 * MiB, 4)
    limit = d.debit(ask(3 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert limit is not None
    assert d.budget_view("kv") == (4 * MiB, 3)  # rounded up to the alignment
    # Meanwhile only what is left locally goes.
    assert d.grant_locally(ask(4 * MiB, tenant="kv")) is not None
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is None
    clock.now += 1
    d.settle(limit, 4 * MiB, known=True)
    # poold shrank the budget to 4 MiB; a reply whose request left before the grant came
    # back still says 8 MiB: the view stays lowered.
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=8 * MiB, leases=4)]),
        sent_at=clock.now - 0.5,
    )
    assert d.budget_view("kv") == (4 * MiB, 3)
    # A reply to a request sent after it does say it: the debit is gone.
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=4 * MiB, leases=3)]),
        sent_at=clock.now + 0.1,
    )
    assert d.budget_view("kv") == (4 * MiB, 3)
    # Without an answer the grant may still commit: its debit lasts longer.
    limit = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert limit is not None
    d.settle(limit, None, known=False)
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=4 * MiB, leases=3)]),
        sent_at=clock.now + 1,
    )
    assert d.budget_view("kv") == (2 * MiB, 2)
    # A grant that never left is forgotten at once; unnamed and no budget: no debit.
    other = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert other is not None
    d.drop(other)
    assert d.budget_view("kv") == (2 * MiB, 2)
    assert d.debit(ask(2 * MiB, uid=4242), alignment_bytes=2 * MiB) is None


def test_a_debit_taken_before_the_budget_came_holds_the_budget_down() -> None:
    """A central grant leaves while no budget of its tenant is held; the delegation that
    brings one left poold before the grant spent it (a delegate and a grant of one host
    take turns there): the budget it lists is already spent, and no local grant may
    take it."""
    clock = Clock()
    d = _capacity(clock)
    d.replace(delegation([reservation(length=16 * MiB)], []), sent_at=1.0)
    limit = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert limit is not None and limit.local_use == (0, 0)
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=8 * MiB, leases=1)]),
        sent_at=2.0,
    )
    assert d.budget_view("kv") == (6 * MiB, 0)
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is None
    clock.now += 1
    d.settle(limit, 2 * MiB, known=True)
    d.replace(  # a later reply says the spend
        delegation([reservation(length=16 * MiB)], [budget(bytes_=6 * MiB, leases=0)]),
        sent_at=clock.now + 0.1,
    )
    assert d.budget_view("kv") == (6 * MiB, 0)


def test_a_debit_carries_the_tenants_local_use_uncommitted_grants_included() -> None:
    """What the central request tells poold (GrantRequest.local_use): every local grant
    made before the debit, none after (those fit the lowered view)."""
    clock = Clock()
    d = _capacity(clock)
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=8 * MiB, leases=4)]), sent_at=1.0
    )
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is not None  # poold has not heard
    limit = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert limit is not None and limit.local_use == (2 * MiB, 1)
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is not None
    assert limit.local_use == (2 * MiB, 1)
    assert d.budget_view("kv") == (6 * MiB, 3)


def test_a_debit_counts_released_leases_until_poold_applies_their_release() -> None:
    """A released local lease's commit may still be queued, or on its way in a batch,
    when a central grant spends the tenant's budget here: poold must leave it room, or
    it refuses that commit (a lease its tenant used, lost from the ledger). Only the
    releases riding on the grant itself (applied before it) come off the count."""
    clock = Clock()
    d = _capacity(clock)
    d.replace(
        delegation([reservation(length=16 * MiB)], [budget(bytes_=8 * MiB, leases=4)]), sent_at=1.0
    )
    kept = d.grant_locally(ask(2 * MiB, tenant="kv"))
    gone = d.grant_locally(ask(4 * MiB, tenant="kv"))
    assert kept is not None and gone is not None
    d.released(gone.lease.id)  # queued, not yet applied by poold
    limit = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert limit is not None and limit.local_use == (6 * MiB, 2)
    assert d.released_among("kv", [gone.lease.id, kept.lease.id, "unknown"]) == (4 * MiB, 1)
    assert d.released_among("other", [gone.lease.id]) == (0, 0)
    d.delivered(gone.lease.id, "release")
    again = d.debit(ask(2 * MiB, tenant="kv"), alignment_bytes=2 * MiB)
    assert again is not None and again.local_use == (2 * MiB, 1)


def test_a_reply_to_an_older_request_is_dropped() -> None:
    clock = Clock()
    d = _capacity(clock)
    d.replace(delegation([reservation("r2")], [budget()]), sent_at=5.0)
    d.replace(delegation([reservation("r1")], [budget()]), sent_at=4.0)
    assert [r.id for r in d.reservations()] == ["r2"]


def test_asking_less_caps_the_view_and_a_fair_share_caps_the_ask() -> None:
    clock = Clock()
    d = _capacity(clock, policy=RefillPolicy(min_reserve_bytes=8 * MiB, min_budget_leases=4))
    b = budget(bytes_=64 * MiB, leases=32).model_copy(
        update={"share_bytes": 16 * MiB, "share_leases": 8}
    )
    d.replace(delegation([reservation(length=32 * MiB)], [b]), sent_at=1.0)
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is not None
    want = d.wants()
    assert want is not None
    # Other hosts of the tenant want some: no more than the share (8 MiB headroom + the
    # 2 MiB granted would fit in it, so that is asked).
    assert [(w.tenant, w.bytes, w.leases) for w in want.budgets] == [("kv", 10 * MiB, 5)]
    # The view drops to it before the request leaves, and stays there until a reply to
    # a later request (the budget is poold's to set as asked).
    assert d.budget_view("kv") == (10 * MiB, 5)
    d.asked(clock.now, ok=True)
    d.replace(delegation([reservation(length=32 * MiB)], [b]), sent_at=clock.now - 1)
    assert d.budget_view("kv") == (10 * MiB, 5)
    d.replace(
        delegation([reservation(length=32 * MiB)], [budget(bytes_=10 * MiB, leases=5)]),
        sent_at=clock.now + 1,
    )
    assert d.budget_view("kv") == (10 * MiB, 5)


def test_a_withdrawn_reservation_is_given_back_once_empty_and_not_refilled_for_a_while() -> None:
    clock = Clock()
    d = _capacity(clock, policy=RefillPolicy(min_reserve_bytes=8 * MiB))
    d.replace(delegation([reservation("r1"), reservation("r2", offset=0)], [budget()]), sent_at=1.0)
    plan = d.grant_locally(ask(2 * MiB, tenant="kv"))
    assert plan is not None
    busy = plan.grant.reservation_id
    empty = "r2" if busy == "r1" else "r1"
    # poold asked both back (pressure): neither takes a lease now.
    d.replace(delegation([], [budget()]), sent_at=2.0)
    assert d.has_withdrawn()
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is None
    d.note_demand("kv", "ddr5", 32 * MiB)
    want = d.wants()
    assert want is not None
    assert want.give_back == [empty]
    assert want.reserve == []  # that media was asked back just now
    assert d.asked(clock.now, ok=True) == [empty]
    # The busy one goes once its lease is freed (poold applied the release).
    d.delivered(
        plan.lease.lease_id if hasattr(plan.lease, "lease_id") else plan.lease.id, "release"
    )
    want = d.wants()
    assert want is not None and want.give_back == [busy]
    d.asked(clock.now, ok=True)
    # A reply that left before the give-back came back still lists it: ignored.
    d.replace(
        delegation([reservation(busy, offset=0 if busy == "r2" else 64 * MiB)], [budget()]),
        sent_at=3.0,
    )
    assert d.reservations() == []
    clock.now += RECALL_COOLDOWN_S + 1
    d.note_demand("kv", "ddr5", 32 * MiB)
    want = d.wants()
    assert want is not None and [w.media for w in want.reserve] == ["ddr5"]


def test_an_idle_tenant_gives_its_budget_back() -> None:
    clock = Clock()
    d = _capacity(clock, policy=RefillPolicy(min_reserve_bytes=8 * MiB, idle_budget_s=60))
    d.replace(delegation([reservation()], [budget()]), sent_at=1.0)
    d.note_demand("kv", "ddr5", 2 * MiB)
    d.wants()
    clock.now += 61
    want = d.wants()
    assert want is not None
    assert [(w.tenant, w.bytes, w.leases) for w in want.budgets] == [("kv", 0, 0)]
    # Nothing is granted against the budget while poold takes it back.
    assert d.budget_view("kv") == (0, 0)
    assert d.grant_locally(ask(2 * MiB, tenant="kv")) is None
    later = d.wants()
    assert later is None or later.budgets == []  # asked once
