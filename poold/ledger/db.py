"""How poold talks to its ledger database: engines, transactions, pragmas.

SQLite (the default) runs in WAL mode with a busy timeout and foreign keys
on. Write transactions start with BEGIN IMMEDIATE: a deferred transaction
that later upgrades to a writer fails at once with "database is locked"
instead of waiting, which would turn ordinary contention into errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from poold.errors import BadRequest

SQLITE_BUSY_TIMEOUT_MS = 10_000


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
        self._write_engine = self.engine.execution_options(poold_write=True)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        # Host name -> id. Hosts are never renamed or deleted, so this cannot go stale.
        self.host_ids: dict[str, int] = {}

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One write transaction: committed on success, rolled back on any error."""
        with _refused_values(), self._write() as session, session.begin():
            yield session

    @contextmanager
    def write_conn(self) -> Iterator[Connection]:
        """A write transaction on a bare Core connection: the lease hot path skips the ORM."""
        with _refused_values(), self._write_engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[Session]:
        with _refused_values(), self._read() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
