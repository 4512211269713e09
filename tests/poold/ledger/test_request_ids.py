"""Is a retried grant or op batch answered once? Request ids remembered per host.

A retry with the same request id (the agent lost the reply) gets the first answer
and changes nothing; two poolds running the same retry at once (threads on one
PostgreSQL ledger here) still make one lease; another host's id is its own; the
reaper forgets old ids.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from poold.errors import BadRequest, QuotaExceeded
from poold.ledger import leases, op_batches, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import AgentRequest, Event, Lease
from poold.ledger.reaper import Reaper, ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, LeaseOp
from tests.poold.conftest import UID, MiB, at_once, device, seed


def _grant(request_id: str | None = None, size_bytes: int = 2 * MiB) -> GrantRequest:
    return GrantRequest(
        tenant="t1",
        size_bytes=size_bytes,
        uid=UID,
        pid=1,
        ttl_s=60,
        activate=True,
        request_id=request_id,
    )


def _count(ledger: Ledger, model: type[Lease] | type[AgentRequest]) -> int:
    with ledger.read() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def test_a_retried_grant_gets_the_first_lease(ledger: Ledger) -> None:
    seed(ledger)
    first = leases.grant(ledger, "h1", _grant("req-1"), "agent:h1")
    before = transitions.reruns().get(("lost_race", "request_id"), 0)
    again = leases.grant(ledger, "h1", _grant("req-1"), "agent:h1")
    assert again == first
    # Found at the stored answer's key: the retry's own run rolled back, its rerun recalled.
    assert transitions.reruns().get(("lost_race", "request_id"), 0) == before + 1
    assert _count(ledger, Lease) == 1
    with ledger.read() as s:
        grants = s.scalar(select(func.count()).where(Event.kind == "lease.grant"))
    assert grants == 1


def test_a_grant_without_an_id_is_not_remembered(ledger: Ledger) -> None:
    seed(ledger)
    a = leases.grant(ledger, "h1", _grant(), "agent:h1")
    b = leases.grant(ledger, "h1", _grant(), "agent:h1")
    assert a.id != b.id
    assert _count(ledger, AgentRequest) == 0


def test_a_refused_grant_stores_nothing_and_its_retry_runs_again(ledger: Ledger) -> None:
    seed(ledger, quota_leases=1)
    leases.grant(ledger, "h1", _grant("a"), "agent:h1")
    with pytest.raises(QuotaExceeded):
        leases.grant(ledger, "h1", _grant("b"), "agent:h1")
    assert _count(ledger, AgentRequest) == 1


def test_a_retried_grant_its_rerun_would_refuse_gets_the_first_lease(ledger: Ledger) -> None:
    # The first attempt of a grant does not ask whether its id was answered: a retry
    # whose grant the quota now refuses must still find the first answer.
    seed(ledger, quota_leases=1)
    first = leases.grant(ledger, "h1", _grant("req-1"), "agent:h1")
    reruns = transitions.reruns()
    again = leases.grant(ledger, "h1", _grant("req-1"), "agent:h1")
    assert again == first
    assert transitions.reruns() == reruns  # answered at the refusal, not by a rerun
    assert (_count(ledger, Lease), _count(ledger, AgentRequest)) == (1, 1)
    with ledger.read() as s:
        lease_events = select(func.count()).where(Event.lease_id.is_not(None))
        assert s.scalar(lease_events) == 2  # the first grant's and activate


def test_another_host_reusing_the_id_is_independent(ledger: Ledger) -> None:
    seed(ledger)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    one = leases.grant(ledger, "h1", _grant("same"), "agent:h1")
    two = leases.grant(ledger, "h2", _grant("same"), "agent:h2")
    assert one.id != two.id
    assert (one.host, two.host) == ("h1", "h2")
    assert _count(ledger, Lease) == 2


def test_a_retried_op_batch_gets_the_first_answer(ledger: Ledger) -> None:
    seed(ledger)
    a = leases.grant(ledger, "h1", _grant(), "agent:h1")
    b = leases.grant(ledger, "h1", _grant(), "agent:h1")
    ops = [LeaseOp(lease_id=b.id, op="release"), LeaseOp(lease_id=a.id, op="release")]
    first = op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch-1")
    assert [(r.lease_id, r.state, r.code) for r in first] == [
        (b.id, "released", None),
        (a.id, "released", None),
    ]
    again = op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch-1")
    assert again == first
    # Without the id the replay is refused op by op (and still changes nothing).
    replay = op_batches.apply_ops(ledger, "h1", ops, "agent:h1")
    assert {r.code for r in replay} == {"lease_not_active"}
    with ledger.read() as s:
        releases = s.scalar(select(func.count()).where(Event.kind == "lease.release"))
    assert releases == 2


def test_a_retried_op_batch_is_found_at_its_answers_key(ledger: Ledger) -> None:
    # A batch's first attempt does not ask whether its id was answered: a replay runs,
    # meets the first answer's unique key, rolls back and is answered by its rerun,
    # counted under its own cause.
    seed(ledger)
    a = leases.grant(ledger, "h1", _grant(), "agent:h1")
    ops = [LeaseOp(lease_id=a.id, op="release")]
    first = op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch-1")
    before = transitions.reruns().get(("lost_race", "request_id"), 0)
    assert op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch-1") == first
    assert transitions.reruns().get(("lost_race", "request_id"), 0) == before + 1
    assert _count(ledger, AgentRequest) == 1


def test_ops_of_one_lease_keep_their_order(ledger: Ledger) -> None:
    seed(ledger)
    a = leases.grant(ledger, "h1", _grant(size_bytes=4 * MiB), "agent:h1")
    b = leases.grant(ledger, "h1", _grant(size_bytes=4 * MiB), "agent:h1")
    hi, lo = sorted([a.id, b.id], reverse=True)
    ops = [
        LeaseOp(lease_id=hi, op="shrink", length_bytes=2 * MiB),
        LeaseOp(lease_id=lo, op="release"),
        LeaseOp(lease_id=hi, op="release"),
    ]
    results = op_batches.apply_ops(ledger, "h1", ops, "agent:h1")
    assert [(r.lease_id, r.state, r.code) for r in results] == [
        (hi, "active", None),
        (lo, "released", None),
        (hi, "released", None),
    ]


def test_an_id_reused_for_another_kind_is_refused(ledger: Ledger) -> None:
    seed(ledger)
    a = leases.grant(ledger, "h1", _grant("x"), "agent:h1")
    with pytest.raises(BadRequest) as refused:
        op_batches.apply_ops(
            ledger, "h1", [LeaseOp(lease_id=a.id, op="release")], "agent:h1", request_id="x"
        )
    assert refused.value.code == "bad_request"


def test_the_reaper_forgets_old_request_ids(ledger: Ledger) -> None:
    seed(ledger)
    leases.grant(ledger, "h1", _grant("old"), "agent:h1")
    leases.grant(ledger, "h1", _grant("new"), "agent:h1")
    with ledger.write() as s:
        s.execute(
            update(AgentRequest)
            .where(AgentRequest.request_id == "old")
            .values(created_at=utcnow() - timedelta(hours=2))
        )
    Reaper(ledger, ReaperPolicy(request_retention_s=3600)).run_once()
    with ledger.read() as s:
        assert set(s.scalars(select(AgentRequest.request_id))) == {"new"}
    # Forgotten: a (very late) retry of it would be a new grant.
    leases.grant(ledger, "h1", _grant("old"), "agent:h1")
    assert _count(ledger, Lease) == 3


@pytest.mark.postgres
def test_concurrent_duplicates_make_one_lease(ledger: Ledger) -> None:
    if ledger.is_sqlite:
        pytest.skip("SQLite serialises writers: the duplicate always sees the first row")
    seed(ledger, quota_leases=10_000)
    for n in range(25):
        request = _grant(f"dup-{n}")
        call = functools.partial(leases.grant, ledger, "h1", request, "agent:h1")
        grants = at_once(call, call)
        assert grants[0] == grants[1]
        assert _count(ledger, Lease) == n + 1

    # The same for op batches: both answers are the first, applied once.
    with ledger.read() as s:
        ids = sorted(s.scalars(select(Lease.id)))
    ops = [LeaseOp(lease_id=x, op="release") for x in ids]
    answers = at_once(
        lambda: op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch"),
        lambda: op_batches.apply_ops(ledger, "h1", ops, "agent:h1", request_id="batch"),
    )
    assert answers[0] == answers[1]
    assert {r.state for r in answers[0]} == {"released"}
    with ledger.read() as s:
        releases = s.scalar(select(func.count()).where(Event.kind == "lease.release"))
    assert releases == len(ids)
