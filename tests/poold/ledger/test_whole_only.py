"""Whole-only devices (static dax regions, leased only whole), on SQLite and PostgreSQL:
poold stores the agent's marker and places only a lease of exactly the device's usable
size there; anything else goes elsewhere or is ``no_capacity``, never a grant the agent
then aborts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from poold.api.client import PooldClient
from poold.errors import NoCapacity
from poold.ledger import heartbeat, hosts, leases
from poold.ledger.db import Ledger
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from poold.wire.common import LeaseOut
from tests.conftest import ThreadedServer
from tests.poold.conftest import UID, MiB, device, seed

STATIC = 250 * MiB  # the QEMU guest's pmem namespace: 256 MiB less its metadata


def static_dax(uid: str = "static-0", **kw: Any) -> InventoryDevice:
    fields: dict[str, Any] = {
        "kind": "devdax",
        "local_name": "dax_region1",
        "capacity_bytes": STATIC,
        "whole_only": True,
    }
    fields.update(kw)
    return device(uid, **fields)


def grant(ledger: Ledger, size: int) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=size, uid=UID, pid=1, activate=True),
        "agent:test",
    )


def test_a_part_goes_to_a_carvable_device_and_the_whole_to_the_static_one(
    ledger: Ledger,
) -> None:
    carvable = device("carvable-0", kind="devdax", local_name="dax_region0")
    seed(ledger, devices=[static_dax(), carvable])
    assert grant(ledger, 2 * MiB).device_uid == "carvable-0"
    whole = grant(ledger, STATIC)
    assert (whole.device_uid, whole.offset_bytes, whole.length_bytes) == ("static-0", 0, STATIC)
    with pytest.raises(NoCapacity):  # leased whole: nothing is left on it
        grant(ledger, STATIC)


def test_a_part_of_a_lone_static_device_is_no_capacity(ledger: Ledger) -> None:
    seed(ledger, devices=[static_dax()])
    for size in (2 * MiB, STATIC - 2 * MiB, STATIC + 2 * MiB):
        with pytest.raises(NoCapacity) as err:
            grant(ledger, size)
        assert err.value.detail["free_by_device"] == {"static-0": STATIC}
    assert grant(ledger, STATIC).offset_bytes == 0


def test_the_marker_follows_the_inventory(ledger: Ledger) -> None:
    """The agent's word each inventory: a device reported carvable again takes parts."""
    seed(ledger, devices=[static_dax()])
    with pytest.raises(NoCapacity):
        grant(ledger, 2 * MiB)
    with ledger.write() as s:
        heartbeat.upsert_inventory(s, hosts.get_by_name(s, "h1"), [static_dax(whole_only=False)])
    assert grant(ledger, 2 * MiB).device_uid == "static-0"


def test_the_marker_over_the_api_and_an_older_agent_without_it(
    api: ThreadedServer, admin: PooldClient
) -> None:
    credential = admin.add_host("h1").credential
    admin.create_tenant(
        TenantSpec(name="t1", quota_bytes=1 << 30, quota_leases=8, allowed_uids=[UID])
    )
    old = {  # an agent that predates whole_only: its JSON has no such key
        "uid": "old-0",
        "kind": "devdax",
        "media": "ddr5",
        "capacity_bytes": 64 * MiB,
        "alignment_bytes": 2 * MiB,
        "health": "ok",
        "local_name": "dax_region0",
        "numa_node": 1,
    }
    new = static_dax().model_dump(mode="json")
    with httpx.Client(base_url=api.url) as http:
        resp = http.post(
            "/v1/agent/register",
            headers={"authorization": f"Bearer {credential}", "content-type": "application/json"},
            content=json.dumps({"agent_version": "0.1", "inventory": [old, new]}),
        )
    assert resp.status_code == 200, resp.text
    agent = PooldClient(api.url, credential)
    try:
        req = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, activate=True)
        assert agent.grant(req).device_uid == "old-0"  # the older agent's device: carvable
        # Only the static device left on the host: a part of it is no_capacity, at once.
        agent.heartbeat(Heartbeat(agent_version="0.1", inventory=[static_dax()]))
        with pytest.raises(NoCapacity):
            agent.grant(req.model_copy(update={"pid": 2}))
        whole = agent.grant(req.model_copy(update={"pid": 3, "size_bytes": STATIC}))
        assert (whole.device_uid, whole.length_bytes) == ("static-0", STATIC)
    finally:
        agent.close()
