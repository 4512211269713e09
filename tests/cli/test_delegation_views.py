"""poolctl against a real poold with delegated capacity: status and devices show the
reserved-but-unleased bytes apart from leased and free, `leases list` says where each
lease was granted, and `devices map` draws reservations in a class of their own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from cli.poolctl import main
from poold.api.client import PooldClient
from poold.errors import QuotaExceeded
from poold.ledger.types import utcnow
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice, LeaseOp
from poold.wire.delegation import BudgetWant, DelegationRequest, LocalGrant, ReserveWant
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.api.test_metrics import scrape

MiB = 1 << 20
NODE = "h1/numa:node3"


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "250"}
    )


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient) -> Iterator[PooldClient]:
    """A 256 MiB NUMA node; one 16 MiB reservation (a 4 MiB local lease in it), and a
    2 MiB central lease."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="alpha", quota_bytes=1 << 30, allowed_uids=[1000]))
    with PooldClient(api.url, credential) as client:
        client.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=NODE, kind="numa", capacity_bytes=256 * MiB, local_name="node3"
                    )
                ]
            )
        )
        client.grant(GrantRequest(size_bytes=2 * MiB, uid=1000, pid=7, activate=True))
        d = client.delegate(
            DelegationRequest(
                reserve=[ReserveWant(bytes=16 * MiB)],
                budgets=[BudgetWant(tenant="alpha", bytes=8 * MiB, leases=4)],
            )
        )
        res = d.reservations[0]
        grant = LocalGrant(
            lease_id="local-lease-1",
            reservation_id=res.id,
            tenant="alpha",
            offset_bytes=res.offset_bytes,
            length_bytes=4 * MiB,
            requested_bytes=4 * MiB,
            epoch=res.epoch_base,
            ttl_s=60,
            granted_at=utcnow(),
            uid=1000,
            pid=8,
        )
        (done,) = client.apply_ops(
            [LeaseOp(lease_id=grant.lease_id, op="local_grant", grant=grant)]
        )
        assert done.code is None
        yield client


def test_status_and_devices_show_delegated_bytes(api: ThreadedServer, agent: PooldClient) -> None:
    out = poolctl(api, "status", "--json")
    assert out.exit_code == 0, out.output
    st = json.loads(out.output)
    # 16 MiB reserved, 4 MiB of it leased: 12 MiB delegated; free excludes the reservation.
    assert st["delegated_bytes"] == 12 * MiB
    assert st["leased_bytes"] == 6 * MiB
    assert st["free_bytes"] == (256 - 2 - 16) * MiB
    assert st["hosts"][0]["delegated_bytes"] == 12 * MiB
    text = poolctl(api, "status").output
    assert "delegated" in text
    assert "12.0 MiB delegated" in text

    shown = poolctl(api, "devices", "show", NODE)
    assert shown.exit_code == 0, shown.output
    assert "12.0 MiB: [" in shown.output and "h1 (12.0 MiB unleased)" in shown.output
    listed = poolctl(api, "devices")
    assert "delegated" in listed.output


def test_leases_list_says_where_a_lease_was_granted(
    api: ThreadedServer, agent: PooldClient
) -> None:
    out = poolctl(api, "leases", "list")
    assert out.exit_code == 0, out.output
    rows = {line.split()[0]: line for line in out.output.splitlines() if line.strip()}
    assert rows["local-lease-1"].rstrip().split()[-1].startswith("h1:")
    central = [line for line in out.output.splitlines() if line.rstrip().endswith("central")]
    assert len(central) == 1
    js = json.loads(poolctl(api, "leases", "list", "--json").output)
    assert sorted(x["reservation_id"] is None for x in js) == [False, True]


def test_devices_map_draws_reservations_apart(api: ThreadedServer, agent: PooldClient) -> None:
    out = poolctl(api, "devices", "map", "--json")
    assert out.exit_code == 0, out.output
    (m,) = json.loads(out.output)
    kinds = [(e["kind"], e["length_bytes"]) for e in m["extents"]]
    assert ("delegated", 12 * MiB) in kinds
    assert m["delegated_bytes"] == 12 * MiB
    plain = poolctl(api, "devices", "map")
    assert "= delegated" in plain.output
    assert "=" in plain.output.splitlines()[1]


def test_tenants_show_says_when_a_central_room_keeps_quota_out_of_budgets(
    api: ThreadedServer, admin: PooldClient
) -> None:
    """Two hosts' budgets hold a 48 MiB quota; a 32 MiB central grant is refused for
    them and the tenant's room shows (poold/ledger/central_room.py)."""
    admin.create_tenant(
        TenantSpec(name="tight", quota_bytes=48 * MiB, quota_leases=3, allowed_uids=[1000])
    )
    assert "central room" not in poolctl(api, "tenants", "show", "tight").output
    assert scrape(api.url)[("poold_tenant_central_room_bytes", (("tenant", "tight"),))] == 0
    clients = []
    for host in ("h1", "h2"):
        credential = admin.add_host(host).credential
        client = PooldClient(api.url, credential)
        clients.append(client)
        client.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=f"{host}/numa:node1",
                        kind="numa",
                        capacity_bytes=256 * MiB,
                        local_name="node1",
                    )
                ]
            )
        )
    want = DelegationRequest(budgets=[BudgetWant(tenant="tight", bytes=24 * MiB, leases=1)])
    try:
        for client in clients:
            assert client.delegate(want).budgets[0].bytes == 24 * MiB
        with pytest.raises(QuotaExceeded) as err:
            clients[0].grant(
                GrantRequest(tenant="tight", size_bytes=32 * MiB, uid=1000, pid=7, activate=True)
            )
        assert err.value.detail.get("held_by_budgets") is True
    finally:
        for client in clients:
            client.close()
    shown = poolctl(api, "tenants", "show", "tight")
    assert shown.exit_code == 0, shown.output
    # 32 MiB is over half the quota: the whole quota is kept out of budgets.
    assert "central room: 48.0 MiB" in shown.output
    out = json.loads(poolctl(api, "tenants", "show", "tight", "--json").output)
    assert out["central_room_bytes"] == 48 * MiB and out["central_room_until"]
    got = scrape(api.url)
    assert got[("poold_tenant_central_room_bytes", (("tenant", "tight"),))] == 48 * MiB
