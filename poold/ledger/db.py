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

import json
import logging
import sqlite3
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from operator import itemgetter
from typing import Any, Literal

from sqlalchemy import ARRAY, Connection, Engine, any_, bindparam, create_engine, event
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ClauseElement, ColumnElement
from sqlalchemy.sql.dml import Insert

from poold.errors import BadRequest, LedgerUnavailable
from poold.ledger import news
from poold.ledger.types import as_utc

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
    """An engine for `url`, with the SQLite pragmas the ledger relies on.

    No `pool_pre_ping`: it costs a round trip on every checkout, i.e. per transaction.
    Only a connection that sat idle in the pool is pinged (`_ping_after_idle`). One
    the database dropped while it was in steady use fails at the transaction's first
    statement instead, before anything was written; that failure is marked
    (`_track_first_use`) and `transitions.retrying` runs the transaction again at once
    on a fresh connection (SQLAlchemy invalidates the rest of the pool with it).
    """
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
            **kwargs,
        )
        _configure_sqlite(engine)
    else:
        engine = create_engine(url, **kwargs)
        _ping_after_idle(engine)
    _track_first_use(engine)
    return engine


# A pooled connection idle longer than this is pinged at checkout (one round trip);
# one in steady use is not, and a dead one is caught by `_track_first_use` instead.
POOL_IDLE_PING_S = 1.0
_CHECKED_IN_AT = "poold.checked_in_at"


def _ping_after_idle(engine: Engine) -> None:
    """`pool_pre_ping` for connections that sat idle: where a restart most likely hid."""

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_CHECKED_IN_AT)
        if since is None or time.monotonic() - since < POOL_IDLE_PING_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            raise DisconnectionError(str(exc)) from exc  # the pool connects afresh
        if not alive:
            raise DisconnectionError("a pooled connection did not answer its ping")


_USED = "poold.used_in_transaction"


def _track_first_use(engine: Engine) -> None:
    """Mark a disconnect met before the transaction sent anything that succeeded.

    Such a failure is a connection that died while it sat in the pool: nothing of
    the transaction reached the database, so running it again is always safe.
    """

    @event.listens_for(engine, "begin")
    def _fresh(conn: Connection) -> None:
        conn.info[_USED] = False

    @event.listens_for(engine, "after_cursor_execute")
    def _used(conn: Connection, *_args: Any) -> None:
        conn.info[_USED] = True

    @event.listens_for(engine, "handle_error")
    def _stale(ctx: Any) -> None:
        conn, wrapped = ctx.connection, ctx.sqlalchemy_exception
        fresh = conn is not None and conn.info.get(_USED) is False
        if ctx.is_disconnect and fresh and wrapped is not None:
            wrapped.poold_stale_connection = True


def is_stale_connection(exc: BaseException) -> bool:
    """A `LedgerUnavailable` from a pooled connection found dead at first use."""
    cause = exc.__cause__ if isinstance(exc, LedgerUnavailable) else exc
    return bool(getattr(cause, "poold_stale_connection", False))


def _journal_mode_wal(cur: Any) -> None:
    """Put the database in WAL mode. Switching a new database to it takes an exclusive
    lock, which SQLite refuses at once, without its busy wait, while other connections
    are opening the same file (16 poold starting on an empty ledger: 2 of 150 rounds
    failed `database is locked`); so it is tried again within the busy timeout."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit BEGIN is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if engine.url.database not in (None, "", ":memory:"):
            _journal_mode_wal(cur)
        # NORMAL is durable across application crashes in WAL mode; only an
        # OS crash can lose the last transactions, which the audit reconciles.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # On the driver's cursor (see `Prepared`): `exec_driver_sql` costs ~60 µs a call.
        sql = "BEGIN IMMEDIATE" if conn.get_execution_options().get("poold_write") else "BEGIN"
        cursor = conn.connection.cursor()
        try:
            cursor.execute(sql)
        except conn.dialect.loaded_dbapi.Error as exc:
            conn._handle_dbapi_exception(exc, sql, (), cursor, None)
            raise  # not reached: the handler raises the wrapped error
        finally:
            cursor.close()


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
        left dead was invalidated by SQLAlchemy, and with it every connection the
        pool held then; a transaction that met one at its first statement is rerun
        by `transitions.retrying` (see `make_engine`).
        """
        try:
            yield
        except PoolTimeout as exc:
            # Every connection busy for the pool's timeout (work outside the request
            # limiter, e.g. the reaper's, took one): busy, not down; retry later.
            raise LedgerUnavailable(
                f"no ledger connection came free: {exc}", reason="busy"
            ) from exc
        except DBAPIError as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if failure == "contention":
                raise LedgerUnavailable(
                    f"the ledger is contended, retry: {_brief(exc)}", reason="contention"
                ) from exc
            if getattr(exc, "poold_stale_connection", False):
                # Not an outage yet: `transitions.retrying` tries a fresh connection.
                raise LedgerUnavailable(
                    f"a pooled ledger connection was dead: {_brief(exc)}",
                    reason="stale_connection",
                ) from exc
            self.health.failed(exc)
            raise LedgerUnavailable(f"the ledger database is unreachable: {_brief(exc)}") from exc

    def dispose(self) -> None:
        if self._news_listener is not None:
            self._news_listener.stop()
            self._news_listener = None
        self.engine.dispose()


# --- the hot path's statements on the driver's cursor ---------------------------------


@dataclass(frozen=True)
class _Plan:
    """One statement compiled for one dialect: its SQL, how to bind, how to read."""

    sql: str
    # Positional drivers (SQLite): the parameters in order, from a dict of them by name.
    order: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None
    fixed: Mapping[str, Any]  # literals the statement carries, and scalar column defaults
    binds: tuple[tuple[str, Callable[[Any], Any]], ...]  # type processors, by name
    results: tuple[Callable[[Any], Any] | None, ...]
    row: Any  # a namedtuple class of the selected columns' names


class Prepared:
    """A Core statement compiled once per dialect and run on the DBAPI cursor.

    `Connection.execute` of an already-cached statement still costs ~40 µs of Python
    per call (execution options, events, a context and a result object); the cursor's
    own `execute` costs ~2 µs on SQLite. A lease grant runs about fifteen statements,
    so the grant and release paths run theirs through here. What stays SQLAlchemy's:
    the SQL (compiled from the same Core statement), the types' bind and result
    processors (UTC datetimes, JSON), the transaction (BEGIN, COMMIT and their events)
    and the error: a driver error is handed to the Connection's own handler, which
    invalidates a dead connection and raises the wrapped `DBAPIError` that
    `Ledger._unavailable` classifies, exactly as `Connection.execute` would.

    Not for statements with expanding IN lists or SQL-side defaults: refused at compile.
    """

    def __init__(self, stmt: ClauseElement, *, column_keys: Sequence[str] | None = None) -> None:
        self.stmt = stmt
        self.column_keys = list(column_keys) if column_keys is not None else None
        self._plans: dict[str, _Plan] = {}

    def _plan(self, dialect: Dialect) -> _Plan:
        plan = self._plans.get(dialect.name)
        if plan is None:
            plan = self._plans[dialect.name] = self._compile(dialect)
        return plan

    def _compile(self, dialect: Dialect) -> _Plan:
        compiled: Any = self.stmt.compile(dialect=dialect, column_keys=self.column_keys)
        if "POSTCOMPILE" in compiled.string:
            raise ValueError(f"not preparable (expanding parameters): {compiled.string}")
        by_name = {name: bp for bp, name in compiled.bind_names.items()}
        fixed: dict[str, Any] = {}
        table = getattr(self.stmt, "table", None)
        for name, bp in by_name.items():
            if not bp.required and bp.callable is None:
                fixed[name] = bp.value
        if isinstance(self.stmt, Insert) and table is not None:
            given = set(self.column_keys or ())
            for col in table.c:
                if col.key in by_name and col.key not in given:
                    default = col.default
                    if default is None or not getattr(default, "is_scalar", False):
                        raise ValueError(f"column {col.key} needs a value in {compiled.string}")
                    fixed[col.key] = default.arg
        binds = []
        for name, bp in by_name.items():
            proc = bp.type.dialect_impl(dialect).bind_processor(dialect)
            if proc is not None:
                binds.append((name, proc))
        columns = list(getattr(self.stmt, "selected_columns", ()))
        results = tuple(
            c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns
        )
        keys = [c.key for c in columns]
        row = namedtuple("Row", keys, rename=True) if columns else None
        order: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None = None
        if dialect.positional:
            names = tuple(compiled.positiontup)
            if len(names) == 1:
                only = names[0]
                order = lambda values: (values[only],)  # noqa: E731
            elif names:
                order = itemgetter(*names)
            else:
                order = lambda _values: ()  # noqa: E731
        return _Plan(compiled.string, order, fixed, tuple(binds), results, row)

    def _params(self, plan: _Plan, params: Mapping[str, Any]) -> Any:
        values = {**plan.fixed, **params}
        for name, proc in plan.binds:
            values[name] = proc(values.get(name))  # None too: JSON makes it "null"
        if plan.order is not None:
            return plan.order(values)
        return values

    def _run(
        self, conn: Connection, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> tuple[_Plan, Any, Any]:
        plan = self._plan(conn.dialect)
        many = not isinstance(params, Mapping)
        bound: Any
        if isinstance(params, Mapping):
            bound = self._params(plan, params)
        else:
            bound = [self._params(plan, p) for p in params]
        return plan, _on_cursor(conn, plan.sql, bound, many=many), bound

    def rows(self, conn: Connection, params: Mapping[str, Any] | None = None) -> list[Any]:
        """Every row, as namedtuples with the selected columns' names."""
        plan = self._plan(conn.dialect)
        make = plan.row._make
        return [make(r) for r in self.tuples(conn, params)]

    def tuples(
        self, conn: Connection, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        """Every row as a plain tuple, its columns' result processing done: for reads of
        many rows taken apart by position (a namedtuple per row was a third of a grant's
        Python on a device with 1,000 live leases on SQLite)."""
        plan, cursor, _bound = self._run(conn, params or {})
        try:
            raw = cursor.fetchall()
        finally:
            cursor.close()
        procs = plan.results
        if not any(procs):
            return raw if isinstance(raw, list) else list(raw)  # both drivers: tuples
        return [
            tuple([v if p is None or v is None else p(v) for p, v in zip(procs, r, strict=True)])
            for r in raw
        ]

    def one_or_none(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Any:
        found = self.rows(conn, params)
        if len(found) > 1:
            raise ValueError(f"more than one row from {self._plan(conn.dialect).sql}")
        return found[0] if found else None

    def scalar(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Any:
        """The first column of the first row, or None."""
        found = self.rows(conn, params)
        return found[0][0] if found else None

    def write(
        self, conn: Connection, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> int:
        """Run an INSERT/UPDATE/DELETE (a list of parameter sets: executemany); rowcount."""
        _plan, cursor, _bound = self._run(conn, params)
        try:
            return int(cursor.rowcount)
        finally:
            cursor.close()


def _on_cursor(conn: Connection, sql: str, bound: Any, *, many: bool = False) -> Any:
    """Run ``sql`` on the driver's cursor of ``conn``; the open cursor. A driver error
    goes through SQLAlchemy's own handler, as `Connection.execute`'s would."""
    cursor = conn.connection.cursor()
    try:
        if many:
            cursor.executemany(sql, bound)
        else:
            cursor.execute(sql, bound)
        conn.info[_USED] = True  # as the after_cursor_execute event would (`make_engine`)
    except Exception as exc:
        cursor.close()
        if not isinstance(exc, conn.dialect.loaded_dbapi.Error):
            raise
        # SQLAlchemy's own handler (private, but what every execute calls): it
        # invalidates a connection the error killed and raises the wrapped error.
        conn._handle_dbapi_exception(exc, sql, bound, cursor, None)
        raise  # not reached: the handler raises
    return cursor


def _json_value(value: Any) -> Any:
    """What `json.dumps` cannot write of a `run_json` row: datetimes, as the UTCDateTime
    column type takes them (types.as_utc)."""
    if isinstance(value, datetime):
        return as_utc(value).isoformat()
    raise TypeError(f"cannot write {type(value).__name__} to the ledger as JSON")


def json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as the JSON array `json_to_recordset` expands (datetimes in ISO form)."""
    return json.dumps(rows, default=_json_value)


def recordset_of(dialect: Dialect, columns: Sequence[Any]) -> str:
    """``json_to_recordset(%(rows)s::json) AS t(...)`` with ``columns``' own names and
    types (quoted), for a statement `run_json` runs: the rows are its one parameter."""
    quote = dialect.identifier_preparer.quote
    typed = ", ".join(f"{quote(c.name)} {c.type.compile(dialect=dialect)}" for c in columns)
    return f"json_to_recordset(%(rows)s::json) AS t({typed})"


class InsertRows:
    """Many rows of one INSERT (of every one of ``columns``) in one statement.

    On PostgreSQL the rows go as one JSON parameter that `json_to_recordset` expands,
    typed by the table's own columns: an executemany (pipelined by psycopg) costs ~35 µs
    of poold's CPU a row, this ~6 µs a row past ~80 µs a statement (an op batch's
    events, measured on this machine). Elsewhere, and for one row, `Prepared`'s
    executemany or execute.
    """

    def __init__(self, stmt: Insert, columns: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self._table = stmt.table
        self._prepared = Prepared(stmt, column_keys=self.columns)
        self._sql: str | None = None

    def _recordset_sql(self, dialect: Dialect) -> str:
        quote = dialect.identifier_preparer.quote
        cols = [self._table.c[name] for name in self.columns]
        names = ", ".join(quote(c.name) for c in cols)
        # Names and types of the table's own columns, quoted; the rows are the parameter.
        return (
            f"INSERT INTO {quote(self._table.name)} ({names}) SELECT {names} "  # noqa: S608
            f"FROM {recordset_of(dialect, cols)}"
        )

    def write(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        if len(rows) == 1 or conn.dialect.name != "postgresql":
            self._prepared.write(conn, rows[0] if len(rows) == 1 else rows)
            return
        if self._sql is None:
            self._sql = self._recordset_sql(conn.dialect)
        keys = self.columns
        run_json(conn, self._sql, [{k: row[k] for k in keys} for row in rows])


def run_json(conn: Connection, sql: str, rows: Sequence[Mapping[str, Any]]) -> int:
    """Run ``sql`` (PostgreSQL, the driver's paramstyle) whose one parameter,
    ``%(rows)s``, is ``rows`` as a JSON array (for `json_to_recordset`); its rowcount."""
    cursor = _on_cursor(conn, sql, {"rows": json_rows(rows)})
    try:
        return int(cursor.rowcount)
    finally:
        cursor.close()


def _any_of(column: Any, name: str) -> ColumnElement[bool]:
    return column == any_(bindparam(name, type_=ARRAY(column.type)))  # type: ignore[no-any-return]


def _in_expanding(column: Any, name: str) -> ColumnElement[bool]:
    return column.in_(bindparam(name, expanding=True))  # type: ignore[no-any-return]


class PreparedIn:
    """A statement over a list of values, as cheap as each backend lets it be.

    An expanding IN (`col IN (:a, :b, ...)`) is rewritten for every call, so it cannot
    be a `Prepared`: through `Connection.execute` it cost ~230 µs per call on PostgreSQL,
    the same statement as `col = ANY(:list)` (one array parameter, compiled once, and
    prepared by the server) ~115 µs. An op batch runs several, a delegation call more.
    On PostgreSQL: the ANY form through `Prepared`; elsewhere (SQLite has no arrays):
    the expanding IN, built once. ``build`` makes the statement from a function that
    gives the membership test of a column in a named list parameter; rows come back
    with the selected columns' names, by attribute or position, on either backend.
    """

    def __init__(self, build: Callable[[Callable[[Any, str], ColumnElement[bool]]], Any]) -> None:
        self._any = Prepared(build(_any_of))
        self._expanding = build(_in_expanding)

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        if conn.dialect.name == "postgresql":
            return self._any.rows(conn, params)
        return list(conn.execute(self._expanding, params))

    def write(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """Run an UPDATE/DELETE over the list; its rowcount."""
        if conn.dialect.name == "postgresql":
            return self._any.write(conn, params)
        return int(conn.execute(self._expanding, params).rowcount)
