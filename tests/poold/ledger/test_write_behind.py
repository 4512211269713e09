"""Does an op batch that holds its lease inserts and moves for its end
(poold/ledger/write_behind.py, PostgreSQL's first attempt) record what writing each at once
records, in a number of statements that does not grow with the batch? SQLite and
PostgreSQL alike for the records; the count on PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from poold.ledger import op_batches
from poold.ledger.db import Ledger
from poold.ledger.models import Event, Lease
from poold.wire.agent import LeaseOp
from tests.poold.conftest import MiB, device, local_grant_op, seed
from tests.poold.ledger.test_local_commit import _delegated, _ops


def _lease_events(ledger: Ledger) -> dict[str, list[str]]:
    with ledger.read() as s:
        rows = s.execute(
            select(Event.lease_id, Event.kind).where(Event.lease_id.is_not(None)).order_by(Event.id)
        )
        out: dict[str, list[str]] = {}
        for lease_id, kind in rows:
            out.setdefault(lease_id, []).append(kind)
    return out


def test_a_batch_reusing_released_bytes_and_acting_twice_on_a_lease_records_each_op(
    ledger: Ledger,
) -> None:
    """A chain on one extent (granted, released, granted again over it: an agent's reuse
    of its tenant's released bytes) writes what waits before the insert over it; a lease
    released dirty then scrubbed in the same batch is read the second time as the batch
    left it; a shrink reads and writes its own row; a release of a lease another op of
    the batch already ended is refused alone."""
    seed(ledger, quota_bytes=64 * MiB, quota_leases=20)
    d = _delegated(ledger, reserve=16 * MiB, budget=16 * MiB, leases=10)
    assert _ops(ledger, [local_grant_op(d, "old", 8 * MiB, length=4 * MiB, epoch=0)]) == [
        ("active", None)
    ]
    ops = [
        LeaseOp(lease_id="old", op="release_dirty", reason="released"),
        LeaseOp(lease_id="old", op="scrubbed", reason="zeroed"),
        local_grant_op(d, "A", 0, epoch=1),
        LeaseOp(lease_id="A", op="release", reason="released"),
        local_grant_op(d, "B", 0, epoch=2),  # A's bytes, A's release still held
        LeaseOp(lease_id="B", op="release", reason="released"),
        local_grant_op(d, "C", 0, epoch=3),
        local_grant_op(d, "S", 2 * MiB, length=4 * MiB, epoch=4),
        LeaseOp(lease_id="S", op="shrink", length_bytes=2 * MiB, reason="gave back"),
        LeaseOp(lease_id="A", op="release", reason="again"),
    ]
    got = _ops(ledger, ops)
    assert got[:9] == [
        ("scrubbing", None),
        ("reclaimed", None),
        ("active", None),
        ("released", None),
        ("active", None),
        ("released", None),
        ("active", None),
        ("active", None),
        ("active", None),
    ]
    assert got[9] == (None, "lease_not_active")  # A had ended: refused alone
    with ledger.read() as s:
        rows = {r.id: r for r in s.execute(select(Lease.id, Lease.state, Lease.length_bytes))}
    assert {k: r.state for k, r in rows.items()} == {
        "old": "reclaimed",
        "A": "released",
        "B": "released",
        "C": "active",
        "S": "active",
    }
    assert rows["S"].length_bytes == 2 * MiB
    events = _lease_events(ledger)
    assert events["A"] == events["B"] == ["lease.grant", "lease.activate", "lease.release"]
    assert events["old"][-2:] == ["lease.release_dirty", "lease.scrubbed"]
    assert events["S"] == ["lease.grant", "lease.activate", "lease.shrink"]


def test_a_batchs_statements_do_not_grow_with_its_leases(
    ledger: Ledger, statements: list[str]
) -> None:
    if ledger.engine.dialect.name != "postgresql":
        pytest.skip("SQLite writes each at once: a statement there costs microseconds")
    seed(
        ledger,
        devices=[device(capacity_bytes=4096 * MiB)],
        quota_bytes=1 << 40,
        quota_leases=10_000,
    )
    d = _delegated(ledger, reserve=512 * MiB, budget=512 * MiB, leases=1000)
    counts = []
    for n, first in ((4, 0), (48, 4)):  # epochs inside the reservation's block
        granted = [
            local_grant_op(d, f"L{i}", i * 2 * MiB, epoch=i) for i in range(first, first + n)
        ]
        released = [LeaseOp(lease_id=f"L{i}", op="release") for i in range(first, first + n)]
        statements.clear()
        results = op_batches.apply_ops(ledger, "h1", granted + released, "agent:h1")
        assert [(r.state, r.code) for r in results] == [("active", None)] * n + [
            ("released", None)
        ] * n
        counts.append(len(statements))
    assert counts[1] == counts[0], counts
    with ledger.read() as s:
        live = s.scalars(select(Lease.id).where(Lease.state == "active"))
        assert list(live) == []
