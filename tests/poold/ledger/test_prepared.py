"""Do the hot path's statements on the driver's cursor (`db.Prepared`) read and write what
SQLAlchemy's own execution would, fail as it would, and is a dead pooled connection
retried instead of answered `ledger_unavailable`?"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from sqlalchemy import bindparam, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from poold.errors import BadRequest
from poold.ledger import agent_requests, db, hosts, leases, op_batches, transitions
from poold.ledger.db import Ledger, Prepared, PreparedIn, classify
from poold.ledger.models import Event, Lease
from poold.wire.agent import GrantRequest, LeaseOp
from tests.poold.conftest import UID, MiB, seed

_LEASE_ROW = select(
    Lease.id,
    Lease.state,
    Lease.granted_at,
    Lease.expires_at,
    Lease.ended_at,
    Lease.labels,
    Lease.length_bytes,
).where(Lease.id == bindparam("lease_id"))


def _grant(ledger: Ledger, request_id: str | None = None) -> str:
    req = GrantRequest(
        request_id=request_id,
        tenant="t1",
        size_bytes=2 * MiB,
        uid=UID,
        pid=1,
        labels={"model": "llama", "é": "ü"},
        activate=True,
    )
    return leases.grant(ledger, "h1", req, "agent:h1").id


def test_a_statement_over_a_list_reads_and_writes_what_an_in_list_does(ledger: Ledger) -> None:
    """`PreparedIn` (ANY over an array on PostgreSQL, an expanding IN elsewhere): the rows
    an IN list selects, by name and by position, typed as Core types them; an UPDATE's
    rowcount; ids that match nothing match nothing."""
    seed(ledger)
    ids = sorted(_grant(ledger) for _ in range(3))
    columns = _LEASE_ROW.selected_columns
    listed = PreparedIn(
        lambda member: select(*columns).where(member(Lease.id, "ids")).order_by(Lease.id)
    )
    touch = PreparedIn(
        lambda member: (
            update(Lease).where(member(Lease.id, "ids")).values(labels=bindparam("new_labels"))
        )
    )
    with ledger.write_conn() as conn:
        core = conn.execute(select(*columns).where(Lease.id.in_(ids[:2])).order_by(Lease.id)).all()
        mine = listed.rows(conn, {"ids": [ids[1], ids[0], "nope"]})
        assert [tuple(r) for r in mine] == [tuple(r) for r in core]
        assert [r.id for r in mine] == ids[:2] and mine[0].granted_at.tzinfo is not None
        assert listed.rows(conn, {"ids": ["nope"]}) == []
        assert touch.write(conn, {"ids": [*ids[1:], "nope"], "new_labels": {"k": "v"}}) == 2
        labels = listed.rows(conn, {"ids": ids})
        assert [r.labels for r in labels] == [{"model": "llama", "é": "ü"}, {"k": "v"}, {"k": "v"}]


def test_prepared_rows_equal_core_rows(ledger: Ledger) -> None:
    seed(ledger)
    lease_id = _grant(ledger, str(uuid.uuid4()))
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=lease_id, op="release")], "agent:h1")
    fast = Prepared(_LEASE_ROW)
    with ledger.read() as s:
        conn = s.connection()
        core = conn.execute(_LEASE_ROW, {"lease_id": lease_id}).one()
        mine = fast.one_or_none(conn, {"lease_id": lease_id})
        assert mine is not None
        assert tuple(mine) == tuple(core)
        assert mine.granted_at.tzinfo is not None and mine.labels["é"] == "ü"
        assert mine.state == "released" and mine.ended_at is not None
        assert fast.one_or_none(conn, {"lease_id": "nope"}) is None
        assert fast.scalar(conn, {"lease_id": lease_id}) == lease_id
        # Plain tuples: the same values, their result processing (JSON, datetimes) done.
        assert fast.tuples(conn, {"lease_id": lease_id}) == [tuple(core)]
        assert fast.tuples(conn, {"lease_id": "nope"}) == []


def test_prepared_errors_are_sqlalchemy_errors(ledger: Ledger) -> None:
    seed(ledger)
    host_id = hosts.host_id_of(ledger, "h1")

    def twice() -> None:
        with ledger.write_conn() as conn:
            for _ in range(2):
                agent_requests.remember(conn, host_id, "r-1", agent_requests.GRANT, {"a": 1})

    with pytest.raises(IntegrityError) as caught:
        twice()
    assert agent_requests.is_duplicate(caught.value)
    assert classify(caught.value) is None  # a constraint, not an outage
    with ledger.read() as s:  # nothing of the failed transaction stayed
        assert agent_requests.recall(s.connection(), host_id, "r-1", "grant") is None


def test_rows_inserted_in_one_statement_read_back_as_core_inserted_them(ledger: Ledger) -> None:
    """`InsertRows` (one json_to_recordset statement on PostgreSQL): the same events,
    in order, as SQLAlchemy's own INSERT of them, datetimes in UTC, nulls, nested JSON
    and text JSON would escape; a value the column cannot hold is the ledger's
    bad_request and writes nothing; a naive datetime is refused as Core's type does."""
    seed(ledger)
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    rows = [
        transitions.event_row(
            actor="agent:h1",
            kind=f"test.{i}",
            at=at + timedelta(seconds=i),
            lease_id=None if i % 2 else f"L{i}",
            tenant_id=i,
            reason='a "quoted" reason,\nover é lines\\' if i else None,
            detail={"n": i, "nested": {"list": [1, None, "ü"]}, "flag": True} if i else {},
        )
        for i in range(5)
    ]
    writer = db.InsertRows(insert(Event), transitions.EVENT_COLUMNS)
    columns = [getattr(Event, c) for c in transitions.EVENT_COLUMNS]
    with ledger.write_conn() as conn:
        writer.write(conn, rows)
        conn.execute(insert(Event), [{**r, "kind": "core." + r["kind"]} for r in rows])
    with ledger.read() as s:
        ours = s.execute(select(*columns).where(Event.kind.like("test.%")).order_by(Event.id))
        core = s.execute(select(*columns).where(Event.kind.like("core.%")).order_by(Event.id))
        got = [{**r._asdict(), "kind": r.kind[len("test.") :]} for r in ours]
        assert got == [{**r._asdict(), "kind": r.kind[len("core.test.") :]} for r in core]
    assert [r["kind"] for r in got] == ["0", "1", "2", "3", "4"]
    assert got[1]["at"] == at.astimezone(UTC) + timedelta(seconds=1)
    assert got[1]["detail"] == {"n": 1, "nested": {"list": [1, None, "ü"]}, "flag": True}
    assert got[1]["reason"] == 'a "quoted" reason,\nover é lines\\'
    if ledger.engine.dialect.name == "postgresql":  # SQLite keeps any length
        too_long = [dict(rows[0], actor="x" * 200), rows[1]]
        with pytest.raises(BadRequest, match="too long"), ledger.write_conn() as conn:
            writer.write(conn, too_long)
    with ledger.read() as s:
        assert s.scalar(select(func.count()).where(Event.kind.like("test.%"))) == 5
    with pytest.raises(ValueError, match="naive"), ledger.write_conn() as conn:
        writer.write(conn, [dict(rows[0], at=datetime(2026, 1, 1)), rows[1]])


def test_a_repeated_grant_request_is_answered_from_the_stored_reply(ledger: Ledger) -> None:
    seed(ledger)
    first = _grant(ledger, "same-id")
    assert _grant(ledger, "same-id") == first
    with ledger.read() as s:
        assert s.scalar(select(Lease.id).where(Lease.id != first)) is None


@pytest.mark.postgres
def test_a_pooled_connection_dropped_by_the_server_is_retried_not_unavailable(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ledger.is_sqlite:
        pytest.skip("PostgreSQL: the server drops the connection")
    monkeypatch.setattr(db, "POOL_IDLE_PING_S", 3600.0)  # no ping: the first use finds it
    seed(ledger)
    _grant(ledger)  # leaves its connection in the pool
    with ledger.read() as s:
        own = s.scalar(text("SELECT pg_backend_pid()"))
    conninfo = ledger.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert killed is not None and killed[0] >= 1, own
    stale: list[bool] = []

    def counted(exc: BaseException) -> bool:
        stale.append(db.is_stale_connection(exc))
        return stale[-1]

    monkeypatch.setattr(transitions, "is_stale_connection", counted)
    second = _grant(ledger)  # a write on a dead pooled connection: rerun, not 503
    assert second
    assert stale == [True]  # met once, rerun once
    assert ledger.health.down_since is None  # not counted as an outage
