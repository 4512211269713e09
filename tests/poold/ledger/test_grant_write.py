"""Does a central grant's write keep its all-or-nothing? On PostgreSQL one statement,
on SQLite several: a lost generation swap writes nothing and names the row lost."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import func, select

from poold.ledger import grant_write, news, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import AgentRequest, Device, Event, Host, Lease, Tenant
from poold.ledger.transitions import event_row
from poold.ledger.types import utcnow
from tests.poold.conftest import MiB, seed


def _ids_and_generations(ledger: Ledger) -> tuple[tuple[int, int, int], list[int]]:
    with ledger.read() as s:
        rows = [s.execute(select(m.id, m.generation)).one() for m in (Host, Device, Tenant)]
    return (rows[0][0], rows[1][0], rows[2][0]), [int(r[1]) for r in rows]


def _lease(ids: tuple[int, int, int], epoch: int) -> dict[str, object]:
    now = utcnow()
    return {
        "id": "00000000-0000-4000-8000-000000000001",
        "tenant_id": ids[2],
        "host_id": ids[0],
        "device_id": ids[1],
        "offset_bytes": 0,
        "length_bytes": 2 * MiB,
        "requested_bytes": 2 * MiB,
        "state": "active",
        "ttl_s": 60,
        "epoch": epoch,
        "granted_at": now,
        "activated_at": now,
        "expires_at": now,
        "ended_at": None,
        "holder_uid": 1000,
        "holder_gid": None,
        "holder_pid": 1,
        "labels": {"k": "v"},
        "exclusive_bytes": 0,
        "replica_bytes": 0,
        "reported_at": None,
        "reservation_id": None,
    }


def _write(ledger: Ledger, seen: list[int], answer: bool = True) -> None:
    ids, _ = _ids_and_generations(ledger)
    lease = _lease(ids, epoch=seen[1] + 1)
    events = [
        event_row(
            actor="agent:h1",
            kind="lease.grant",
            lease_id=str(lease["id"]),
            tenant_id=ids[2],
            host_id=ids[0],
            device_id=ids[1],
            to_state="granted",
            detail={"epoch": seen[1] + 1},
        )
    ]
    with ledger.write_conn() as conn:
        grant_write.write(
            conn,
            ids,
            seen,
            lease,
            events,
            (ids[0], "req-1", {"id": lease["id"]}) if answer else None,
        )


def _counts(ledger: Ledger) -> tuple[int, int, int]:
    with ledger.read() as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(m)) or 0)
            for m in (Lease, Event, AgentRequest)
        )


def test_the_write_makes_the_lease_its_events_and_answer_and_swaps(ledger: Ledger) -> None:
    seed(ledger)
    _ids, seen = _ids_and_generations(ledger)
    events_before = _counts(ledger)[1]
    _write(ledger, seen)
    assert _counts(ledger) == (1, events_before + 1, 1)
    _ids, after = _ids_and_generations(ledger)
    assert after == [g + 1 for g in seen]
    with ledger.read() as s:
        lease = s.execute(select(Lease)).scalar_one()
        event = s.execute(select(Event).where(Event.kind == "lease.grant")).scalar_one()
        answer = s.execute(select(AgentRequest)).scalar_one()
    assert (lease.labels, lease.length_bytes, lease.epoch) == ({"k": "v"}, 2 * MiB, seen[1] + 1)
    # The model's defaults for the columns a grant does not give, as the plain insert.
    assert (lease.used_bytes, lease.exclusive_blocks, lease.replica_blocks) == (0, 0, 0)
    assert (event.lease_id, event.detail) == (lease.id, {"epoch": seen[1] + 1})
    assert event.at.tzinfo is not None
    assert (answer.request_id, answer.kind, answer.response) == ("req-1", "grant", {"id": lease.id})


def test_without_a_request_id_nothing_is_remembered(ledger: Ledger) -> None:
    seed(ledger)
    _ids, seen = _ids_and_generations(ledger)
    _write(ledger, seen, answer=False)
    assert _counts(ledger)[0::2] == (1, 0)


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_a_lost_swap_writes_nothing_and_names_its_row(ledger: Ledger, lost: int) -> None:
    seed(ledger)
    _ids, seen = _ids_and_generations(ledger)
    before = _counts(ledger)
    stale = list(seen)
    stale[lost] -= 1  # another writer moved it since this grant read it
    with pytest.raises(transitions.LostRace) as caught:
        _write(ledger, stale)
    assert caught.value.row == ("hosts", "devices", "tenants")[lost]
    assert _counts(ledger) == before
    assert _ids_and_generations(ledger)[1] == seen  # the swaps before it rolled back too


def test_its_events_are_told_and_counted_like_any_recorded(ledger: Ledger) -> None:
    # What `transitions.record` does beside the INSERT runs for the one statement too:
    # news for what an agent did not do itself, and the events' count at commit.
    seed(ledger)
    ids, seen = _ids_and_generations(ledger)
    lease = _lease(ids, epoch=seen[1] + 1)
    events = [event_row(actor="admin:test", kind="lease.grant", host_id=ids[0])]
    listener = None
    if not ledger.is_sqlite:
        url = ledger.engine.url.set(drivername="postgresql")
        listener = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        listener.execute(f"LISTEN {news.CHANNEL}")
    told: list[set[int]] = []
    signal = ledger.news.signal
    ledger.news.signal = lambda host_ids: told.append(set(host_ids))  # type: ignore[method-assign]
    try:
        with ledger.write_conn() as conn:
            kinds: list[str] = []
            conn.info[transitions.PENDING_EVENTS] = kinds
            grant_write.write(conn, ids, seen, lease, events, None)
            assert kinds == ["lease.grant"]
    finally:
        ledger.news.signal = signal  # type: ignore[method-assign]
    if listener is None:
        assert told == [{ids[0]}]
        return
    with listener:
        heard = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert heard == [str(ids[0])]
