"""Inventory upserts: discovery fields stored, admin annotations kept, vanished devices missing."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from poold.errors import BadRequest, UnknownDevice
from poold.ledger import capacity, devices, heartbeat, hosts
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Event
from poold.wire.admin import DeviceAnnotate
from poold.wire.agent import InventoryDevice

MiB = 1 << 20
UID = "cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"


def item(uid: str = UID, **kw: Any) -> InventoryDevice:
    fields: dict[str, Any] = {
        "uid": uid,
        "kind": "numa",
        "media": "ddr5",
        "capacity_bytes": 512 * MiB,
        "health": "warning",
        "local_name": "node2",
        "numa_node": 2,
        "memory_tier": 22,
        "memdev_serials": [3, 4],
        "health_reasons": ["serial 3: life used 91%"],
        "provenance": "agent says new",
        "cost_per_gib_month": 1.5,
    }
    fields.update(kw)
    return InventoryDevice(**fields)


def add_host(ledger: Ledger, name: str = "h1") -> None:
    with ledger.write() as s:
        hosts.add(s, name, "admin")


def upsert(ledger: Ledger, inventory: list[InventoryDevice], host: str = "h1") -> None:
    with ledger.write() as s:
        heartbeat.upsert_inventory(s, hosts.get_by_name(s, host), inventory)


def annotate(ledger: Ledger, uid: str = UID, **change: Any) -> None:
    with ledger.write() as s:
        devices.annotate(s, uid, DeviceAnnotate(**change), "admin")


def test_discovery_fields_stored_and_shown(ledger: Ledger) -> None:
    add_host(ledger)
    upsert(ledger, [item()])
    with ledger.read() as s:
        dev = s.scalars(select(Device)).one()
        path = s.scalars(select(DevicePath)).one()
        assert dev.memdev_serials == [3, 4]
        assert dev.health_reasons == ["serial 3: life used 91%"]
        assert dev.reported_annotations["provenance"] == "agent says new"
        assert dev.admin_annotations == {}
        assert path.memory_tier == 22
    (row,) = capacity.pool_status(ledger).devices
    assert row.memory_tier == 22 and row.numa_node == 2
    assert row.memdev_serials == [3, 4]
    assert row.health == "warning" and row.health_reasons == ["serial 3: life used 91%"]
    assert row.media == "ddr5" and row.provenance == "agent says new"
    assert row.cost_per_gib_month == pytest.approx(1.5)

    # The next inventory replaces the agent's values (health recovered, tier moved).
    upsert(ledger, [item(health="ok", health_reasons=[], memory_tier=4)])
    (row,) = capacity.pool_status(ledger).devices
    assert row.health == "ok" and row.health_reasons == [] and row.memory_tier == 4


def test_admin_annotation_survives_inventory_upsert(ledger: Ledger) -> None:
    add_host(ledger)
    upsert(ledger, [item()])
    annotate(ledger, media="ddr4", recycled=True, provenance="retired from rack 12 host 7")
    upsert(ledger, [item(media="ddr5", recycled=False, cost_per_gib_month=2.0)])
    (row,) = capacity.pool_status(ledger).devices
    assert row.media == "ddr4" and row.recycled
    assert row.provenance == "retired from rack 12 host 7"
    assert row.cost_per_gib_month == pytest.approx(2.0)  # not annotated: the agent's
    assert row.admin_annotations.model_dump(exclude_none=True) == {
        "media": "ddr4",
        "recycled": True,
        "provenance": "retired from rack 12 host 7",
    }
    # Clearing an admin field brings the agent's (latest) value back at once.
    annotate(ledger, clear=["media", "provenance"])
    (row,) = capacity.pool_status(ledger).devices
    assert row.media == "ddr5" and row.recycled and row.provenance == "agent says new"
    with ledger.read() as s:
        kinds = [e.kind for e in s.scalars(select(Event).order_by(Event.id))]
    assert kinds.count("device.annotate") == 2


def test_annotate_refusals(ledger: Ledger) -> None:
    add_host(ledger)
    upsert(ledger, [item()])
    with pytest.raises(UnknownDevice):
        annotate(ledger, uid="nope", media="ddr4")
    with pytest.raises(BadRequest) as err:
        annotate(ledger, media="ddr4", clear=["media"])
    assert err.value.code == "bad_request"
    (row,) = capacity.pool_status(ledger).devices
    assert row.media == "ddr5"  # nothing changed


def test_noop_annotation_writes_no_event(ledger: Ledger) -> None:
    add_host(ledger)
    upsert(ledger, [item()])
    annotate(ledger, media="ddr4")
    annotate(ledger, media="ddr4")
    with ledger.read() as s:
        count = len(list(s.scalars(select(Event).where(Event.kind == "device.annotate"))))
    assert count == 1


def test_vanished_device_goes_missing_keeps_annotations(ledger: Ledger) -> None:
    add_host(ledger)
    other = item("dax:resource=0x1:size=1", kind="devdax", memdev_serials=[], local_name="x")
    upsert(ledger, [item(), other])
    annotate(ledger, recycled=True)
    upsert(ledger, [other])
    rows = {r.uid: r for r in capacity.pool_status(ledger).devices}
    assert rows[UID].state == "missing" and rows[UID].recycled
    assert rows[other.uid].state == "online"
    upsert(ledger, [item(), other])
    rows = {r.uid: r for r in capacity.pool_status(ledger).devices}
    assert rows[UID].state == "online" and rows[UID].recycled


def test_effective_is_field_by_field() -> None:
    reported = {"media": "ddr5", "recycled": False, "provenance": None, "cost_per_gib_month": 1.0}
    assert devices.effective(reported, {"recycled": True}) == {**reported, "recycled": True}
    assert devices.effective({}, {})["media"] == "unknown"


def test_admission_wanted_bytes_makes_room_replicas_first(ledger: Ledger) -> None:
    """A lease waiting on the agent becomes shrink hints even with pressure off."""
    from poold.ledger import leases
    from poold.wire.agent import GrantRequest, Heartbeat, LeaseReport
    from tests.poold.conftest import UID, MiB, device, seed

    seed(ledger, devices=[device(capacity_bytes=64 * MiB)])
    rep, exc = (
        leases.grant(
            ledger,
            "h1",
            GrantRequest(tenant="t1", size_bytes=32 * MiB, uid=UID, pid=1, activate=True),
            "agent:h1",
        )
        for _ in range(2)
    )
    reports = [
        LeaseReport(
            lease_id=rep.id, used_bytes=32 * MiB, exclusive_bytes=8 * MiB, replica_bytes=24 * MiB
        ),
        LeaseReport(
            lease_id=exc.id, used_bytes=32 * MiB, exclusive_bytes=32 * MiB, replica_bytes=0
        ),
    ]
    with ledger.write() as s:
        host = hosts.get_by_name(s, "h1")
        quiet = heartbeat.heartbeat(s, host, Heartbeat(reports=reports), pressure_watermark=0)
        assert quiet.shrink == []
        waiting = heartbeat.heartbeat(
            s, host, Heartbeat(admission_wanted_bytes=16 * MiB), pressure_watermark=0
        )
    (hint,) = waiting.shrink
    assert (hint.lease_id, hint.target_bytes, hint.replica_bytes) == (rep.id, 16 * MiB, 16 * MiB)
