"""The `shrink` op of an agent's outbox: a lease gives its tail back (pressure)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from poold.ledger import lease_views, op_batches
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Lease
from poold.ledger.types import utcnow
from poold.wire.agent import LeaseOp
from tests.poold.conftest import MiB, device, seed, snapshot
from tests.poold.ledger.test_leases import grant, release


def shrink(
    ledger: Ledger, lease_id: str, length: int, host: str = "h1"
) -> tuple[str | None, str | None]:
    [result] = op_batches.apply_ops(
        ledger,
        host,
        [LeaseOp(lease_id=lease_id, op="shrink", length_bytes=length)],
        f"agent:{host}",
    )
    return result.state, result.code


def test_shrink_frees_the_tail_for_the_next_grant(ledger: Ledger) -> None:
    seed(ledger)  # one 64 MiB device, 2 MiB alignment
    big = grant(ledger, 64 * MiB, activate=True)
    assert shrink(ledger, big.id, 16 * MiB) == ("active", None)
    row = lease_views.show(ledger, big.id)
    assert (row.offset_bytes, row.length_bytes, row.state) == (big.offset_bytes, 16 * MiB, "active")
    # The 48 MiB given back are placeable at once.
    other = grant(ledger, 48 * MiB, activate=True)
    assert other.offset_bytes == big.offset_bytes + 16 * MiB
    with ledger.read() as s:
        shrunk = s.execute(
            select(Event.kind, Event.from_state, Event.to_state, Event.detail).where(
                Event.lease_id == big.id, Event.kind == "lease.shrink"
            )
        ).one()
    assert tuple(shrunk)[:3] == ("lease.shrink", "active", "active")
    assert shrunk.detail == {"from_bytes": 64 * MiB, "to_bytes": 16 * MiB}


def test_shrink_covering_a_pressure_request_clears_its_deadline(ledger: Ledger) -> None:
    seed(ledger)
    a = grant(ledger, 32 * MiB, activate=True)
    deadline = utcnow() + timedelta(seconds=30)
    with ledger.write() as s:
        s.execute(
            update(Lease)
            .where(Lease.id == a.id)
            .values(shrink_wanted_bytes=10 * MiB, shrink_deadline_at=deadline)
        )
    # Part of it: the rest is still wanted, by the same deadline.
    assert shrink(ledger, a.id, 28 * MiB) == ("active", None)
    with ledger.read() as s:
        row = s.get(Lease, a.id)
        assert row is not None
        assert row.shrink_wanted_bytes == 6 * MiB and row.shrink_deadline_at == deadline
    # The rest: nothing left to revoke for.
    assert shrink(ledger, a.id, 22 * MiB) == ("active", None)
    with ledger.read() as s:
        row = s.get(Lease, a.id)
        assert row is not None
        assert row.shrink_wanted_bytes is None and row.shrink_deadline_at is None


def test_bad_shrinks_are_refused_and_change_nothing(ledger: Ledger) -> None:
    seed(ledger)
    seed(ledger, host="h2", devices=[device("dev-1")], tenant=None)
    a = grant(ledger, 8 * MiB, activate=True)
    done = grant(ledger, 2 * MiB, activate=True)
    release(ledger, done.id)
    before = snapshot(ledger)
    assert shrink(ledger, a.id, 8 * MiB)[1] == "invalid_size"  # not smaller
    assert shrink(ledger, a.id, 3 * MiB)[1] == "invalid_size"  # not aligned (2 MiB)
    assert shrink(ledger, done.id, 2 * MiB - 4096)[1] == "lease_not_active"
    assert shrink(ledger, "nope", MiB)[1] == "unknown_lease"
    assert shrink(ledger, a.id, 2 * MiB, host="h2")[1] == "not_owner"
    assert snapshot(ledger) == before


def test_the_wire_model_needs_a_length_for_shrink_and_only_for_it() -> None:
    with pytest.raises(ValidationError):
        LeaseOp(lease_id="x", op="shrink")
    with pytest.raises(ValidationError):
        LeaseOp(lease_id="x", op="release", length_bytes=MiB)
    with pytest.raises(ValidationError):
        LeaseOp(lease_id="x", op="shrink", length_bytes=0)
