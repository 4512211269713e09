"""Revision 0010 on a ledger in service: existing leases are central, reservations and
budgets come and go with the revision, and PostgreSQL refuses overlapping reservations."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from poold.ledger import migrate
from poold.ledger.db import make_engine
from tests.poold.ledger.test_migration_0002 import NOW, empty_url

__all__ = ["empty_url"]  # the fixture, re-used from the 0002 test

ROWS = [
    "INSERT INTO hosts (id, name, status, credential_hash, created_at, generation) "
    "VALUES (1, 'h1', 'up', 'x1', :now, 0)",
    "INSERT INTO devices (id, uid, kind, media, recycled, capacity_bytes, alignment_bytes, "
    "health, state, generation, created_at, updated_at) VALUES "
    "(1, 'd1', 'numa', 'ddr5', false, 67108864, 2097152, 'ok', 'online', 7, :now, :now)",
    "INSERT INTO tenants (id, name, quota_bytes, quota_leases, allowed_media, allowed_uids, "
    "allowed_gids, allowed_hosts, generation, created_at) VALUES "
    "(1, 't1', 1073741824, 10, '[]', '[]', '[]', '[]', 0, :now)",
    "INSERT INTO leases (id, tenant_id, host_id, device_id, offset_bytes, length_bytes, "
    "requested_bytes, state, ttl_s, epoch, granted_at, expires_at, labels, exclusive_bytes, "
    "replica_bytes) VALUES ('l1', 1, 1, 1, 0, 2097152, 2097152, 'active', 60, 7, :now, :now, "
    "'{}', 0, 0)",
]
RESERVE = (
    "INSERT INTO reservations (id, host_id, device_id, offset_bytes, length_bytes, epoch_base, "
    "state, created_at, expires_at) VALUES (:id, 1, 1, :offset, 4194304, 8, 'held', :now, :now)"
)


def test_0010_adds_delegation_and_comes_off_cleanly(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0009")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for statement in ROWS:
                conn.execute(text(statement), {"now": NOW})
        migrate.upgrade(empty_url, "0010")
        with engine.begin() as conn:
            # Every lease granted before is a central one.
            assert conn.execute(text("SELECT reservation_id FROM leases")).all() == [(None,)]
            conn.execute(text(RESERVE), {"id": "r1", "offset": 4194304, "now": NOW})
            conn.execute(
                text(
                    "INSERT INTO budgets (tenant_id, host_id, bytes, leases, created_at, "
                    "expires_at) VALUES (1, 1, 4194304, 2, :now, :now)"
                ),
                {"now": NOW},
            )
            conn.execute(text("UPDATE leases SET reservation_id = 'r1'"))
        with engine.begin() as conn, pytest.raises(IntegrityError):  # one budget per host
            conn.execute(
                text(
                    "INSERT INTO budgets (tenant_id, host_id, bytes, leases, created_at, "
                    "expires_at) VALUES (1, 1, 1, 1, :now, :now)"
                ),
                {"now": NOW},
            )
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn, pytest.raises(IntegrityError, match="ex_reservations"):
                conn.execute(text(RESERVE), {"id": "r2", "offset": 6291456, "now": NOW})

        migrate.downgrade(empty_url, "0009")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM leases")).scalar_one() == 1
            tables = set(engine.dialect.get_table_names(conn))
        assert not {"reservations", "budgets"} & tables
        migrate.upgrade(empty_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT reservation_id FROM leases")).all() == [(None,)]
    finally:
        engine.dispose()
