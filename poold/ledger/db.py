"""How poold talks to its ledger database: engines, transactions, pragmas.

SQLite (the default) runs in WAL mode with a busy timeout and foreign keys
on. Write transactions start with BEGIN IMMEDIATE: a deferred transaction
that later upgrades to a writer fails at once with "database is locked"
instead of waiting, which would turn ordinary contention into errors.

A database that is down, failing over or refusing connections is not a bug
of the request that met it: every transaction the Ledger hands out turns
such a failure into `LedgerUnavailable` (503, retryable; DESIGN.md "Scale"),
and so is contention the database resolved by aborting us (a deadlock, a
serialisation failure, SQLite still locked after the busy timeout), which
`transitions.retrying` runs again a bounded number of times first. A
constraint violation or a malformed statement stays what it is. The outage
is logged once when it starts and once when the ledger answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from poold.errors import BadRequest, LedgerUnavailable
from poold.ledger import news

log = logging.getLogger("poold.ledger")

SQLITE_BUSY_TIMEOUT_MS = 10_000

# SQLSTATEs (PostgreSQL appendix A) that say the server, not the statement, failed:
# class 08 connection exceptions, 53 insufficient resources (too many connections,
# out of memory/disk), 57P01-57P05 shutdown/crash/cannot connect now/idle timeouts,
# class 58 system errors (I/O).
_DOWN_STATE_PREFIXES = ("08", "53", "57P", "58")
# The database aborted us to resolve contention: running the transaction again is right.
_CONTENTION_STATES = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure
_DOWN_WORDS = (
    "server closed the connection",
    "terminating connection",
    "connection refused",
    "could not connect",
    "connection is closed",
    "connection is lost",
    "the connection is bad",
    "consuming input failed",
    "no connection to the server",
    "the database system is",  # ... starting up / shutting down / in recovery mode
    "unable to open database file",  # SQLite: the file or its directory went away
    "disk i/o error",
)
_CONTENTION_WORDS = ("deadlock detected", "could not serialize", "database is locked")

Failure = Literal["down", "contention"]


def classify(exc: BaseException) -> Failure | None:
    """Whether a database error means the ledger is unreachable ("down"), that the
    database aborted this transaction to resolve contention ("contention"), or
    neither (None: a constraint, a bad statement, a bug; it stays what it is)."""
    if not isinstance(exc, DBAPIError):
        return None
    if exc.connection_invalidated:
        return "down"
    orig = exc.orig
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    words = str(orig if orig is not None else exc).lower()
    if state in _CONTENTION_STATES or any(w in words for w in _CONTENTION_WORDS):
        return "contention"
    if isinstance(state, str) and state.startswith(_DOWN_STATE_PREFIXES):
        return "down"
    if any(w in words for w in _DOWN_WORDS):
        return "down"
    if isinstance(exc, InterfaceError):
        return "down"  # the driver's connection object is unusable
    if isinstance(exc, OperationalError) and state is None and "psycopg" in type(orig).__module__:
        # psycopg raises its client-side failures (connect refused, connection lost)
        # as OperationalError without a SQLSTATE; a server error always carries one.
        return "down"
    return None


def is_contention(exc: BaseException) -> bool:
    """A `LedgerUnavailable` (or database error) that running the transaction again may cure."""
    cause = exc.__cause__ if isinstance(exc, LedgerUnavailable) else exc
    return cause is not None and classify(cause) == "contention"


class Health:
    """Whether the ledger answers, as this process sees it: one WARNING when an outage
    starts, one INFO when it ends, nothing per request in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            first = self.down_since is None
            if first:
                self.down_since = time.monotonic()
            self.failures += 1
        if first:
            log.warning(
                "ledger database unreachable (logged once until it answers): %s", _brief(exc)
            )

    def succeeded(self) -> None:
        if self.down_since is None:  # the common case, without the lock
            return
        with self._lock:
            since, failures = self.down_since, self.failures
            self.down_since, self.failures = None, 0
        if since is not None:
            log.info(
                "ledger database reachable again after %.1fs (%d failed transaction(s))",
                time.monotonic() - since,
                failures,
            )


def _brief(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`, with the SQLite pragmas the ledger relies on."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            **kwargs,
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, **kwargs)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit BEGIN is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if engine.url.database not in (None, "", ":memory:"):
            cur.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable across application crashes in WAL mode; only an
        # OS crash can lose the last transactions, which the audit reconciles.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get("poold_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


@contextmanager
def _refused_values() -> Iterator[None]:
    """A value the database cannot store is the caller's error, not poold's.

    PostgreSQL refuses what SQLite takes (NUL in text, integers past int4,
    strings past their varchar length) with a DataError; reaching the API as
    a 500 it would read as a crash. Callers validate what they can first;
    this is the net under them.
    """
    try:
        yield
    except DataError as exc:
        first_line = str(exc.orig).splitlines()[0] if exc.orig is not None else str(exc)
        raise BadRequest(f"the ledger cannot store a value in this request: {first_line}") from exc


class Ledger:
    """The ledger database: hands out read and write transactions."""

    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self.url = url
        self.engine = make_engine(url, **engine_kwargs)
        self.health = Health()
        self._write_engine = self.engine.execution_options(poold_write=True)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        # Host name -> id. Hosts are never renamed or deleted, so this cannot go stale.
        self.host_ids: dict[str, int] = {}
        self._host_locks: dict[str, threading.Lock] = {}
        self._host_locks_guard = threading.Lock()
        # Agents waiting for news of their host (poold/ledger/news.py).
        self.news = news.HostNews()
        self._news_listener: news.NewsListener | None = None

    def host_lock(self, host_name: str) -> threading.Lock:
        """This process's lock for writers that would race on one host's generations."""
        with self._host_locks_guard:
            lock = self._host_locks.get(host_name)
            if lock is None:
                lock = self._host_locks[host_name] = threading.Lock()
            return lock

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One write transaction: committed on success, rolled back on any error."""
        with news.collecting() as told:
            with self._unavailable(), _refused_values(), self._write() as session, session.begin():
                yield session
            self.health.succeeded()
            if told:
                self.news.signal(told)  # after the commit: see poold/ledger/news.py

    @contextmanager
    def write_conn(self) -> Iterator[Connection]:
        """A write transaction on a bare Core connection: the lease hot path skips the ORM."""
        with news.collecting() as told:
            with self._unavailable(), _refused_values(), self._write_engine.begin() as conn:
                yield conn
            self.health.succeeded()
            if told:
                self.news.signal(told)

    def listen_for_news(self) -> None:
        """Hear other poolds' news too (PostgreSQL; once, from the first waiting agent)."""
        with self._host_locks_guard:
            if self._news_listener is not None:
                return
            conninfo = news.pg_conninfo(self.url)
            if conninfo is None:
                return  # SQLite: one poold, whose own commits signal
            self._news_listener = news.NewsListener(conninfo, self.news)
            self._news_listener.start()

    @contextmanager
    def read(self) -> Iterator[Session]:
        """One read transaction (rolled back at the end)."""
        with self._unavailable(), _refused_values(), self._read() as session, session.begin():
            yield session
        self.health.succeeded()

    @contextmanager
    def _unavailable(self) -> Iterator[None]:
        """The database failing under a transaction is `ledger_unavailable`, not a crash.

        Nothing of the transaction committed: the error came before or at COMMIT,
        and a COMMIT that failed on a lost connection did not happen (PostgreSQL
        aborts a transaction whose client went away). A connection the failure
        left dead was invalidated by SQLAlchemy; any other in the pool is checked
        by `pool_pre_ping` at its next checkout, so the first transaction after
        recovery gets a fresh one.
        """
        try:
            yield
        except DBAPIError as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if failure == "contention":
                raise LedgerUnavailable(
                    f"the ledger is contended, retry: {_brief(exc)}", reason="contention"
                ) from exc
            self.health.failed(exc)
            raise LedgerUnavailable(f"the ledger database is unreachable: {_brief(exc)}") from exc

    def dispose(self) -> None:
        if self._news_listener is not None:
            self._news_listener.stop()
            self._news_listener = None
        self.engine.dispose()
