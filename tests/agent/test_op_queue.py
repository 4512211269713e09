"""The order of the agent's queued lease ops and renewals (agent/op_queue.py)."""

from __future__ import annotations

from agent.op_queue import MAX_BATCH_OPS, OpQueue
from poold.wire.agent import LeaseOp


def op(lease_id: str, kind: str = "release") -> LeaseOp:
    return LeaseOp(lease_id=lease_id, op=kind, reason="test")


def ids(ops: list[LeaseOp]) -> list[str]:
    return [o.lease_id for o in ops]


def test_a_leases_later_op_waits_while_an_earlier_one_is_on_its_way() -> None:
    q = OpQueue()
    q.add(op("a", "release_dirty"))
    first = q.take(None)
    q.add(op("a", "scrubbed"))
    q.add(op("b"))
    assert ids(q.take(None)) == ["b"]  # a's scrub waits for its release_dirty
    assert q.lease_ids() == {"a", "b"}
    q.delivered(first)
    assert [o.op for o in q.take(None)] == ["scrubbed"]


def test_a_failed_batch_goes_first_again_unchanged_under_its_request_id() -> None:
    q = OpQueue()
    q.add(op("a"))
    nxt = q.next_batch(None, fresh=True)
    assert nxt is not None
    batch, fresh = nxt
    assert fresh and ids(batch.ops) == ["a"]
    q.add(op("a", "unmapped"))
    q.add(op("b"))
    q.put_back(batch)  # poold did not answer
    q.delivered(batch.ops)
    assert q.size() == 3
    again = q.next_batch(None, fresh=True)
    assert again is not None
    assert again[0] is batch and again[1] is False  # the same ops, the same id
    # While it is on its way, a's later op still waits; b may go in a batch of its own.
    later = q.next_batch(None, fresh=True)
    assert later is not None and ids(later[0].ops) == ["b"]
    assert later[0].request_id != batch.request_id
    assert q.next_batch(None, fresh=True) is None
    q.delivered(batch.ops)
    q.delivered(later[0].ops)
    last = q.next_batch(None, fresh=True)
    assert last is not None and [o.op for o in last[0].ops] == ["unmapped"]


def test_nothing_fresh_is_taken_unless_asked() -> None:
    q = OpQueue()
    q.add(op("a"))
    assert q.next_batch(None, fresh=False) is None
    assert q.queued_count() == 1


def test_a_batch_holds_at_most_max_batch_ops() -> None:
    q = OpQueue()
    for n in range(MAX_BATCH_OPS + 5):
        q.add(op(f"l{n}"))
    assert len(q.take(None)) == MAX_BATCH_OPS
    assert q.queued_count() == 5


def test_a_tenants_local_ops_go_one_request_at_a_time() -> None:
    """While a tenant's local op is on its way, that tenant's later ones wait (one
    request at a time); another tenant's pass."""
    owners = {"a": "t", "a2": "t", "b": "t", "c": "u"}
    q = OpQueue()
    q.add(op("a"))
    q.add(op("a2"))
    q.add(op("c"))
    riding = q.take(owners.get, for_tenant="t")
    assert ids(riding) == ["a", "a2"]  # a grant of t carries t's local ops, not u's
    q.add(op("b"))
    assert ids(q.take(owners.get)) == ["c"]  # b waits for the request a and a2 are in
    q.delivered(riding)
    assert ids(q.take(owners.get)) == ["b"]


def test_a_central_lease_op_rides_on_any_grant() -> None:
    owners = {"local": "u"}
    q = OpQueue()
    q.add(op("central"))
    q.add(op("local"))
    assert ids(q.take(owners.get, for_tenant="t")) == ["central"]
    assert ids(q.take(owners.get, for_tenant="")) == []  # "": no local op of anyone
    assert ids(q.take(owners.get)) == ["local"]


def test_a_renewal_is_replaced_by_a_later_one_and_dropped_by_an_op() -> None:
    q = OpQueue()
    q.renew_later("a", 30)
    q.renew_later("a", 60)
    q.renew_later("b", 30)
    q.add(op("b"))  # released: its renewal would be refused
    assert q.take_renewals() == {"a": 60}
    assert q.renewal_count() == 0


def test_renewals_a_heartbeat_did_not_deliver_come_back_unless_renewed_again() -> None:
    q = OpQueue()
    q.renew_later("a", 30)
    q.renew_later("b", 30)
    sent = q.take_renewals()
    q.renew_later("a", 90)  # renewed again while the heartbeat failed
    q.keep_renewals(sent)
    assert q.take_renewals() == {"a": 90, "b": 30}
