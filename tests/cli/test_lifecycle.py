"""`poolctl leases revoke`, `devices drain`, `hosts drain` and `audit` against a real poold API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import update

from cli.poolctl import main
from poold.api.client import PooldClient
from poold.errors import NoCapacity
from poold.ledger.db import Ledger
from poold.ledger.models import Lease
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "250"}
    )


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient) -> Iterator[PooldClient]:
    credential = admin.add_host("h1").credential
    with PooldClient(api.url, credential) as client:
        yield from _registered(client, admin)


def _registered(client: PooldClient, admin: PooldClient) -> Iterator[PooldClient]:
    client.register(
        Heartbeat(
            inventory=[
                InventoryDevice(
                    uid="h1/numa:node3",
                    kind="numa",
                    capacity_bytes=256 * MiB,
                    local_name="node3",
                    numa_node=3,
                    health="ok",
                )
            ]
        )
    )
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[1000]))
    yield client


def lease(agent: PooldClient, activate: bool = True) -> str:
    return agent.grant(GrantRequest(size_bytes=8 * MiB, uid=1000, pid=7, activate=activate)).id


def test_revoke(api: ThreadedServer, agent: PooldClient) -> None:
    lease_id = lease(agent)
    r = poolctl(api, "leases", "revoke", lease_id)
    assert r.exit_code == 2 and "--reason" in r.output  # a reason is required
    r = poolctl(api, "leases", "revoke", lease_id, "--reason", "maintenance", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["state"] == "revoking"
    assert [x.lease_id for x in agent.heartbeat(Heartbeat()).revocations] == [lease_id]
    [res] = agent.confirm_revoked([lease_id])
    assert res.state == "reclaimed"
    r = poolctl(api, "leases", "revoke", lease_id, "--reason", "again")
    assert r.exit_code == 1 and "lease_not_active" in r.output  # it has ended


def test_device_drain_now_and_undrain(api: ThreadedServer, agent: PooldClient) -> None:
    lease_id = lease(agent)
    r = poolctl(api, "devices", "drain", "node3", "--now", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["state"] == "draining" and out["revoked"] == [lease_id]
    with pytest.raises(NoCapacity):
        lease(agent)  # a drained device gets no new leases
    r = poolctl(api, "devices", "undrain", "h1/numa:node3")
    assert r.exit_code == 0 and "online" in r.output
    lease(agent)


def test_device_drain_with_deadline(api: ThreadedServer, agent: PooldClient) -> None:
    lease(agent)
    r = poolctl(api, "devices", "drain", "node3", "--deadline-s", "600")
    assert r.exit_code == 0, r.output
    assert "draining" in r.output and "1 live lease" in r.output
    r = poolctl(api, "devices", "drain", "nope")
    assert r.exit_code == 1 and "unknown_device" in r.output


def test_host_drain(api: ThreadedServer, agent: PooldClient) -> None:
    lease(agent)
    r = poolctl(api, "hosts", "drain", "h1")
    assert r.exit_code == 0 and "draining" in r.output
    with pytest.raises(NoCapacity):
        lease(agent)
    assert poolctl(api, "hosts", "undrain", "h1").exit_code == 0
    lease(agent)
    assert "unknown_host" in poolctl(api, "hosts", "drain", "nope").output


def test_audit_exit_codes_and_json(api: ThreadedServer, agent: PooldClient, ledger: Ledger) -> None:
    lease(agent)
    r = poolctl(api, "audit", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)  # piped: nothing but the JSON
    assert report["leases"] == 1 and report["exit_code"] == 0 and "audit_s" in report
    stale = lease(agent, activate=False)
    with ledger.write() as s:
        s.execute(
            update(Lease)
            .where(Lease.id == stale)
            .values(granted_at=utcnow() - timedelta(minutes=5))
        )
    r = poolctl(api, "audit")
    assert r.exit_code == 1 and "stale_grant" in r.output and "reclaimable" in r.output
    r = poolctl(api, "audit", "--reclaim")
    assert r.exit_code == 1 and "aborted" in r.output
    assert poolctl(api, "audit", "--reclaim").exit_code == 0
    with ledger.write() as s:
        s.execute(update(Lease).where(Lease.id != stale).values(offset_bytes=1))
    r = poolctl(api, "audit", "--json")
    assert r.exit_code == 2 and json.loads(r.output)["violations"][0]["kind"] == "misaligned"


def test_audit_unreachable_needs_a_human() -> None:
    r = CliRunner().invoke(main, ["--url", "http://127.0.0.1:9", "--token", "x", "audit"])
    assert r.exit_code == 2 and "poold_unreachable" in r.output
