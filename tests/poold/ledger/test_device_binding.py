"""Devices are bound to the hosts that may report them (poold/ledger/device_hosts.py).

A host-scoped device is reported only by its host; a shared CXL device by the host
that first reported it and the hosts an administrator allowed. A refused inventory
item changes nothing of the device and creates no path; the rest of the heartbeat
applies.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import select

from poold.errors import DeviceHostScoped, NoCapacity, UnknownDevice, UnknownHost
from poold.ledger import device_hosts, heartbeat, hosts, leases, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DeviceHost, DevicePath, Event, Host, Lease
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, HeartbeatReply, InventoryDevice
from tests.poold.conftest import UID, GiB, MiB, device, seed, snapshot

SHARED = "cxl:ram:serials=11,12:ways=2:gran=4096:size=67108864"


def beat(ledger: Ledger, host: str, *items: InventoryDevice, digest: str = "d") -> HeartbeatReply:
    return heartbeat.receive_heartbeat(
        ledger, host, Heartbeat(inventory=list(items), inventory_digest=digest), f"host:{host}"
    )


def add_host(ledger: Ledger, name: str) -> None:
    with ledger.write() as s:
        hosts.add(s, name, "test")


def refused(reply: HeartbeatReply) -> list[tuple[str | None, str]]:
    return [(e.device_uid, e.code) for e in reply.inventory_errors]


def device_row(ledger: Ledger, uid: str) -> tuple[Any, ...]:
    """Every column of the device the attacker would change."""
    with ledger.read() as s:
        dev = s.scalars(select(Device).where(Device.uid == uid)).one()
        return (
            dev.capacity_bytes,
            dev.alignment_bytes,
            dev.health,
            dev.health_reasons,
            dev.media,
            dev.reserved_extents,
            dev.memdev_serials,
            dev.state,
            dev.generation,
            dev.reported_annotations,
        )


def paths(ledger: Ledger, uid: str) -> dict[str, bool]:
    """Host name -> present, for every path to the device."""
    with ledger.read() as s:
        dev_id = s.scalars(select(Device.id).where(Device.uid == uid)).one()
        rows = s.execute(
            select(DevicePath.host_id, DevicePath.present).where(DevicePath.device_id == dev_id)
        )
        names = {h.id: h.name for h in s.scalars(select(Host))}
        return {names[host_id]: present for host_id, present in rows}


def hostile(uid: str) -> InventoryDevice:
    """What the attacker sends for someone else's device: all reserved, critical, new media."""
    return device(
        uid,
        capacity_bytes=64 * MiB,
        health="critical",
        media="hbm",
        health_reasons=["attacker"],
        reserved_extents=[(0, 64 * MiB)],
        local_name="evil",
    )


def grant(ledger: Ledger, host: str) -> Any:
    req = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, activate=True)
    return leases.grant(ledger, host, req, f"host:{host}")


def test_scope_from_the_uid_scheme() -> None:
    assert device_hosts.scope_of("h1/numa:node2") == "host"
    assert device_hosts.scope_of("h1/cxl:ram:serials=1:ways=1:gran=256:size=1") == "host"
    assert device_hosts.scope_of("emulated:h1") == "host"
    assert device_hosts.scope_of("dev-0") == "host"
    assert device_hosts.scope_of("cxl:ram:resource=0x10:size=1") == "host"
    assert device_hosts.scope_of(SHARED) == "shared"
    assert device_hosts.scope_of("numa:" + SHARED) == "shared"
    assert device_hosts.named_host("h1/numa:node2") == "h1"
    assert device_hosts.named_host("emulated:rack1-h1") == "rack1-h1"
    assert device_hosts.named_host("dev-0") is None
    assert device_hosts.named_host(SHARED) is None


def test_host_scoped_device_only_its_host_reports(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[], tenant=None)
    add_host(ledger, "h2")
    mine = device("h1/numa:node2")
    assert refused(beat(ledger, "h1", mine)) == []
    before = device_row(ledger, mine.uid)

    reply = beat(ledger, "h2", hostile(mine.uid))
    assert refused(reply) == [(mine.uid, "device_not_bound")]
    assert device_row(ledger, mine.uid) == before
    assert paths(ledger, mine.uid) == {"h1": True}

    # The first host is unaffected and keeps reporting.
    assert refused(beat(ledger, "h1", mine.model_copy(update={"health": "warning"}))) == []
    assert device_row(ledger, mine.uid)[2] == "warning"


def test_uid_naming_another_host_is_refused_even_at_first_sight(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[], tenant=None)
    add_host(ledger, "h2")
    for uid in ("emulated:h1", "h1/numa:node2"):
        reply = beat(ledger, "h2", hostile(uid))
        assert refused(reply) == [(uid, "device_not_bound")]
    with ledger.read() as s:
        assert list(s.scalars(select(Device))) == []
    # A name no host has is an ordinary first sight (agent names and ledger names may differ).
    assert refused(beat(ledger, "h2", device("emulated:h2.example"))) == []


def test_a_refused_item_drops_alone(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[device("h1/numa:node2")], tenant=None)
    add_host(ledger, "h2")
    own = device("h2/numa:node3", local_name="node3", numa_node=3)
    reply = beat(ledger, "h2", hostile("h1/numa:node2"), own)
    assert refused(reply) == [("h1/numa:node2", "device_not_bound")]
    assert paths(ledger, own.uid) == {"h2": True}
    with ledger.read() as s:
        host = hosts.get_by_name(s, "h2")
        assert host.inventory_digest == "d" and host.status == "up"


def test_refusal_never_gives_a_host_a_path_to_place_on(ledger: Ledger) -> None:
    """The attack that moved X's grants onto Y's device: X lists only Y's device."""
    seed(ledger, host="h1", devices=[device("h1/numa:node2")])
    add_host(ledger, "h2")
    beat(ledger, "h2", hostile("h1/numa:node2"))
    with pytest.raises(NoCapacity):
        grant(ledger, "h2")
    with ledger.read() as s:
        assert list(s.scalars(select(Lease))) == []
    assert grant(ledger, "h1").device_uid == "h1/numa:node2"


def test_refusal_is_logged_once_per_host_and_device(
    ledger: Ledger, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_hosts, "_LOGGED", set())  # what earlier tests logged
    seed(ledger, host="h1", devices=[device("h1/numa:node2")], tenant=None)
    add_host(ledger, "h2")
    with caplog.at_level(logging.WARNING, logger="poold.ledger.device_hosts"):
        for _ in range(3):
            assert refused(beat(ledger, "h2", hostile("h1/numa:node2"))) != []
    lines = [r for r in caplog.records if "h1/numa:node2" in r.getMessage()]
    assert len(lines) == 1


def test_shared_device_refused_until_allowed_and_after_disallow(ledger: Ledger) -> None:
    tenant_spec = TenantSpec(name="t1", quota_bytes=GiB, quota_leases=10, allowed_uids=[UID])
    seed(ledger, host="h1", devices=[], tenant=None)
    add_host(ledger, "h2")
    with ledger.write() as s:
        tenants.create(s, tenant_spec, "test")
    head1 = device(SHARED, kind="devdax", memdev_serials=[11, 12], local_name="dax_region0")
    head2 = head1.model_copy(update={"local_name": "dax_region1", "health": "warning"})
    assert refused(beat(ledger, "h1", head1)) == []  # first sight binds h1
    before = device_row(ledger, SHARED)

    # Not allowed: refused, device untouched, no path, no grant of h2 lands there.
    assert refused(beat(ledger, "h2", head2)) == [(SHARED, "device_not_bound")]
    assert device_row(ledger, SHARED) == before
    assert paths(ledger, SHARED) == {"h1": True}
    with pytest.raises(NoCapacity):
        grant(ledger, "h2")

    out = device_hosts.allow_host(ledger, SHARED, "h2", "admin:test")
    assert (out.scope, out.hosts) == ("shared", ["h1", "h2"])
    # The agent sent this inventory already: poold asks for it again.
    again = heartbeat.receive_heartbeat(ledger, "h2", Heartbeat(inventory_digest="d"), "host:h2")
    assert again.want_inventory
    assert refused(beat(ledger, "h2", head2)) == []
    assert paths(ledger, SHARED) == {"h1": True, "h2": True}
    assert device_row(ledger, SHARED)[2] == "warning"  # h2's word counts now
    assert grant(ledger, "h2").device_uid == SHARED
    # Allowing twice changes nothing and journals once.
    assert device_hosts.allow_host(ledger, SHARED, "h2", "admin:test").hosts == ["h1", "h2"]

    out = device_hosts.disallow_host(ledger, SHARED, "h2", "admin:test")
    assert out.hosts == ["h1"]
    assert paths(ledger, SHARED) == {"h1": True, "h2": False}
    with pytest.raises(NoCapacity):
        grant(ledger, "h2")
    before = device_row(ledger, SHARED)
    assert refused(beat(ledger, "h2", head2.model_copy(update={"health": "ok"}))) == [
        (SHARED, "device_not_bound")
    ]
    assert device_row(ledger, SHARED) == before
    assert paths(ledger, SHARED) == {"h1": True, "h2": False}
    with ledger.read() as s:
        kinds = [
            e.kind
            for e in s.scalars(select(Event).order_by(Event.id))
            if e.kind.startswith("device.")
        ]
    assert kinds == ["device.allow_host", "device.disallow_host"]


def test_disallowing_the_only_host_takes_the_device_out_of_placement(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[device(SHARED)])
    generation = device_row(ledger, SHARED)[8]
    device_hosts.disallow_host(ledger, SHARED, "h1", "admin:test")
    row = device_row(ledger, SHARED)
    assert row[7] == "missing" and row[8] == generation + 1
    with pytest.raises(NoCapacity):
        grant(ledger, "h1")
    # Disallowed means refused from now on, not a new first sight.
    assert refused(beat(ledger, "h1", device(SHARED))) == [(SHARED, "device_not_bound")]


def test_allow_host_refusals(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[device("h1/numa:node2"), device(SHARED)], tenant=None)
    add_host(ledger, "h2")
    with pytest.raises(DeviceHostScoped):
        device_hosts.allow_host(ledger, "h1/numa:node2", "h2", "admin:test")
    with pytest.raises(UnknownDevice):
        device_hosts.allow_host(ledger, "nope", "h2", "admin:test")
    with pytest.raises(UnknownHost):
        device_hosts.allow_host(ledger, SHARED, "nobody", "admin:test")
    before = snapshot(ledger)
    assert device_hosts.disallow_host(ledger, SHARED, "h2", "admin:test").hosts == ["h1"]
    assert snapshot(ledger) == before  # disallowing an unbound host: nothing written
    # A host-scoped device moves by disallowing its host first.
    device_hosts.disallow_host(ledger, "h1/numa:node2", "h1", "admin:test")
    out = device_hosts.allow_host(ledger, "h1/numa:node2", "h2", "admin:test")
    assert (out.scope, out.hosts) == ("host", ["h2"])


def test_bindings_go_with_their_host(ledger: Ledger) -> None:
    seed(ledger, host="h1", devices=[device(SHARED)], tenant=None)
    with ledger.write() as s:
        s.delete(hosts.get_by_name(s, "h1"))
    with ledger.read() as s:
        assert list(s.scalars(select(DeviceHost))) == []
