"""Revision 0007 on a ledger in service: every path becomes a binding, so each host keeps
reporting (and placing on) what it reached, and another host is refused from then on."""

from __future__ import annotations

from sqlalchemy import select, text

from poold.ledger import heartbeat, migrate
from poold.ledger.db import Ledger, make_engine
from poold.ledger.models import DeviceHost
from poold.wire.agent import Heartbeat
from tests.poold.conftest import device
from tests.poold.ledger.test_migration_0002 import NOW, empty_url

__all__ = ["empty_url"]  # the fixture, re-used from the 0002 test

SHARED = "cxl:ram:serials=1,2:ways=2:gran=4096:size=67108864"
ROWS = [
    "INSERT INTO hosts (id, name, status, credential_hash, created_at, generation) "
    "VALUES (1, 'h1', 'up', 'x1', :now, 0), (2, 'h2', 'up', 'x2', :now, 0), "
    "(3, 'h3', 'down', 'x3', :now, 0)",
    "INSERT INTO devices (id, uid, kind, media, recycled, capacity_bytes, alignment_bytes, "
    "health, state, generation, created_at, updated_at) VALUES "
    "(1, 'h1/numa:node2', 'numa', 'ddr5', false, 67108864, 2097152, 'ok', 'online', 0, "
    ":now, :now), "
    f"(2, '{SHARED}', 'devdax', 'ddr5', false, 67108864, 2097152, 'ok', 'online', 0, "
    ":now, :now)",
    # h1 and h2 reach the shared device (h2's path absent just now); h1 its own node.
    "INSERT INTO device_paths (id, device_id, host_id, local_name, present, seen_at) VALUES "
    "(1, 1, 1, 'node2', true, :now), (2, 2, 1, 'dax_region0', true, :now), "
    "(3, 2, 2, 'dax_region1', false, :now)",
]


def test_0007_turns_paths_into_bindings_and_comes_off_cleanly(empty_url: str) -> None:
    migrate.upgrade(empty_url, "0006")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for statement in ROWS:
                conn.execute(text(statement), {"now": NOW})
        # To the head, not 0007: the heartbeat code below is today's, which reads the
        # tables of later migrations (reservations); they leave the bindings alone.
        migrate.upgrade(empty_url)
        ledger = Ledger(empty_url)
        try:
            with ledger.read() as s:
                bound = {
                    (b.device_id, b.host_id, b.source): b.created_at.tzinfo is not None
                    for b in s.scalars(select(DeviceHost))
                }
            assert bound == {(1, 1, "path"): True, (2, 1, "path"): True, (2, 2, "path"): True}

            # Nothing in service breaks: both heads keep reporting the shared device, h1
            # its node; h3, which never reached them, is refused.
            for host, items in (
                ("h1", [device("h1/numa:node2"), device(SHARED, kind="devdax")]),
                ("h2", [device(SHARED, kind="devdax", local_name="dax_region1")]),
            ):
                reply = heartbeat.receive_heartbeat(
                    ledger, host, Heartbeat(inventory=items), f"host:{host}"
                )
                assert reply.inventory_errors == []
            reply = heartbeat.receive_heartbeat(
                ledger, "h3", Heartbeat(inventory=[device(SHARED, kind="devdax")]), "host:h3"
            )
            assert [(e.device_uid, e.code) for e in reply.inventory_errors] == [
                (SHARED, "device_not_bound")
            ]
        finally:
            ledger.dispose()

        migrate.downgrade(empty_url, "0006")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM device_paths")).scalar_one() == 3
            assert conn.execute(text("SELECT count(*) FROM devices")).scalar_one() == 2
        migrate.upgrade(empty_url)  # and up again: the bindings come back from the paths
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM device_hosts")).scalar_one() == 3
    finally:
        engine.dispose()
