"""Revision 0002 on a ledger with rows in it: defaults filled in, nothing lost going down."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from poold.ledger import migrate
from poold.ledger.db import make_engine
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


NOW = "2026-12-01 00:00:00+00:00"


def test_0002_keeps_rows_both_ways(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0001")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO hosts (id, name, status, credential_hash, created_at) "
                    "VALUES (1, 'h1', 'up', 'x', :now)"
                ),
                {"now": NOW},
            )
            conn.execute(
                text(
                    "INSERT INTO devices (id, uid, kind, media, recycled, capacity_bytes, "
                    "alignment_bytes, health, state, generation, created_at, updated_at) "
                    "VALUES (1, 'd1', 'numa', 'ddr4', true, 1024, 2, 'ok', 'online', 0, "
                    ":now, :now)"
                ),
                {"now": NOW},
            )
            conn.execute(
                text(
                    "INSERT INTO device_paths (id, device_id, host_id, local_name, present, "
                    "seen_at) VALUES (1, 1, 1, 'node2', true, :now)"
                ),
                {"now": NOW},
            )
        migrate.upgrade(empty_url, "0002")
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT memdev_serials, health_reasons, reported_annotations, "
                    "admin_annotations FROM devices"
                )
            ).one()
            tier = conn.execute(text("SELECT memory_tier FROM device_paths")).scalar_one()
        decoded = [json.loads(v) if isinstance(v, str) else v for v in row]  # SQLite: text
        assert decoded == [[], [], {}, {}]
        assert tier is None
        migrate.downgrade(empty_url, "0001")
        with engine.connect() as conn:
            # Going down must not rebuild `devices` (a DROP TABLE would cascade to paths).
            assert conn.execute(text("SELECT count(*) FROM device_paths")).scalar_one() == 1
            assert conn.execute(text("SELECT media FROM devices")).scalar_one() == "ddr4"
    finally:
        engine.dispose()
