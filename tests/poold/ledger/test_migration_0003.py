"""Revision 0003 on a ledger with a lease in it: counts start at zero, nothing lost going down."""

from __future__ import annotations

from sqlalchemy import text

from poold.ledger import migrate
from poold.ledger.db import make_engine
from tests.poold.ledger.test_migration_0002 import NOW, empty_url

__all__ = ["empty_url"]  # the fixture, re-used from the 0002 test

ROWS = [
    "INSERT INTO hosts (id, name, status, credential_hash, created_at) "
    "VALUES (1, 'h1', 'up', 'x', :now)",
    "INSERT INTO devices (id, uid, kind, media, recycled, capacity_bytes, alignment_bytes, "
    "health, state, generation, created_at, updated_at) "
    "VALUES (1, 'd1', 'numa', 'ddr4', true, 1073741824, 2097152, 'ok', 'online', 0, :now, :now)",
    "INSERT INTO tenants (id, name, quota_bytes, quota_leases, allowed_media, allowed_uids, "
    "allowed_gids, allowed_hosts, generation, created_at) "
    "VALUES (1, 't1', 1073741824, 8, '[]', '[]', '[]', '[]', 0, :now)",
    "INSERT INTO leases (id, tenant_id, host_id, device_id, offset_bytes, length_bytes, "
    "requested_bytes, state, ttl_s, epoch, granted_at, expires_at, labels, exclusive_bytes, "
    "replica_bytes) VALUES ('l1', 1, 1, 1, 0, 2097152, 2097152, 'active', 60, 1, :now, :now, "
    "'{}', 1048576, 4096)",
]


def test_0003_keeps_leases_both_ways(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0002")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for statement in ROWS:
                conn.execute(text(statement), {"now": NOW})
        migrate.upgrade(empty_url, "0003")
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT used_bytes, exclusive_blocks, replica_blocks, exclusive_bytes "
                    "FROM leases"
                )
            ).one()
        assert tuple(row) == (0, 0, 0, 1048576)
        migrate.downgrade(empty_url, "0002")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT replica_bytes FROM leases")).scalar_one() == 4096
    finally:
        engine.dispose()
