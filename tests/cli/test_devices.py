"""`poolctl devices` against a real poold API, on both ledger backends."""

from __future__ import annotations

import json

from click.testing import CliRunner, Result

from cli.poolctl import main
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20
CXL = "cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"
NODE = "h1/numa:node3"


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "250"}
    )


def seed(api: ThreadedServer, admin: PooldClient) -> None:
    credential = admin.add_host("h1").credential
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=CXL,
                        kind="devdax",
                        media="ddr5",
                        capacity_bytes=512 * MiB,
                        local_name="dax_region0",
                        numa_node=2,
                        memory_tier=22,
                        memdev_serials=[3, 4],
                        health="warning",
                        health_reasons=["serial 3: life used 91%"],
                    ),
                    InventoryDevice(
                        uid=NODE,
                        kind="numa",
                        capacity_bytes=256 * MiB,
                        local_name="node3",
                        numa_node=3,
                        health="ok",
                    ),
                ]
            )
        )
        admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[1000]))
        agent.grant(GrantRequest(size_bytes=64 * MiB, uid=1000, pid=42, media="ddr5"))


def test_devices_table_and_json(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin)
    r = poolctl(api, "devices")
    assert r.exit_code == 0, r.output
    for text in (CXL, NODE, "devdax", "numa", "ddr5", "512.0 MiB", "448.0 MiB", "warning", "22"):
        assert text in r.output, text
    r = poolctl(api, "devices", "--json")
    assert r.exit_code == 0, r.output
    rows = {d["uid"]: d for d in json.loads(r.output)}
    cxl = rows[CXL]
    assert cxl["kind"] == "devdax" and cxl["media"] == "ddr5" and cxl["recycled"] is False
    assert cxl["capacity_bytes"] == 512 * MiB and cxl["free_bytes"] == 448 * MiB
    assert cxl["numa_node"] == 2 and cxl["memory_tier"] == 22
    assert cxl["health"] == "warning" and cxl["health_reasons"] == ["serial 3: life used 91%"]
    assert cxl["state"] == "online" and cxl["memdev_serials"] == [3, 4]
    assert rows[NODE]["media"] == "unknown" and rows[NODE]["numa_node"] == 3


def test_annotate_by_uid_id_and_local_name(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin)
    r = poolctl(
        api,
        "devices",
        "annotate",
        CXL,
        "--media",
        "ddr4",
        "--recycled",
        "--provenance",
        "retired from rack 12 host 7",
        "--cost-per-gib-month",
        "0.4",
        "--json",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["media"] == "ddr4" and out["recycled"] is True
    assert out["provenance"] == "retired from rack 12 host 7"
    assert out["admin_annotations"]["cost_per_gib_month"] == 0.4

    r = poolctl(api, "devices", "annotate", "h1:node3", "--media", "ddr5")
    assert r.exit_code == 0, r.output
    assert "ddr5" in r.output and NODE in r.output
    node_id = str({d.uid: d for d in admin.status().devices}[NODE].id)
    r = poolctl(api, "devices", "annotate", node_id, "--not-recycled", "--clear", "media")
    assert r.exit_code == 0, r.output

    rows = {d["uid"]: d for d in json.loads(poolctl(api, "devices", "--json").output)}
    assert rows[CXL]["media"] == "ddr4" and rows[CXL]["recycled"] is True
    assert rows[NODE]["media"] == "unknown" and rows[NODE]["recycled"] is False
    r = poolctl(api, "devices")
    assert "ddr4" in r.output and "yes" in r.output

    r = poolctl(api, "devices", "show", "dax_region0")
    assert r.exit_code == 0, r.output
    assert "retired from rack 12 host 7" in r.output and "3,4" in r.output


def test_annotate_survives_agent_reinventory(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin)
    assert poolctl(api, "devices", "annotate", CXL, "--media", "ddr4").exit_code == 0
    # The agent re-registers with its own view (ddr5): the admin's word stays.
    credential = admin.add_host("h2").credential
    admin.allow_device_host(CXL, "h2")  # a second head of a shared device (device_hosts.py)
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(uid=CXL, kind="devdax", media="ddr5", capacity_bytes=512 * MiB)
                ]
            )
        )
    rows = {d["uid"]: d for d in json.loads(poolctl(api, "devices", "--json").output)}
    assert rows[CXL]["media"] == "ddr4" and rows[CXL]["hosts"] == ["h1", "h2"]


def test_annotate_errors(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin)
    r = poolctl(api, "devices", "annotate", "nope", "--media", "ddr4")
    assert r.exit_code == 1 and "error[unknown_device]" in r.output
    r = poolctl(api, "devices", "annotate", CXL)
    assert r.exit_code == 2 and "nothing to annotate" in r.output
    r = poolctl(api, "devices", "annotate", CXL, "--media", "DDR 4")
    assert r.exit_code == 1 and "error[bad_request]" in r.output
    r = poolctl(api, "devices", "annotate", CXL, "--media", "ddr4", "--clear", "media")
    assert r.exit_code == 1 and "error[bad_request]" in r.output
    r = poolctl(api, "devices", "annotate", CXL, "--cost-per-gib-month", "-1")
    assert r.exit_code == 2
    rows = {d["uid"]: d for d in json.loads(poolctl(api, "devices", "--json").output)}
    assert rows[CXL]["media"] == "ddr5"
