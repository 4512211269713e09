"""How poold talks to its ledger database: engines, transactions, pragmas.

SQLite (the default) runs in WAL mode with a busy timeout and foreign keys
on. Write transactions start with BEGIN IMMEDIATE: a deferred transaction
that later upgrades to a writer fails at once with "database is locked"
instead of waiting, which would turn ordinary contention into errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 10_000


def default_sqlite_url(state_dir: Path) -> str:
    return f"sqlite:///{state_dir / 'ledger.db'}"


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


class Ledger:
    """The ledger database: hands out read and write transactions."""

    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self.url = url
        self.engine = make_engine(url, **engine_kwargs)
        self._write_engine = self.engine.execution_options(poold_write=True)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One write transaction: committed on success, rolled back on any error."""
        with self._write() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
