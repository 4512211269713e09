"""Revision 0011 on a ledger in service: existing tenants start with no central room,
and the columns come and go with the revision."""

from __future__ import annotations

from sqlalchemy import inspect, text

from poold.ledger import migrate
from poold.ledger.db import make_engine
from tests.poold.ledger.test_migration_0002 import NOW, empty_url

__all__ = ["empty_url"]  # the fixture, re-used from the 0002 test

TENANT = (
    "INSERT INTO tenants (id, name, quota_bytes, quota_leases, allowed_media, allowed_uids, "
    "allowed_gids, allowed_hosts, generation, created_at) VALUES "
    "(1, 't1', 1073741824, 10, '[]', '[]', '[]', '[]', 0, :now)"
)


def _columns(engine: object) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns("tenants")}  # type: ignore[arg-type]


def test_0011_gives_existing_tenants_no_room_and_comes_off_cleanly(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0010")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(TENANT), {"now": NOW})
        migrate.upgrade(empty_url, "0011")
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT central_room_bytes, central_room_until FROM tenants")
            ).one()
        assert tuple(row) == (0, None)
        migrate.downgrade(empty_url, "0010")
        assert not {"central_room_bytes", "central_room_until"} & _columns(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM tenants")).scalars().all() == ["t1"]
        migrate.upgrade(empty_url)
        assert {"central_room_bytes", "central_room_until"} <= _columns(engine)
    finally:
        engine.dispose()
