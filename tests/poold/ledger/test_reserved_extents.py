"""Reserved extents in the ledger, on SQLite and PostgreSQL: stored from the inventory,
never placed on, not free, and flagged by the audit when a live lease overlaps one."""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from poold.api.client import PooldClient
from poold.errors import NoCapacity
from poold.extents import Extent
from poold.ledger import audit, capacity, heartbeat, hosts, leases
from poold.ledger.db import Ledger
from poold.ledger.models import Device
from poold.ledger.reaper import ReaperPolicy
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice, LeaseReport
from poold.wire.common import LeaseOut
from tests.conftest import ThreadedServer
from tests.poold.conftest import UID, MiB, device, seed

DEV = "dev-0"
# 64 MiB, 2 MiB aligned; free: [8, 20), [30, 50) and [54, 64) once 53 is aligned up.
RESERVED = [(0, 8 * MiB), (20 * MiB, 10 * MiB), (50 * MiB, 3 * MiB)]


def devdax(**kw: Any) -> InventoryDevice:
    fields: dict[str, Any] = {"kind": "devdax", "local_name": "dax_region0"}
    fields.update(kw)
    return device(DEV, **fields)


def grant(ledger: Ledger, size: int) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=size, uid=UID, pid=1, activate=True),
        "agent:test",
    )


def upsert(ledger: Ledger, item: InventoryDevice) -> None:
    with ledger.write() as s:
        heartbeat.upsert_inventory(s, hosts.get_by_name(s, "h1"), [item])


def stored(ledger: Ledger) -> tuple[list[Any], int]:
    with ledger.read() as s:
        dev = s.scalars(select(Device).where(Device.uid == DEV)).one()
        return dev.reserved_extents, dev.generation


def test_inventory_stores_reserved_and_a_change_bumps_the_generation(ledger: Ledger) -> None:
    seed(ledger, devices=[devdax(reserved_extents=list(reversed(RESERVED)))])
    extents, generation = stored(ledger)
    assert extents == [list(e) for e in RESERVED]  # sorted, as JSON lists
    upsert(ledger, devdax(reserved_extents=RESERVED))
    assert stored(ledger) == (extents, generation)  # unchanged: no bump
    upsert(ledger, devdax(reserved_extents=RESERVED[:1]))
    assert stored(ledger) == ([list(RESERVED[0])], generation + 1)  # grants read again
    upsert(ledger, devdax())
    assert stored(ledger) == ([], generation + 2)


def test_grants_never_overlap_reserved_until_no_capacity(ledger: Ledger) -> None:
    seed(ledger, devices=[devdax(reserved_extents=RESERVED)], quota_leases=1000)
    granted: list[LeaseOut] = []
    while len(granted) < 64:  # more than fits: the loop ends at no_capacity
        try:
            granted.append(grant(ledger, 2 * MiB))
        except NoCapacity:
            break
    with pytest.raises(NoCapacity) as err:
        grant(ledger, 2 * MiB)
    assert err.value.detail["largest_free_bytes"] == 0
    assert err.value.detail["free_by_device"] == {DEV: 0}
    held = [Extent(*e) for e in RESERVED]
    got = sorted(Extent(lease.offset_bytes, lease.length_bytes) for lease in granted)
    for lease in got:
        assert not any(lease.overlaps(r) for r in held), lease
    for a, b in itertools.pairwise(got):
        assert a.end <= b.offset
    # Every aligned 2 MiB slot that is not reserved was handed out: 6 + 10 + 5.
    assert len(got) == 21


def test_no_capacity_when_only_reserved_space_remains(ledger: Ledger) -> None:
    seed(ledger, devices=[devdax(reserved_extents=[(0, 32 * MiB)])])
    lease = grant(ledger, 32 * MiB)
    assert lease.offset_bytes == 32 * MiB
    with pytest.raises(NoCapacity) as err:
        grant(ledger, 2 * MiB)
    assert err.value.detail == {"largest_free_bytes": 0, "free_by_device": {DEV: 0}}
    assert "largest free extent is 0 bytes" in err.value.message


def test_status_counts_reserved_as_neither_leased_nor_free(ledger: Ledger) -> None:
    seed(ledger, devices=[devdax(reserved_extents=RESERVED)])
    grant(ledger, 4 * MiB)
    row = capacity.device_status(ledger, DEV)
    assert row.reserved_extents == RESERVED
    assert row.reserved_bytes == 21 * MiB
    assert (row.capacity_bytes, row.leased_bytes, row.free_bytes) == (64 * MiB, 4 * MiB, 39 * MiB)
    assert row.largest_free_bytes == 20 * MiB  # [30, 50): best fit put the lease at 54 MiB
    pool = capacity.pool_status(ledger)
    assert pool.free_bytes == 39 * MiB and pool.hosts[0].free_bytes == 39 * MiB


def test_audit_flags_a_live_lease_on_a_reserved_range(ledger: Ledger) -> None:
    seed(ledger, devices=[devdax()])
    lease = grant(ledger, 4 * MiB)
    policy = ReaperPolicy(expiry_grace_s=30, activation_deadline_s=30, revoke_deadline_s=20)
    assert audit.run_audit(ledger, policy).violations == []
    # Someone made a dax device over the lease's bytes behind poold's back.
    upsert(ledger, devdax(reserved_extents=[(lease.offset_bytes + 2 * MiB, 8 * MiB)]))
    report = audit.run_audit(ledger, policy)
    (item,) = report.violations
    assert (item.kind, item.lease_id, item.device_uid) == ("reserved", lease.id, DEV)
    assert report.exit_code == 2


def test_pressure_watermark_is_of_the_unreserved_capacity(ledger: Ledger) -> None:
    """A device mostly held by the kernel's dax0.0 is not under pressure for that alone."""
    seed(ledger, devices=[devdax(capacity_bytes=100 * MiB, reserved_extents=[(0, 80 * MiB)])])
    lease = grant(ledger, 18 * MiB)
    report = LeaseReport(
        lease_id=lease.id, used_bytes=18 * MiB, exclusive_bytes=0, replica_bytes=18 * MiB
    )
    with ledger.write() as s:
        reply = heartbeat.heartbeat(
            s, hosts.get_by_name(s, "h1"), Heartbeat(reports=[report]), pressure_watermark=0.05
        )
    # 2 MiB free of 20 usable is above a 5% watermark (of 100 MiB it would be below).
    assert reply.shrink == []


def test_inventory_without_the_field_still_works(api: ThreadedServer, admin: PooldClient) -> None:
    """An agent that predates reserved extents: its JSON has no such key."""
    credential = admin.add_host("h1").credential
    old = {
        "uid": DEV,
        "kind": "devdax",
        "media": "ddr5",
        "capacity_bytes": 64 * MiB,
        "alignment_bytes": 2 * MiB,
        "health": "ok",
        "local_name": "dax_region0",
        "numa_node": 1,
    }
    with httpx.Client(base_url=api.url) as http:
        resp = http.post(
            "/v1/agent/register",
            headers={"authorization": f"Bearer {credential}", "content-type": "application/json"},
            content=json.dumps({"agent_version": "0.1", "inventory": [old]}),
        )
    assert resp.status_code == 200, resp.text
    (row,) = admin.status().devices
    assert row.reserved_extents == [] and row.reserved_bytes == 0
    assert row.free_bytes == 64 * MiB
