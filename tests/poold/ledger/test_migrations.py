"""Migrations are code under test (STYLE.md pattern 8): walk them, compare with the models."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from poold.ledger import migrate
from poold.ledger.db import make_engine
from poold.ledger.models import Base
from tests import conftest, pg


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    name = conftest.new_pg_database(server, None)
    yield server.url(name)
    conftest.drop_pg_database(server, name)


def _revisions(url: str) -> list[str]:
    script = ScriptDirectory.from_config(migrate.alembic_config(url))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def test_walk_every_revision_up_and_down(empty_url: str) -> None:
    engine = make_engine(empty_url)
    try:
        for rev in _revisions(empty_url):
            migrate.upgrade(empty_url, rev)
            assert migrate.current_revision(engine) == rev
        migrate.downgrade(empty_url, "base")
        assert migrate.current_revision(engine) is None
        leftover = set(inspect(engine).get_table_names()) - {"alembic_version"}
        assert leftover == set()
        migrate.upgrade(empty_url)
        assert migrate.current_revision(engine) == migrate.head_revision(empty_url)
    finally:
        engine.dispose()


def test_models_match_migrations(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_exclusion_constraint_present(pg_server: pg.PgServer, pg_template: str) -> None:
    name = conftest.new_pg_database(pg_server, pg_template)
    engine = make_engine(pg_server.url(name))
    try:
        with engine.connect() as conn:
            names = {
                row[0]
                for row in conn.exec_driver_sql(
                    "SELECT conname FROM pg_constraint WHERE conrelid = 'leases'::regclass"
                )
            }
        assert "ex_leases_no_overlap" in names
    finally:
        engine.dispose()
        conftest.drop_pg_database(pg_server, name)


def test_0006_gives_existing_hosts_a_generation_and_comes_off_cleanly(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0005")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO hosts (name, status, credential_hash, created_at) "
                "VALUES ('old', 'up', 'digest', CURRENT_TIMESTAMP)"
            )
        migrate.upgrade(empty_url, "0006")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT generation FROM hosts").scalar() == 0
        assert "agent_requests" in inspect(engine).get_table_names()
        migrate.downgrade(empty_url, "0005")
        assert "agent_requests" not in inspect(engine).get_table_names()
        assert "generation" not in {c["name"] for c in inspect(engine).get_columns("hosts")}
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT name FROM hosts").scalar() == "old"
    finally:
        engine.dispose()


def test_sixteen_upgrades_at_once_on_a_new_sqlite_file_all_succeed(tmp_path: Path) -> None:
    """A new SQLite file opened by 16 at once: each connection's switch to WAL may be
    refused without a busy wait (db.py `_journal_mode_wal` tries again); 2 of 150 such
    rounds failed `database is locked` before it did."""
    for round_ in range(30):
        url = f"sqlite:///{tmp_path / f'new-{round_}.db'}"
        errors: list[BaseException] = []

        def run(url: str = url, errors: list[BaseException] = errors) -> None:
            try:
                migrate.upgrade(url)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, (round_, errors)


def test_many_upgrades_at_once_all_succeed(empty_url: str) -> None:
    """Under the schema lock, racing upgrades queue; the later ones find nothing to do."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrate.upgrade(empty_url)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    engine = make_engine(empty_url)
    try:
        assert migrate.current_revision(engine) == migrate.head_revision(empty_url)
    finally:
        engine.dispose()
