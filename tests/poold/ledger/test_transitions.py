"""The journal's batching (poold/ledger/transitions.py `events_at_end`), on a real ledger."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from poold.ledger import transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Event, Tenant
from poold.ledger.transitions import event_row
from tests.poold.conftest import seed


def _kinds(ledger: Ledger) -> list[str]:
    with ledger.read() as s:
        return list(s.scalars(select(Event.kind).order_by(Event.id)))


def _batch_that_fails(ledger: Ledger, kind: str, *, drop: bool) -> None:
    with ledger.write_conn() as conn, transitions.events_at_end(conn):
        transitions.record(conn, event_row(actor="t", kind=kind))
        if drop:
            conn.invalidate()
            raise RuntimeError("dropped")
        raise RuntimeError("the batch failed")


def test_events_held_for_the_end_are_written_in_order_and_not_on_an_error(
    ledger: Ledger,
) -> None:
    with ledger.write_conn() as conn, transitions.events_at_end(conn):
        transitions.record(conn, event_row(actor="t", kind="a"))
        transitions.record(conn, event_row(actor="t", kind="b"), event_row(actor="t", kind="c"))
        with transitions.events_at_end(conn):  # nested: the outer block writes them
            transitions.record(conn, event_row(actor="t", kind="d"))
        assert _kinds(ledger) == []  # another transaction: nothing yet
    assert _kinds(ledger) == ["a", "b", "c", "d"]
    with pytest.raises(RuntimeError):
        _batch_that_fails(ledger, "e", drop=False)
    with ledger.write_conn() as conn:  # the same pooled connection: nothing held over
        transitions.record(conn, event_row(actor="t", kind="f"))
    assert _kinds(ledger) == ["a", "b", "c", "d", "f"]


def test_a_connection_dropped_inside_the_block_raises_the_error_that_dropped_it(
    ledger: Ledger,
) -> None:
    # The database dropping the connection invalidates it; the block's end must not
    # read the connection again (PendingRollbackError would hide the outage, which the
    # ledger answers as ledger_unavailable).
    with pytest.raises(RuntimeError, match="dropped"):
        _batch_that_fails(ledger, "x", drop=True)
    assert _kinds(ledger) == []


def test_reruns_are_counted_by_cause_and_the_row_whose_swap_was_lost(ledger: Ledger) -> None:
    """A real swap lost on a real row, then won: `retrying` ran the transaction twice and
    counts the one rerun under the row's table (poold_ledger_reruns_total)."""
    seed(ledger)
    with ledger.read() as s:
        device_id, generation = s.execute(select(Device.id, Device.generation)).one()
    before = transitions.reruns()
    seen = [generation - 1, generation]  # a stale read first, then the row as it is

    def attempt() -> int:
        with ledger.write_conn() as conn:
            transitions.swap_or_rerun(conn, Device, device_id, seen.pop(0))
            return 1

    assert transitions.retrying(attempt, what="test") == 1
    after = transitions.reruns()
    key = ("lost_race", "devices")
    assert after.get(key, 0) - before.get(key, 0) == 1
    assert {k: v for k, v in after.items() if k != key} == {
        k: v for k, v in before.items() if k != key
    }


def test_swapping_several_rows_at_once_loses_as_a_whole(ledger: Ledger) -> None:
    """`swap_all_or_rerun`: one stale generation among them is a lost race, and the
    transaction it ran in commits none of the swaps; all current, each moves by one."""
    seed(ledger)
    seed(ledger, host="h2", tenant="t2")
    with ledger.read() as s:
        seen = dict(s.execute(select(Tenant.id, Tenant.generation).order_by(Tenant.id)).all())
    stale = {i: g - (1 if n == 0 else 0) for n, (i, g) in enumerate(seen.items())}
    with pytest.raises(transitions.LostRace) as lost, ledger.write_conn() as conn:
        transitions.swap_all_or_rerun(conn, Tenant, stale)
    assert lost.value.row == "tenants"
    with ledger.read() as s:
        assert dict(s.execute(select(Tenant.id, Tenant.generation)).all()) == seen
    with ledger.write_conn() as conn:
        transitions.swap_all_or_rerun(conn, Tenant, seen)
    with ledger.read() as s:
        after = dict(s.execute(select(Tenant.id, Tenant.generation)).all())
    assert after == {i: g + 1 for i, g in seen.items()}
