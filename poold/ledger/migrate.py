"""How the ledger schema is brought up to date: a thin wrapper over alembic.

`poolctl db upgrade` and `poold serve --upgrade-db` call this; the revisions
live in the top-level migrations/ package, the only way the schema changes.

Any number of poold processes may start at once on one database, so an upgrade
runs under a lock: a PostgreSQL advisory lock held by the very connection alembic
migrates on (migrations/env.py uses `cfg.attributes["connection"]`), or on SQLite
an exclusive `flock` on a file beside the database. Whoever gets the lock reads
the current revision again: another process may have upgraded meanwhile, and then
there is nothing left to do.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, make_url, text
from sqlalchemy.pool import NullPool

import migrations
from poold.ledger.db import make_engine

# pg_advisory_lock key for schema changes (ASCII "poold-db"); advisory locks are
# per database, so ledgers sharing a server do not wait for each other.
ADVISORY_LOCK_KEY = 0x706F6F6C642D6462


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # ConfigParser interpolation would choke on '%' in passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema to `revision`; safe to run from many processes at once."""
    with _locked(url) as conn:
        cfg = alembic_config(url)
        target = ScriptDirectory.from_config(cfg).get_revision(revision)
        if revision == "head" and _current(conn) == (target.revision if target else None):
            return  # another process upgraded while this one waited for the lock
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(url: str, revision: str) -> None:
    """Take the schema back to `revision`, under the same lock as `upgrade`."""
    with _locked(url) as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return _current(conn)


def _current(conn: Connection) -> str | None:
    revision = MigrationContext.configure(conn).get_current_revision()
    conn.commit()  # end the read's transaction: alembic begins its own
    return revision


@contextmanager
def _locked(url: str) -> Iterator[Connection]:
    """A connection to the ledger holding the schema lock until the block ends."""
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                with _pg_advisory_lock(conn):
                    yield conn
            else:
                with _file_lock(url):
                    yield conn
    finally:
        engine.dispose()


@contextmanager
def _pg_advisory_lock(conn: Connection) -> Iterator[None]:
    # Session-level: held across the transactions alembic commits on this connection.
    conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
    conn.commit()
    try:
        yield
    finally:
        if conn.in_transaction():
            conn.rollback()  # a failed revision left its transaction open
        conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_LOCK_KEY})
        conn.commit()


@contextmanager
def _file_lock(url: str) -> Iterator[None]:
    database = make_url(url).database
    if not database or database == ":memory:":
        yield  # a private in-memory database: nobody to race
        return
    lock_path = Path(database).with_name(Path(database).name + ".migrate.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
