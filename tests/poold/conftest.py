"""Helpers for poold's tests: seeding a ledger, and snapshots of every table."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from poold.ledger import heartbeat, hosts, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Base
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import InventoryDevice, LeaseOp
from poold.wire.delegation import Delegation, LocalGrant

MiB = 1 << 20
GiB = 1 << 30
UID = 1000
GID = 2000


def snapshot(ledger: Ledger) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every ledger table, in primary-key order: equal means unchanged."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with ledger.read() as session:
        for table in Base.metadata.sorted_tables:
            stmt = select(table).order_by(*table.primary_key.columns)
            out[table.name] = [tuple(row) for row in session.execute(stmt)]
    return out


def device(uid: str = "dev-0", **kw: Any) -> InventoryDevice:
    fields: dict[str, Any] = {
        "uid": uid,
        "kind": "numa",  # memfd-backed far memory: reclaimed ranges are free at once
        "media": "ddr5",
        "capacity_bytes": 64 * MiB,
        "alignment_bytes": 2 * MiB,
        "health": "ok",
        "local_name": "node2",
        "numa_node": 2,
    }
    fields.update(kw)
    return InventoryDevice(**fields)


def seed(
    ledger: Ledger,
    *,
    host: str = "h1",
    devices: list[InventoryDevice] | None = None,
    tenant: str | None = "t1",
    quota_bytes: int = GiB,
    quota_leases: int = 100,
    uids: tuple[int, ...] = (UID,),
) -> str:
    """A host with `devices` and (optionally) a tenant; returns the host's credential."""
    with ledger.write() as session:
        row, credential = hosts.add(session, host, "test")
        heartbeat.upsert_inventory(session, row, devices if devices is not None else [device()])
        if tenant is not None:
            tenants.create(
                session,
                TenantSpec(
                    name=tenant,
                    quota_bytes=quota_bytes,
                    quota_leases=quota_leases,
                    allowed_uids=list(uids),
                ),
                "test",
            )
    return credential


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls in threads released together; their results (an error fails the test)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = calls[i]()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def local_grant_op(
    d: Delegation,
    lease_id: str,
    offset: int = 0,
    length: int = 2 * MiB,
    epoch: int = 0,
    *,
    tenant: str = "t1",
    pid: int = 42,
) -> LeaseOp:
    """The `local_grant` op an agent sends for a lease it granted alone in ``d``'s first
    reservation: ``offset`` and ``epoch`` are relative to that reservation's."""
    res = d.reservations[0]
    return LeaseOp(
        lease_id=lease_id,
        op="local_grant",
        grant=LocalGrant(
            lease_id=lease_id,
            reservation_id=res.id,
            tenant=tenant,
            offset_bytes=res.offset_bytes + offset,
            length_bytes=length,
            requested_bytes=length,
            epoch=res.epoch_base + epoch,
            ttl_s=60,
            granted_at=utcnow(),
            uid=UID,
            pid=pid,
        ),
    )
