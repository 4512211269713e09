"""Granting and ending leases in the real ledger, on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError

from poold.errors import (
    GenerationConflict,
    LeaseNotActive,
    NoCapacity,
    NotOwner,
    PoolError,
    QuotaExceeded,
    UnknownLease,
    UnknownTenant,
)
from poold.extents import Extent
from poold.lease_states import LIVE_STATES, LeaseEvent
from poold.ledger import draining, lease_views, leases, op_batches, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Event, Lease, Tenant
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantReply, GrantRequest, LeaseOp
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, GiB, MiB, device, seed, snapshot

LIVE = {s.value for s in LIVE_STATES}


def req(size: int, **kw: Any) -> GrantRequest:
    fields: dict[str, Any] = {"tenant": "t1", "size_bytes": size, "uid": UID, "pid": 42}
    fields.update(kw)
    return GrantRequest(**fields)


def grant(ledger: Ledger, size: int, host: str = "h1", **kw: Any) -> GrantReply:
    return leases.grant(ledger, host, req(size, **kw), "agent:test")


def release(ledger: Ledger, lease_id: str, host: str = "h1") -> LeaseOut:
    return leases.end(ledger, lease_id, LeaseEvent.RELEASE, "agent:test", host_name=host)


def lease_events(ledger: Ledger, lease_id: str) -> list[tuple[str, str | None, str | None]]:
    with ledger.read() as s:
        rows = s.execute(
            select(Event.kind, Event.from_state, Event.to_state)
            .where(Event.lease_id == lease_id)
            .order_by(Event.id)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


def live_extents(ledger: Ledger) -> dict[int, list[Extent]]:
    out: dict[int, list[Extent]] = {}
    with ledger.read() as s:
        for dev_id, off, length in s.execute(
            select(Lease.device_id, Lease.offset_bytes, Lease.length_bytes).where(
                Lease.state.in_(LIVE)
            )
        ):
            out.setdefault(dev_id, []).append(Extent(off, length))
    return out


def assert_no_overlap(ledger: Ledger) -> None:
    with ledger.read() as s:
        caps = {d.id: (d.capacity_bytes, d.alignment_bytes) for d in s.scalars(select(Device))}
    for dev_id, used in live_extents(ledger).items():
        capacity, alignment = caps[dev_id]
        used.sort()
        for a, b in itertools.pairwise(used):
            assert a.end <= b.offset, f"{a} overlaps {b} on device {dev_id}"
        for e in used:
            assert e.offset >= 0 and e.end <= capacity
            assert e.offset % alignment == 0 and e.length % alignment == 0


# --- placement and quota -----------------------------------------------------


def test_grant_places_aligned_best_fit_extents(ledger: Ledger) -> None:
    seed(ledger)
    a = grant(ledger, 1)
    assert (a.offset_bytes, a.length_bytes, a.requested_bytes) == (0, 2 * MiB, 1)
    assert a.state == "granted"
    assert a.alignment_bytes == 2 * MiB
    assert (a.tenant, a.host, a.device_uid, a.local_name, a.numa_node) == (
        "t1",
        "h1",
        "dev-0",
        "node2",
        2,
    )
    assert a.holder_uid == UID and a.holder_pid == 42
    b = grant(ledger, 3 * MiB)
    assert (b.offset_bytes, b.length_bytes) == (2 * MiB, 4 * MiB)
    c = grant(ledger, 2 * MiB)
    assert (c.offset_bytes, c.length_bytes) == (6 * MiB, 2 * MiB)
    release(ledger, b.id)
    # Holes now: [2, 6) MiB and [8, 64) MiB: best fit puts 4 MiB back at 2 MiB.
    d = grant(ledger, 4 * MiB)
    assert d.offset_bytes == 2 * MiB
    assert_no_overlap(ledger)


def test_grant_prefers_nearer_device_and_skips_emulated(ledger: Ledger) -> None:
    seed(
        ledger,
        devices=[
            device("far", read_latency_ns=400, local_name="dax1.0"),
            device("near", read_latency_ns=150, local_name="dax0.0"),
            device("memfd", kind="emulated", media="emulated", read_latency_ns=80),
        ],
    )
    assert grant(ledger, MiB).device_uid == "near"
    emulated = grant(ledger, MiB, media="emulated")
    assert (emulated.device_uid, emulated.device_kind, emulated.media) == (
        "memfd",
        "emulated",
        "emulated",
    )


def test_no_capacity_reports_largest_free(ledger: Ledger) -> None:
    seed(ledger)
    grant(ledger, 60 * MiB)
    before = snapshot(ledger)
    with pytest.raises(NoCapacity) as info:
        grant(ledger, 6 * MiB)
    assert info.value.code == "no_capacity"
    assert info.value.detail["largest_free_bytes"] == 4 * MiB
    assert info.value.detail["free_by_device"] == {"dev-0": 4 * MiB}
    assert snapshot(ledger) == before


def test_quota_bytes_counts_aligned_length(ledger: Ledger) -> None:
    seed(ledger, quota_bytes=4 * MiB)
    grant(ledger, 3 * MiB)  # takes 4 MiB
    before = snapshot(ledger)
    with pytest.raises(QuotaExceeded) as info:
        grant(ledger, 1)
    assert info.value.code == "quota_exceeded"
    assert info.value.detail == {
        "quota_bytes": 4 * MiB,
        "leased_bytes": 4 * MiB,
        "requested_bytes": 2 * MiB,
    }
    # Plain ints, whatever the driver hands back for a SUM(): the detail is JSON.
    assert all(type(v) is int for v in info.value.detail.values())
    assert snapshot(ledger) == before


def test_a_grant_over_quota_anywhere_is_refused_before_it_is_placed(ledger: Ledger) -> None:
    """Over its quota whatever device it lands on (the finest alignment here rounds it
    least): quota_exceeded, with the figures of a placed refusal, even on a host too
    full to place it at all, and nothing written."""
    seed(ledger, quota_bytes=6 * MiB, devices=[device(capacity_bytes=4 * MiB)])
    grant(ledger, 4 * MiB)  # the device is full now
    before = snapshot(ledger)
    with pytest.raises(QuotaExceeded) as info:
        grant(ledger, 3 * MiB + 1)
    assert info.value.detail == {
        "quota_bytes": 6 * MiB,
        "leased_bytes": 4 * MiB,
        "requested_bytes": 4 * MiB,
    }
    assert snapshot(ledger) == before
    with pytest.raises(NoCapacity):  # within the quota: the host's answer
        grant(ledger, 2 * MiB)


def test_a_central_grant_reads_the_ledger_twice(ledger: Ledger, statements: list[str]) -> None:
    """On PostgreSQL, the host's devices with the tenant it names, then the tenant's quota
    use with what occupies the devices: two round trips before the write (four before
    they were joined). A grant that names no tenant resolves it alone, and so does every
    grant on SQLite, where a statement is a call (`granting.host_devices_and_tenant`)."""
    seed(ledger)
    grant(ledger, MiB)
    joined = ledger.engine.dialect.name == "postgresql"
    for named, reads in (("t1", 2 if joined else 3), (None, 3)):
        statements.clear()
        assert grant(ledger, MiB, tenant=named).tenant == "t1"
        assert [sql.split()[0] for sql in statements[:reads]] == ["SELECT"] * reads
        assert statements[reads].split()[0] != "SELECT", statements


def test_quota_leases(ledger: Ledger) -> None:
    seed(ledger, quota_leases=2)
    first = grant(ledger, MiB)
    grant(ledger, MiB)
    with pytest.raises(QuotaExceeded) as info:
        grant(ledger, MiB)
    assert info.value.detail == {"quota_leases": 2, "live_leases": 2}
    release(ledger, first.id)
    grant(ledger, MiB)
    with ledger.read() as s:
        assert tenants.usage(s, tenants.get_by_name(s, "t1").id) == (4 * MiB, 2)


def test_tenant_checks(ledger: Ledger) -> None:
    seed(ledger)
    with pytest.raises(UnknownTenant):
        grant(ledger, MiB, tenant="nobody")
    with pytest.raises(NotOwner):
        grant(ledger, MiB, uid=UID + 1)
    # By group, and without naming the tenant (the only one the uid maps to).
    with ledger.write() as s:
        tenants.get_by_name(s, "t1").allowed_gids = [77]
    assert grant(ledger, MiB, uid=5, gids=[77]).tenant == "t1"
    assert grant(ledger, MiB, tenant=None).tenant == "t1"
    with pytest.raises(NotOwner):
        grant(ledger, MiB, tenant=None, uid=UID + 1)


@pytest.mark.parametrize("devices", [[device()], []], ids=["with devices", "without"])
def test_a_grant_answers_for_its_tenant_first_then_for_the_host(
    ledger: Ledger, devices: list[Any]
) -> None:
    """Read with the host's devices (PostgreSQL) or alone (no device; SQLite), the tenant a
    grant names is checked the same way and in the same order: a draining host first,
    then no such tenant, a uid or a host it does not allow, and only then the host's
    capacity."""
    seed(ledger, devices=devices)
    with ledger.write() as s:
        tenants.create(
            s,
            TenantSpec(name="elsewhere", quota_bytes=GiB, allowed_uids=[UID], allowed_hosts=["h2"]),
            "test",
        )
    with pytest.raises(UnknownTenant):
        grant(ledger, MiB, tenant="nobody")
    with pytest.raises(NotOwner):
        grant(ledger, MiB, uid=UID + 1)
    with pytest.raises(NotOwner):
        grant(ledger, MiB, tenant="elsewhere")
    if devices:
        assert grant(ledger, MiB).tenant == "t1"
    else:
        with pytest.raises(NoCapacity):
            grant(ledger, MiB)
    draining.drain_host(ledger, "h1", "admin", now_=False, revoke_deadline_s=20)
    for named in ("nobody", "t1"):
        with pytest.raises(NoCapacity) as refused:
            grant(ledger, MiB, tenant=named)
        assert refused.value.detail["host_status"] == "draining"


def test_grant_from_unregistered_host(ledger: Ledger) -> None:
    seed(ledger)
    with pytest.raises(NotOwner):
        grant(ledger, MiB, host="ghost")


# --- epochs and events -------------------------------------------------------


def test_epoch_strictly_increases_when_a_range_is_reused(ledger: Ledger) -> None:
    seed(ledger)
    epochs = []
    for _ in range(5):
        lease = grant(ledger, 2 * MiB, activate=True)
        assert lease.offset_bytes == 0
        epochs.append(lease.epoch)
        release(ledger, lease.id)
    assert epochs == sorted(set(epochs)), epochs


def test_freeing_bytes_moves_no_device_generation_and_epochs_still_grow(
    ledger: Ledger,
) -> None:
    """Only taking bytes moves a device's generation: a grant that read the device before
    a release, a batch's release or shrink committed keeps its swap (its placement in
    space that was free is still valid), and the range granted again gets a larger epoch
    than every lease that held it."""
    seed(ledger)
    generations, epochs = [], []
    for how in ("end", "batch", "shrink"):
        lease = grant(ledger, 4 * MiB, activate=True)
        assert lease.offset_bytes == 0
        epochs.append(lease.epoch)
        with ledger.read() as s:
            generations.append(s.scalar(select(Device.generation)))
        if how == "end":
            release(ledger, lease.id)
        else:
            op = (
                LeaseOp(lease_id=lease.id, op="release")
                if how == "batch"
                else LeaseOp(lease_id=lease.id, op="shrink", length_bytes=2 * MiB)
            )
            [done] = op_batches.apply_ops(ledger, "h1", [op], "agent:h1")
            assert done.code is None, done
            if how == "shrink":
                release(ledger, lease.id)
        with ledger.read() as s:
            assert s.scalar(select(Device.generation)) == generations[-1], how
    assert epochs == sorted(set(epochs)), epochs
    assert grant(ledger, 4 * MiB).epoch > epochs[-1]


def test_every_transition_has_an_event(ledger: Ledger) -> None:
    seed(ledger)
    a = grant(ledger, MiB)
    leases.activate(ledger, "h1", a.id, "agent:test")
    leases.renew(ledger, "h1", a.id, 30)
    release(ledger, a.id)
    assert lease_events(ledger, a.id) == [
        ("lease.grant", None, "granted"),
        ("lease.activate", "granted", "active"),
        ("lease.release", "active", "released"),
    ]
    b = grant(ledger, MiB)
    leases.end(ledger, b.id, LeaseEvent.ABORT, "agent:test", "materialise failed", "h1")
    assert lease_events(ledger, b.id) == [
        ("lease.grant", None, "granted"),
        ("lease.abort", "granted", "aborted"),
    ]
    with ledger.read() as s:
        reason = s.scalar(select(Event.reason).where(Event.kind == "lease.abort"))
        actors = set(s.scalars(select(Event.actor).where(Event.lease_id == b.id)))
    assert reason == "materialise failed"
    assert actors == {"agent:test"}


def test_grant_with_activate_yields_active_and_both_events(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, MiB, activate=True)
    assert lease.state == "active"
    assert lease.activated_at is not None
    assert lease_events(ledger, lease.id) == [
        ("lease.grant", None, "granted"),
        ("lease.activate", "granted", "active"),
    ]


def test_event_chain_matches_final_state(ledger: Ledger) -> None:
    """Invariant 3 over a mixed history: each lease's events chain to its state."""
    seed(ledger)
    ids = []
    for i in range(6):
        lease = grant(ledger, MiB, activate=i % 2 == 0)
        ids.append(lease.id)
        if i % 3 == 0:
            release(ledger, lease.id)
    with ledger.read() as s:
        states = {i: st for i, st in s.execute(select(Lease.id, Lease.state))}
    for lease_id in ids:
        chain = lease_events(ledger, lease_id)
        assert chain[0][1] is None
        for (_, _, to), (_, frm, _) in itertools.pairwise(chain):
            assert to == frm
        assert chain[-1][2] == states[lease_id]


# --- holder operations ---------------------------------------------------------


def test_renew_extends_expiry(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, MiB, activate=True, ttl_s=10)
    renewed = leases.renew(ledger, "h1", lease.id, 3600)
    assert renewed.ttl_s == 3600
    assert renewed.expires_at - utcnow() > timedelta(seconds=3500)
    again = leases.renew(ledger, "h1", lease.id, None)
    assert again.ttl_s == 3600 and again.expires_at >= renewed.expires_at


def test_renew_after_release_is_lease_not_active(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, MiB, activate=True)
    release(ledger, lease.id)
    before = snapshot(ledger)
    with pytest.raises(LeaseNotActive) as info:
        leases.renew(ledger, "h1", lease.id, 60)
    assert info.value.code == "lease_not_active"
    with pytest.raises(LeaseNotActive):
        release(ledger, lease.id)
    with pytest.raises(LeaseNotActive):
        leases.activate(ledger, "h1", lease.id, "agent:test")
    assert snapshot(ledger) == before


def test_activating_an_active_lease_again_answers_it_unchanged(ledger: Ledger) -> None:
    # The agent repeats an activation whose reply was lost (it failed over to another
    # poold): the first activation stands, no second event, the expiry not moved.
    seed(ledger)
    lease = grant(ledger, MiB)
    first = leases.activate(ledger, "h1", lease.id, "agent:test")
    before = snapshot(ledger)
    again = leases.activate(ledger, "h1", lease.id, "agent:test")
    assert again.state == "active" and again.expires_at == first.expires_at
    assert snapshot(ledger) == before
    assert [e[0] for e in lease_events(ledger, lease.id)] == ["lease.grant", "lease.activate"]


def test_foreign_and_unknown_leases(ledger: Ledger) -> None:
    seed(ledger)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    lease = grant(ledger, MiB)
    before = snapshot(ledger)
    with pytest.raises(NotOwner):
        leases.renew(ledger, "h2", lease.id, 60)
    with pytest.raises(NotOwner):
        leases.activate(ledger, "h2", lease.id, "agent:h2")
    with pytest.raises(NotOwner):
        release(ledger, lease.id, host="h2")
    with pytest.raises(UnknownLease):
        leases.renew(ledger, "h1", "no-such-lease", 60)
    with pytest.raises(UnknownLease):
        lease_views.show(ledger, "no-such-lease")
    assert snapshot(ledger) == before


def _backdate(ledger: Ledger, lease_id: str) -> None:
    with ledger.write() as s:
        s.execute(
            update(Lease)
            .where(Lease.id == lease_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


def test_lazy_expiry_on_renew(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, MiB, activate=True)
    _backdate(ledger, lease.id)
    assert lease_views.show(ledger, lease.id).state == "active"  # nothing swept it yet
    with pytest.raises(LeaseNotActive) as info:
        leases.renew(ledger, "h1", lease.id, 60)
    assert info.value.detail == {"state": "expired"}
    # The expiry itself is a state change: kept, and journalled.
    assert lease_views.show(ledger, lease.id).state == "expired"
    assert lease_events(ledger, lease.id)[-1] == ("lease.expire", "active", "expired")
    # An expired lease still holds its bytes until reclaimed.
    assert live_extents(ledger) == {1: [Extent(0, 2 * MiB)]}


def test_lazy_expiry_on_release_then_the_agents_release_is_the_reclaim(ledger: Ledger) -> None:
    """The agent freed the memory when its holder released it, whatever poold decided
    meanwhile: the expiry is journalled, and the release reclaims the range at once
    (refused, the range stayed live while the agent granted it again)."""
    seed(ledger)
    lease = grant(ledger, MiB, activate=True)
    _backdate(ledger, lease.id)
    assert release(ledger, lease.id).state == "reclaimed"
    assert lease_events(ledger, lease.id)[-2:] == [
        ("lease.expire", "active", "expired"),
        ("lease.reclaim", "expired", "reclaimed"),
    ]
    assert live_extents(ledger) == {}
    # The same through an op batch; an admin's release of an expired lease is refused.
    other = grant(ledger, MiB, activate=True)
    _backdate(ledger, other.id)
    results = op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=other.id, op="release")], "a")
    assert (results[0].state, results[0].code) == ("reclaimed", None)
    third = grant(ledger, MiB, activate=True)
    _backdate(ledger, third.id)
    with pytest.raises(LeaseNotActive):
        leases.end(ledger, third.id, LeaseEvent.RELEASE, "admin:test")
    assert lease_views.show(ledger, third.id).state == "expired"
    assert [e[0] for e in lease_events(ledger, third.id)].count("lease.expire") == 1


def test_apply_ops_each_op_on_its_own(ledger: Ledger) -> None:
    seed(ledger)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    a = grant(ledger, MiB, activate=True)
    b = grant(ledger, MiB)
    results = op_batches.apply_ops(
        ledger,
        "h1",
        [
            LeaseOp(lease_id=a.id, op="release", reason="done"),
            LeaseOp(lease_id=a.id, op="release"),
            LeaseOp(lease_id="nope", op="abort"),
            LeaseOp(lease_id=b.id, op="abort"),
        ],
        "agent:h1",
    )
    assert [(r.state, r.code) for r in results] == [
        ("released", None),
        (None, "lease_not_active"),
        (None, "unknown_lease"),
        ("aborted", None),
    ]
    c = grant(ledger, MiB)
    foreign = op_batches.apply_ops(ledger, "h2", [LeaseOp(lease_id=c.id, op="release")], "agent:h2")
    assert foreign[0].code == "not_owner"
    assert lease_views.show(ledger, c.id).state == "granted"


def test_an_op_batch_journals_each_applied_op_once_in_the_order_applied(
    ledger: Ledger,
) -> None:
    """A batch's events are written together when it ends (`transitions.events_at_end`),
    and its leases' rows read together when it starts (`BatchReads.held`): still one event
    per transition, in the order the ops were applied (lease id order), none for a refused
    op, and a second op on a lease sees what the first one wrote."""
    seed(ledger)
    a, b, c = sorted((grant(ledger, MiB, activate=True) for _ in range(3)), key=lambda x: x.id)
    with ledger.read() as s:
        before = s.scalar(select(func.max(Event.id)))
    results = op_batches.apply_ops(
        ledger,
        "h1",
        [
            LeaseOp(lease_id=c.id, op="release_mapped"),
            LeaseOp(lease_id=b.id, op="scrubbed"),  # refused: b is active
            LeaseOp(lease_id=a.id, op="release"),
            LeaseOp(lease_id=c.id, op="unmapped"),
        ],
        "agent:h1",
    )
    assert [(r.state, r.code) for r in results] == [
        ("released_mapped", None),
        (None, "invalid_transition"),
        ("released", None),
        ("released", None),
    ]
    with ledger.read() as s:
        rows = s.execute(
            select(Event.lease_id, Event.kind).where(Event.id > before).order_by(Event.id)
        ).all()
    assert [tuple(r) for r in rows] == [
        (a.id, "lease.release"),
        (c.id, "lease.release_mapped"),
        (c.id, "lease.unmapped"),
    ]
    assert lease_views.show(ledger, b.id).state == "active"


def test_grant_applies_pending_release_first(ledger: Ledger) -> None:
    seed(ledger, quota_leases=1, quota_bytes=2 * MiB)
    old = grant(ledger, MiB, activate=True)
    with pytest.raises(QuotaExceeded):
        grant(ledger, MiB)
    new = grant(ledger, MiB, pending=[LeaseOp(lease_id=old.id, op="release")])
    assert lease_views.show(ledger, old.id).state == "released"
    assert new.offset_bytes == old.offset_bytes
    assert new.epoch > old.epoch
    assert [(r.lease_id, r.state, r.code) for r in new.pending] == [(old.id, "released", None)]


def test_a_grant_answers_what_became_of_each_op_that_rode_on_it(ledger: Ledger) -> None:
    """A refused op riding on a grant is in the grant's answer, as in an op batch's: the
    agent must hear of it (a refused local grant is memory the ledger does not count)."""
    seed(ledger)
    a = grant(ledger, MiB, activate=True)
    new = grant(
        ledger,
        MiB,
        pending=[
            LeaseOp(lease_id=a.id, op="release"),
            LeaseOp(lease_id="nobody", op="release"),
            LeaseOp(lease_id=a.id, op="release"),
        ],
    )
    assert [(r.lease_id, r.state, r.code) for r in new.pending] == [
        (a.id, "released", None),
        ("nobody", None, "unknown_lease"),
        (a.id, None, "lease_not_active"),
    ]
    assert lease_views.show(ledger, new.id).state == "granted"


def test_list_leases_filters(ledger: Ledger) -> None:
    seed(ledger)
    a = grant(ledger, MiB)
    b = grant(ledger, MiB, activate=True)
    release(ledger, a.id)
    assert {x.id for x in lease_views.list_leases(ledger)} == {a.id, b.id}
    assert [x.id for x in lease_views.list_leases(ledger, live_only=True)] == [b.id]
    assert [x.id for x in lease_views.list_leases(ledger, states=["released"])] == [a.id]
    assert lease_views.list_leases(ledger, tenant="other") == []
    assert lease_views.list_leases(ledger, host="h2") == []


# --- concurrency ---------------------------------------------------------------


def _race(ledgers: list[Ledger], threads: int, size: int) -> Counter[str]:
    barrier = threading.Barrier(threads)
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(i: int) -> None:
        led = ledgers[i % len(ledgers)]
        barrier.wait()
        try:
            leases.grant(led, "h1", req(size), f"agent:{i}")
            outcome = "ok"
        except PoolError as err:
            outcome = err.code
        with lock:
            outcomes[outcome] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in pool)
    return outcomes


@pytest.mark.parametrize("engines", ["one", "per-thread"])
def test_concurrent_grants_never_overlap(ledger: Ledger, ledger_url: str, engines: str) -> None:
    """Racing grants on one device: each gets its own range (the generation path)."""
    if engines == "per-thread" and ledger.is_sqlite:
        pytest.skip("separate poold processes share a ledger only on PostgreSQL")
    seed(ledger, devices=[device(capacity_bytes=24 * MiB)])
    threads = 8
    ledgers = [ledger] if engines == "one" else [Ledger(ledger_url) for _ in range(threads)]
    try:
        outcomes = _race(ledgers, threads, 2 * MiB)
    finally:
        if engines != "one":
            for led in ledgers:
                led.dispose()
    assert outcomes == Counter({"ok": threads}), outcomes
    assert_no_overlap(ledger)
    with ledger.read() as s:
        epochs = list(s.scalars(select(Lease.epoch)))
    assert len(set(epochs)) == threads


@pytest.mark.parametrize("engines", ["one", "per-thread"])
def test_concurrent_grants_never_exceed_quota(
    ledger: Ledger, ledger_url: str, engines: str
) -> None:
    if engines == "per-thread" and ledger.is_sqlite:
        pytest.skip("separate poold processes share a ledger only on PostgreSQL")
    seed(ledger, devices=[device(capacity_bytes=GiB)], quota_bytes=8 * MiB)
    threads = 8
    ledgers = [ledger] if engines == "one" else [Ledger(ledger_url) for _ in range(threads)]
    try:
        outcomes = _race(ledgers, threads, 2 * MiB)
    finally:
        if engines != "one":
            for led in ledgers:
                led.dispose()
    assert outcomes == Counter({"ok": 4, "quota_exceeded": 4}), outcomes
    with ledger.read() as s:
        tenant = s.scalar(select(Tenant))
        assert tenant is not None
        assert tenants.usage(s, tenant.id) == (8 * MiB, 4)
    assert_no_overlap(ledger)


def test_concurrent_grants_fill_device_exactly(ledger: Ledger) -> None:
    seed(ledger, devices=[device(capacity_bytes=8 * MiB)])
    outcomes = _race([ledger], 8, 2 * MiB)
    assert outcomes == Counter({"ok": 4, "no_capacity": 4}), outcomes
    assert_no_overlap(ledger)


def test_generation_conflict_is_retryable() -> None:
    err = GenerationConflict("lost")
    assert err.code == "generation_conflict" and err.http_status == 409


# --- PostgreSQL's last line of defence ---------------------------------------------


@pytest.mark.postgres
def test_exclusion_constraint_refuses_overlapping_live_lease(ledger: Ledger) -> None:
    if ledger.is_sqlite:
        pytest.skip("the exclusion constraint exists on PostgreSQL only")
    seed(ledger)
    lease = grant(ledger, 4 * MiB)
    with ledger.read() as s:
        row = s.execute(select(Lease.__table__).where(Lease.id == lease.id)).mappings().one()
    clone = dict(row)

    def insert_clone(**kw: Any) -> None:
        with ledger.write() as s:
            s.execute(insert(Lease.__table__).values({**clone, **kw}))

    before = snapshot(ledger)
    with pytest.raises(IntegrityError, match="ex_leases_no_overlap"):
        insert_clone(id="overlap-1", offset_bytes=2 * MiB)
    assert snapshot(ledger) == before
    # Not overlapping, or not live: allowed.
    insert_clone(id="beside", offset_bytes=4 * MiB)
    insert_clone(id="ended", offset_bytes=0, state="released")
