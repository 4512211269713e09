"""What is delegated to which host, and what does the rest of the ledger make of it?

Reservations placed around everything else and capped, with an epoch block; budgets
within the quota; local grants recorded as ordinary leases inside their reservation (or
refused with a code); central grants and quotas that see the delegation; heartbeats that
renew it, drains and expiry that return it; and races with central grants that never
overlap nor exceed a quota (SQLite and PostgreSQL).
"""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from poold.errors import (
    NoCapacity,
    NotOwner,
    QuotaExceeded,
    ReservationInUse,
    UnknownDevice,
)
from poold.extents import Extent
from poold.lease_states import LIVE_STATE_VALUES
from poold.ledger import (
    audit,
    budget_sizing,
    delegation,
    delegation_renewal,
    device_hosts,
    draining,
    granting,
    heartbeat,
    hosts,
    leases,
    op_batches,
    tenants,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Budget, Device, Event, Lease, Reservation
from poold.ledger.reaper import Reaper, ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.admin import TenantUpdate
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp
from poold.wire.delegation import (
    EPOCH_BLOCK,
    BudgetWant,
    Delegation,
    DelegationRequest,
    ReserveWant,
)
from tests.poold.conftest import UID, MiB, at_once, device, local_grant_op, seed


def _delegate(ledger: Ledger, host: str = "h1", **kw: object) -> Delegation:
    return delegation.delegate(ledger, host, DelegationRequest(**kw), f"agent:{host}")  # type: ignore[arg-type]


def _grant(size_bytes: int = 2 * MiB, tenant: str = "t1") -> GrantRequest:
    return GrantRequest(
        tenant=tenant, size_bytes=size_bytes, uid=UID, pid=1, ttl_s=60, activate=True
    )


def _ops(ledger: Ledger, *ops: LeaseOp, host: str = "h1") -> list[tuple[str | None, str | None]]:
    return [
        (r.state, r.code) for r in op_batches.apply_ops(ledger, host, list(ops), f"agent:{host}")
    ]


def _extents(ledger: Ledger) -> list[Extent]:
    """Every reservation and every live central lease: none may overlap another."""
    with ledger.read() as s:
        rows = [
            Extent(o, n)
            for o, n in s.execute(select(Reservation.offset_bytes, Reservation.length_bytes))
        ]
        rows += [
            Extent(o, n)
            for o, n in s.execute(
                select(Lease.offset_bytes, Lease.length_bytes).where(
                    Lease.state.in_(LIVE_STATE_VALUES), Lease.reservation_id.is_(None)
                )
            )
        ]
    return rows


def _no_overlap(exts: list[Extent]) -> None:
    exts = sorted(exts)
    for a, b in itertools.pairwise(exts):
        assert a.end <= b.offset, (a, b)


# --- reservations ------------------------------------------------------------------------


def test_a_reservation_is_placed_capped_and_takes_an_epoch_block(ledger: Ledger) -> None:
    seed(ledger)  # one 64 MiB device
    lease = leases.grant(ledger, "h1", _grant(), "agent:h1")
    with ledger.read() as s:
        before = s.scalar(select(Device.generation))
    d = _delegate(ledger, reserve=[ReserveWant(bytes=64 * MiB)])
    (res,) = d.reservations
    # 25 % of the 62 MiB free, aligned down to 2 MiB: 14 MiB; beside the lease.
    assert res.length_bytes == 14 * MiB
    assert not Extent(res.offset_bytes, res.length_bytes).overlaps(
        Extent(lease.offset_bytes, lease.length_bytes)
    )
    assert res.epoch_base == before + 1
    assert (res.device_uid, res.local_name, res.alignment_bytes) == ("dev-0", "node2", 2 * MiB)
    with ledger.read() as s:
        assert s.scalar(select(Device.generation)) == before + EPOCH_BLOCK
        assert s.scalar(select(func.count()).where(Event.kind == "reservation.reserve")) == 1
    # A later central grant of any bytes has a larger epoch than the whole block.
    later = leases.grant(ledger, "h1", _grant(), "agent:h1")
    assert later.epoch > res.epoch_base + EPOCH_BLOCK - 1
    # The reply is the host's whole delegation, also when asking for nothing.
    assert _delegate(ledger).reservations == d.reservations


def test_a_small_want_is_served_whole_and_a_named_device_is_checked(ledger: Ledger) -> None:
    seed(ledger)
    d = _delegate(ledger, reserve=[ReserveWant(bytes=3 * MiB), ReserveWant(bytes=2 * MiB)])
    assert [r.length_bytes for r in d.reservations] == [4 * MiB, 2 * MiB]
    _no_overlap(_extents(ledger))
    assert len({r.epoch_base for r in d.reservations}) == 2
    with pytest.raises(UnknownDevice):
        _delegate(ledger, reserve=[ReserveWant(bytes=2 * MiB, device_uid="nope")])


def test_central_grants_go_around_reservations(ledger: Ledger) -> None:
    seed(ledger, devices=[device(capacity_bytes=16 * MiB)])
    d = _delegate(ledger, reserve=[ReserveWant(bytes=4 * MiB)])
    assert d.reservations[0].length_bytes == 4 * MiB
    got = [leases.grant(ledger, "h1", _grant(), "agent:h1") for _ in range(6)]
    _no_overlap(_extents(ledger))
    with pytest.raises(NoCapacity):
        leases.grant(ledger, "h1", _grant(), "agent:h1")
    assert len(got) == 6


def test_no_reservation_on_a_draining_device_and_drain_returns_unleased(
    ledger: Ledger,
) -> None:
    seed(ledger)
    d = _delegate(ledger, reserve=[ReserveWant(bytes=8 * MiB), ReserveWant(bytes=2 * MiB)])
    _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)])
    assert _ops(ledger, local_grant_op(d, "L1")) == [("active", None)]
    draining.drain_device(
        ledger, "dev-0", "admin", deadline_s=3600.0, now_=False, revoke_deadline_s=30.0
    )
    with ledger.read() as s:
        left = set(s.execute(select(Reservation.id, Reservation.state)))
    # Both are returning (listed no more), neither went: the agent may have granted in
    # the one with no lease poold knows of before it heard, and that lease commits.
    assert left == {(r.id, delegation.RETURNING) for r in d.reservations}
    after = _delegate(ledger, reserve=[ReserveWant(bytes=2 * MiB)])
    assert after.reservations == []
    unleased = Delegation(server_time=d.server_time, reservations=[d.reservations[1]])
    assert _ops(ledger, local_grant_op(unleased, "L2")) == [("active", None)]
    leases.end(ledger, "L2", leases.LeaseEvent.RELEASE, "agent:h1", host_name="h1")
    with ledger.write_conn() as conn:
        delegation_renewal.reap(conn, utcnow())
    with ledger.read() as s:  # still there: neither given back nor past its TTL
        assert s.scalar(select(func.count()).select_from(Reservation)) == 2
    # The agent gives back both once it holds no lease there (L1's release on its way).
    _delegate(ledger, give_back=[r.id for r in d.reservations])
    with ledger.read() as s:
        assert list(s.execute(select(Reservation.id))) == [(d.reservations[0].id,)]
    leases.end(ledger, "L1", leases.LeaseEvent.RELEASE, "agent:h1", host_name="h1")
    heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")  # spoke since
    with ledger.write_conn() as conn:
        delegation_renewal.reap(conn, utcnow())
    with ledger.read() as s:
        assert s.scalar(select(func.count()).select_from(Reservation)) == 0


def test_give_back_is_whole_and_refused_while_a_lease_lies_inside(ledger: Ledger) -> None:
    seed(ledger)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    rid = d.reservations[0].id
    assert _ops(ledger, local_grant_op(d, "L1")) == [("active", None)]
    with pytest.raises(ReservationInUse):
        _delegate(ledger, give_back=[rid])
    leases.end(ledger, "L1", leases.LeaseEvent.RELEASE, "agent:h1", host_name="h1")
    assert _delegate(ledger, give_back=[rid]).reservations == []
    seed(ledger, host="h2", devices=[], tenant=None)
    d2 = _delegate(ledger, reserve=[ReserveWant(bytes=2 * MiB)])
    with pytest.raises(NotOwner):
        _delegate(ledger, "h2", give_back=[d2.reservations[0].id])


def test_a_retried_delegation_is_answered_once(ledger: Ledger) -> None:
    seed(ledger)
    first = _delegate(ledger, request_id="r-1", reserve=[ReserveWant(bytes=2 * MiB)])
    again = _delegate(ledger, request_id="r-1", reserve=[ReserveWant(bytes=2 * MiB)])
    assert again == first
    with ledger.read() as s:
        assert s.scalar(select(func.count()).select_from(Reservation)) == 1


# --- budgets and quotas -------------------------------------------------------------------


def test_budgets_stay_within_the_quota_and_count_against_it(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=16 * MiB, quota_leases=4)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
    d = _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=64 * MiB, leases=10)])
    assert [(b.tenant, b.bytes, b.leases, b.allowed_uids) for b in d.budgets] == [
        ("t1", 12 * MiB, 3, [UID])
    ]
    # Another host gets what is left: nothing.
    assert (
        _delegate(ledger, "h2", budgets=[BudgetWant(tenant="t1", bytes=MiB, leases=1)]).budgets
        == []
    )
    # h1's budget holds the rest of the quota against every other host's central grant.
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h2", _grant(), "agent:h2")
    # Smaller totals give quota back to central grants.
    _delegate(ledger, budgets=[BudgetWant(tenant="t1", bytes=8 * MiB, leases=2)])
    leases.grant(ledger, "h2", _grant(4 * MiB), "agent:h2")


def test_a_quota_cut_claws_budgets_back_to_the_quota_even_below_what_is_granted(
    ledger: Ledger,
) -> None:
    """The lease granted stays (quota use counts it); the budget below it stops the agent
    granting into it again once it ends (tests/poold/ledger/test_local_commit.py)."""
    seed(ledger, quota_bytes=32 * MiB)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=16 * MiB, leases=8)],
    )
    assert _ops(ledger, local_grant_op(d, "L1", length=4 * MiB)) == [("active", None)]
    tenants.update_tenant(
        ledger, "t1", TenantUpdate(quota_bytes=2 * MiB), "admin", budget_sizing.claw_back
    )
    with ledger.read() as s:
        assert list(s.execute(select(Budget.bytes))) == [(2 * MiB,)]
        assert s.scalar(select(Lease.state).where(Lease.id == "L1")) == "active"
    # The agent learns it from its next heartbeat reply.
    reply = heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")
    assert reply.delegation is not None
    assert [b.bytes for b in reply.delegation.budgets] == [2 * MiB]


# --- local grants --------------------------------------------------------------------------


def test_a_local_grant_is_recorded_once_inside_its_reservation(ledger: Ledger) -> None:
    seed(ledger, quota_leases=1)  # past its budget, a local grant must fit the quota
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=8 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=1)],
    )
    op = local_grant_op(d, "L1", epoch=3)
    assert _ops(ledger, op) == [("active", None)]
    assert _ops(ledger, op) == [("active", None)]  # a replay is a no-op
    got = leases.lease_views.show(ledger, "L1")
    assert (got.state, got.epoch, got.host) == ("active", d.reservations[0].epoch_base + 3, "h1")
    with ledger.read() as s:
        assert s.scalar(select(Lease.reservation_id)) == d.reservations[0].id
        kinds = list(s.scalars(select(Event.kind).where(Event.lease_id == "L1")))
    assert kinds == ["lease.grant", "lease.activate"]
    # Refusals, each with its code, and nothing written.
    assert _ops(
        ledger,
        local_grant_op(d, "L1", offset=2 * MiB),  # the same id with other fields
        local_grant_op(d, "L2", offset=0),  # overlaps L1
        local_grant_op(d, "L3", offset=8 * MiB),  # past the reservation's end
        local_grant_op(d, "L4", offset=2 * MiB, epoch=EPOCH_BLOCK),  # past its epoch block
        local_grant_op(
            d, "L5", offset=2 * MiB
        ),  # the budget's (and the quota's) one lease is spent
    ) == [
        (None, "local_grant_mismatch"),
        (None, "lease_overlap"),
        (None, "outside_reservation"),
        (None, "outside_reservation"),
        (None, "budget_exceeded"),
    ]
    seed(ledger, host="h2", devices=[], tenant=None)
    assert _ops(ledger, local_grant_op(d, "L6", offset=4 * MiB), host="h2") == [(None, "not_owner")]
    # Then ordinary ops: a release ends it, and frees the bytes inside the reservation.
    ((state, code),) = _ops(ledger, LeaseOp(lease_id="L1", op="release"))
    assert code is None and state not in LIVE_STATE_VALUES
    assert _ops(ledger, local_grant_op(d, "L7", epoch=4)) == [("active", None)]


# --- heartbeats and expiry ----------------------------------------------------------------


def test_heartbeats_renew_the_delegation_and_expiry_returns_it(ledger: Ledger) -> None:
    seed(ledger)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB), ReserveWant(bytes=2 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    assert _ops(ledger, local_grant_op(d, "L1")) == [("active", None)]
    long_ago = utcnow() - timedelta(hours=1)
    with ledger.write() as s:
        s.execute(update(Reservation).values(expires_at=long_ago))
        s.execute(update(Budget).values(expires_at=long_ago))
    reply = heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")
    assert reply.delegation is not None
    assert all(r.expires_at > utcnow() for r in reply.delegation.reservations)
    assert all(b.expires_at > utcnow() for b in reply.delegation.budgets)
    with ledger.write() as s:
        s.execute(update(Reservation).values(expires_at=long_ago))
        s.execute(update(Budget).values(expires_at=long_ago))
    with ledger.write_conn() as conn:
        delegation_renewal.reap(conn, utcnow())
    with ledger.read() as s:
        left = list(s.execute(select(Reservation.id, Reservation.state)))
        assert s.scalar(select(func.count()).select_from(Budget)) == 0
    assert left == [(d.reservations[0].id, delegation.RETURNING)]  # L1 lies in it
    # A host without any delegation gets none in its reply.
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    assert heartbeat.receive_heartbeat(ledger, "h2", Heartbeat(), "agent:h2").delegation is None


def test_a_draining_host_returns_its_unleased_reservations(ledger: Ledger) -> None:
    seed(ledger)
    _delegate(ledger, reserve=[ReserveWant(bytes=4 * MiB)])
    draining.drain_host(ledger, "h1", "admin")
    with ledger.read() as s:  # returning until the agent gives them back (or the TTL)
        assert set(s.execute(select(Reservation.state)).scalars()) == {delegation.RETURNING}
    assert heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1").delegation
    with ledger.write() as s:
        assert hosts.get_by_name(s, "h1").status == "draining"


# --- races ----------------------------------------------------------------------------------


def test_reservations_racing_central_grants_never_overlap(ledger: Ledger) -> None:
    # A shared CXL device both hosts reach (multi-headed).
    shared = device("cxl:ram:serials=1,2:ways=2:gran=4096:size=268435456", capacity_bytes=256 * MiB)
    seed(ledger, quota_leases=1000, devices=[shared])
    seed(ledger, host="h2", devices=[], tenant=None)
    with ledger.write() as s:
        h2 = hosts.get_by_name(s, "h2")
        device_hosts.bind(s, int(s.scalar(select(Device.id)) or 0), h2.id, "admin")
        assert heartbeat.upsert_inventory(s, h2, [shared]) == []

    def reserve(host: str) -> object:
        def run() -> object:
            for _ in range(4):
                _delegate(ledger, host, reserve=[ReserveWant(bytes=6 * MiB)])
            return None

        return run

    def central() -> object:
        for _ in range(8):
            with contextlib.suppress(NoCapacity):
                leases.grant(ledger, "h1", _grant(4 * MiB), "agent:h1")
        return None

    at_once(reserve("h1"), reserve("h2"), central, central)
    _no_overlap(_extents(ledger))
    with ledger.read() as s:
        assert s.scalar(select(func.count()).select_from(Reservation)) == 8


def test_budgets_racing_central_grants_never_exceed_the_quota(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=32 * MiB, quota_leases=100, devices=[device(capacity_bytes=256 * MiB)])
    seed(ledger, host="h2", devices=[device("dev-1", capacity_bytes=256 * MiB)], tenant=None)

    def budget(host: str) -> object:
        def run() -> object:
            for i in range(6):
                _delegate(
                    ledger,
                    host,
                    budgets=[BudgetWant(tenant="t1", bytes=(i + 1) * 2 * MiB, leases=4)],
                )
            return None

        return run

    def central() -> object:
        for _ in range(8):
            with contextlib.suppress(QuotaExceeded):
                leases.grant(ledger, "h1", _grant(2 * MiB), "agent:h1")
        return None

    at_once(budget("h1"), budget("h2"), central, central)
    with ledger.write_conn() as conn:
        use = granting.quota_use(conn, 1)
    assert use.bytes() <= 32 * MiB
    assert use.leases() <= 100


# --- the audit and the reaper ----------------------------------------------------------------


def test_the_audit_checks_delegation_and_reclaims_down_hosts_reservations(
    ledger: Ledger,
) -> None:
    seed(ledger)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB), ReserveWant(bytes=2 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    assert _ops(ledger, local_grant_op(d, "L1")) == [("active", None)]
    leases.grant(ledger, "h1", _grant(), "agent:h1")
    heartbeat.receive_heartbeat(ledger, "h1", Heartbeat(), "agent:h1")  # the host is up
    report = audit.run_audit(ledger, ReaperPolicy())
    assert report.violations == []
    assert report.exit_code == 0

    # The host goes down: its reservation with no lease inside is returned by --reclaim.
    with ledger.write() as s:
        hosts.get_by_name(s, "h1").status = "down"
    report = audit.run_audit(ledger, ReaperPolicy(), reclaim_safe=True)
    returned = [i for i in report.reclaimable if i.kind == "reservation_of_down_host"]
    assert [(i.reservation_id, i.action) for i in returned] == [(d.reservations[1].id, "returned")]
    with ledger.read() as s:
        assert list(s.scalars(select(Reservation.id))) == [d.reservations[0].id]

    # A lease outside its reservation, a reservation over a central lease, a budget past
    # the quota: violations.
    with ledger.write() as s:
        s.execute(update(Lease).where(Lease.id == "L1").values(offset_bytes=60 * MiB))
        s.execute(update(Budget).values(bytes=2 << 30))
    kinds = {v.kind for v in audit.run_audit(ledger, ReaperPolicy()).violations}
    assert {"outside_reservation", "over_quota_bytes"} <= kinds


def test_the_reaper_keeps_what_a_silent_host_holds(ledger: Ledger) -> None:
    seed(ledger)
    _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
    )
    # Expired, but its host has not spoken since (poold or the link was down): kept, the
    # agent commits what it granted when it comes back.
    later = utcnow() + timedelta(hours=1)
    assert Reaper(ledger, ReaperPolicy()).run_once(later).delegation_returned == 0
    with ledger.read() as s:
        assert s.scalar(select(func.count()).select_from(Reservation)) == 1
        assert s.scalar(select(func.count()).select_from(Budget)) == 1


def test_a_batch_frees_before_it_grants_locally(ledger: Ledger) -> None:
    """A release queued before a local grant of the same bytes, in one batch, frees them
    first, whatever the lease ids' order (the agent reused the extent once released)."""
    seed(ledger, quota_leases=1)
    d = _delegate(
        ledger,
        reserve=[ReserveWant(bytes=4 * MiB)],
        budgets=[BudgetWant(tenant="t1", bytes=2 * MiB, leases=1)],
    )
    assert _ops(ledger, local_grant_op(d, "L1")) == [("active", None)]
    release = LeaseOp(lease_id="L1", op="release")
    assert _ops(ledger, release, local_grant_op(d, "L0", epoch=1)) == [
        ("released", None),
        ("active", None),
    ]
