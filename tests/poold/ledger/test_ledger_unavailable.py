"""Is a ledger database that is down `ledger_unavailable`, logged once, and is it used again
at once when it is back? On a dedicated PostgreSQL this test stops and starts, and SQLite."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from poold.errors import LedgerUnavailable
from poold.ledger import db, hosts, migrate, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Host
from poold.ledger.reaper import Reaper, ReaperPolicy
from tests import pg


class _Orig(Exception):
    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _op(message: str, sqlstate: str | None = None) -> OperationalError:
    return OperationalError("SELECT 1", {}, _Orig(message, sqlstate))


def test_classify_tells_an_outage_from_contention_and_from_a_bug() -> None:
    assert db.classify(_op("x", "57P01")) == "down"  # admin shutdown
    assert db.classify(_op("x", "08006")) == "down"
    assert db.classify(_op("server closed the connection unexpectedly")) == "down"
    assert db.classify(_op("unable to open database file")) == "down"
    assert db.classify(_op("disk I/O error")) == "down"
    assert db.classify(_op("deadlock detected", "40P01")) == "contention"
    assert db.classify(_op("could not serialize access", "40001")) == "contention"
    assert db.classify(_op("database is locked")) == "contention"
    assert db.classify(_op("syntax error", "42601")) is None
    unique = IntegrityError("INSERT", {}, _Orig("duplicate key value", "23505"))
    assert db.classify(unique) is None
    assert db.classify(ValueError("no")) is None


def test_sqlite_file_that_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    ledger = Ledger(f"sqlite:///{tmp_path / 'gone' / 'ledger.db'}")
    try:
        with pytest.raises(LedgerUnavailable), ledger.read() as s:
            s.execute(text("SELECT 1"))
    finally:
        ledger.dispose()


def test_no_connection_free_in_time_is_ledger_unavailable(ledger_url: str) -> None:
    # Every pooled connection busy past the pool's timeout (a 500 before): retryable.
    ledger = Ledger(ledger_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        with ledger.read() as s:
            s.execute(select(Host.id)).all()  # holds the one connection
            with pytest.raises(LedgerUnavailable) as caught, ledger.write_conn():
                pass
        assert caught.value.detail["reason"] == "busy"
        with ledger.write_conn() as conn:  # free again
            conn.execute(select(Host.id)).all()
    finally:
        ledger.dispose()


def test_contention_past_the_bound_is_ledger_unavailable() -> None:
    calls = 0

    def deadlocked() -> None:
        nonlocal calls
        calls += 1
        raise _op("deadlock detected", "40P01")

    with pytest.raises(LedgerUnavailable) as err:
        transitions.retrying(deadlocked, what="test")
    assert err.value.code == "ledger_unavailable"
    assert calls == transitions.CONTENTION_ATTEMPTS


@pytest.fixture
def own_pg() -> Iterator[pg.PgServer]:
    """A PostgreSQL of this test's own: it is stopped and started."""
    try:
        server = pg.start_server()
    except Exception as exc:
        pytest.skip(f"PostgreSQL not available: {exc}")
    yield server
    server.stop()


def _pg_ctl(server: pg.PgServer, *args: str) -> None:
    subprocess.run(
        [str(server.bindir / "pg_ctl"), "-D", str(server.data), *args],
        check=True,
        capture_output=True,
        user=server.user,
        group=server.user,
        cwd=server.root,
    )


def restart_args(server: pg.PgServer) -> list[str]:
    opts = (
        f"-c listen_addresses=127.0.0.1 -c port={server.port} "
        f"-c unix_socket_directories={server.root} -c fsync=off"
    )
    return ["-o", opts, "-l", str(server.root / "log"), "-w", "-t", "60", "start"]


@pytest.mark.postgres
def test_an_outage_is_unavailable_logged_once_and_recovery_is_immediate(
    own_pg: pg.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = own_pg.url("postgres")
    migrate.upgrade(url)
    ledger = Ledger(url)
    try:
        hosts.add_host(ledger, "h1", "test")
        # Fill the pool with connections that the restart will kill.
        with ledger.read() as a, ledger.read() as b:
            a.execute(text("SELECT 1"))
            b.execute(text("SELECT 1"))
        _pg_ctl(own_pg, "-m", "fast", "-w", "stop")
        caplog.set_level(logging.INFO, logger="poold")
        for _ in range(5):
            with pytest.raises(LedgerUnavailable):
                hosts.list_hosts(ledger)
        with pytest.raises(LedgerUnavailable):
            Reaper(ledger, ReaperPolicy()).run_once()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert not any(r.exc_info for r in caplog.records)
        _pg_ctl(own_pg, *restart_args(own_pg))
        # The very first transaction after recovery succeeds (dead pooled connections
        # are discarded by the pre-ping), and the recovery is logged once.
        assert [h.name for h in hosts.list_hosts(ledger)] == ["h1"]
        with ledger.read() as s:
            assert s.scalar(select(Host.generation)) == 0
        infos = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(infos) == 1, infos
    finally:
        ledger.dispose()


def _kill_own_connection(ledger: Ledger) -> None:
    with ledger.write() as s:
        s.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        s.execute(text("SELECT 1"))


@pytest.mark.postgres
def test_a_connection_killed_mid_transaction_is_unavailable_then_replaced(
    own_pg: pg.PgServer,
) -> None:
    url = own_pg.url("postgres")
    migrate.upgrade(url)
    ledger = Ledger(url)
    try:
        with pytest.raises(LedgerUnavailable):
            _kill_own_connection(ledger)
        with ledger.read() as s:
            assert s.scalar(text("SELECT 1")) == 1
    finally:
        ledger.dispose()
